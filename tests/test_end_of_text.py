"""`flexmesh train` puts the tokenizer's end-of-text token after every document, as torchtitan and Megatron-LM
do, so a model learns where a text ends: the flexmesh BPE's <|endoftext|>, the eos a tokenizer beside --weights
(or a --tokenizer) declares, none with --no-end-of-text, and a tokenizer without one said once. The id is the
one an export names as eos_token_id, and the run records it in corpus.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from flexmesh.commands import train as train_command
from flexmesh.commands.train_data import corpus_tokens_of, document_loader
from flexmesh.data.hf_tokenizer import special_token_ids, tokenizer_config
from flexmesh.data.run_corpus import RUN_CORPUS
from flexmesh.spec.model import parse_model

SPEC = parse_model("gpt:2:64:4:320")


def _job(tokens_per_batch: int | None = None):
    """What corpus_tokens_of and document_loader read of a Job: the model, no tasks, the batch."""
    return SimpleNamespace(model=SPEC, parts=SimpleNamespace(tasks=None), seq_len=4096, global_batch=4,
                           tokens_per_batch=tokens_per_batch)


def _args(tmp: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["train", "--max-steps", "1", "--out", str(tmp / "run"), "--corpus", str(tmp / "corpus"),
                              "--cache-dir", str(tmp / "cache"), *argv])


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(6):
        (folder / f"d{i}.txt").write_text(f"document {i}: " + "the quick brown fox " * (3 + i))
    return folder


def _records(tmp: Path, *argv: str):
    """corpus_tokens_of's answer, with its records written as the training loop writes them."""
    records: list = []
    run = corpus_tokens_of(_args(tmp, *argv), _job(), records)
    for write in records:
        write()
    return run


def test_each_document_of_a_run_ends_with_the_bpes_end_of_text(tmp_path, corpus, capsys):
    run = _records(tmp_path)
    tokens, tok = run.tokens, run.tokenizer
    eos = tok.token_to_id("<|endoftext|>")
    assert tokens.end_of_text == eos and len(tokens) == 6
    texts = sorted(corpus.iterdir())
    for i, f in enumerate(texts):  # each document's ids, then the eos: the boundary the model learns to stop at
        assert tokens[i].tolist() == [*tok.encode(f.read_text(), add_special_tokens=False).ids, eos]
    batch = next(document_loader(_args(tmp_path), _job(), run))
    assert [int(d[-1]) for d in batch] == [eos] * 4
    record = json.loads((tmp_path / "run" / RUN_CORPUS).read_text())
    assert record["end_of_text"] == eos
    recorded = json.loads((tmp_path / "run" / "tokenizer" / "tokenizer_config.json").read_text())
    assert special_token_ids(tok, recorded)["eos_token_id"] == eos  # what an export writes as eos_token_id
    assert "warning" not in capsys.readouterr().err


def test_no_end_of_text_feeds_documents_as_they_are(tmp_path, corpus):
    tokens, tok, _ = _records(tmp_path, "--no-end-of-text")
    assert tokens.end_of_text is None
    first = sorted(corpus.iterdir())[0].read_text()
    assert tokens[0].tolist() == tok.encode(first, add_special_tokens=False).ids
    assert json.loads((tmp_path / "run" / RUN_CORPUS).read_text())["end_of_text"] is None


def _weights_folder(tmp: Path, declared: dict | None) -> Path:
    """A model folder as Hugging Face holds one: a tokenizer with <s>, </s> (no <|endoftext|>) and, when
    ``declared``, the tokenizer_config.json naming its special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4, trainer)
    folder = tmp / "weights"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    if declared is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(declared))
    return folder


def test_the_weights_tokenizer_ends_documents_with_its_declared_eos(tmp_path, corpus, capsys):
    weights = _weights_folder(tmp_path, {"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    tokens, tok, _ = _records(tmp_path, "--weights", str(weights))
    eos = tok.token_to_id("</s>")
    assert tokens.end_of_text == eos and all(int(tokens[i][-1]) == eos for i in range(len(tokens)))
    config = tokenizer_config(tok, {"eos": "</s>"}, 512)
    assert special_token_ids(tok, config)["eos_token_id"] == eos
    assert "warning" not in capsys.readouterr().err


def test_a_tokenizer_without_an_eos_is_said_once_and_feeds_none(tmp_path, corpus, capsys):
    weights = _weights_folder(tmp_path, None)  # no tokenizer_config.json, no <|endoftext|>
    tokens, tok, _ = _records(tmp_path, "--weights", str(weights))
    assert tokens.end_of_text is None
    assert tokens[0].tolist() == tok.encode(sorted(corpus.iterdir())[0].read_text(), add_special_tokens=False).ids
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning")]
    assert len(err) == 1 and "names no end-of-text token" in err[0] and "--no-end-of-text" in err[0]
    corpus_tokens_of(_args(tmp_path, "--weights", str(weights), "--no-end-of-text"), _job(), [])
    assert "warning" not in capsys.readouterr().err  # asked for none: nothing to say
