"""`flexmesh export` writes the tokenizer the run used, so the exported model encodes and generates text.

One real one-step `flexmesh train` run (one process, a 2-layer Llama, the byte-level BPE flexmesh
trains and caches) records its tokenizer in ``RUN/tokenizer/``; its export loads with
``transformers.AutoTokenizer``, encodes text to the ids flexmesh trained on and decodes it back, and
``AutoModelForCausalLM.generate`` makes 20 new tokens from a prompt it encoded. Also: a run from
before tokenizers were recorded (a warning, and ``--tokenizer``), a ``--tokenizer`` whose
``tokenizer_config.json`` names its own special tokens, and the errors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flexmesh.data.hf_tokenizer import RUN_TOKENIZER, record_tokenizer
from flexmesh.errors import DataError

torch.set_num_threads(1)
TEXT = "the quick brown fox\n  jumps over\ta lazy dog: été, 北京, 😀 -- seven wizards!"
PROMPT = "the quick brown fox jumps over"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Path]:
    """A one-step `flexmesh train` run of a 2-layer Llama (vocabulary 320) on the BPE flexmesh trains."""
    from helpers import flexmesh, write_inputs

    tmp = tmp_path_factory.mktemp("tokenizer-run")
    config, corpus, plan = write_inputs(tmp, world=1)
    r = flexmesh("train", "--plan", str(plan), "--corpus", str(corpus), "--max-steps", "1", "--out",
                 str(tmp / "run"), "--cache-dir", str(tmp / "cache"), "--no-progress")
    assert r.returncode == 0, r.stderr[-4000:]
    return {"run": tmp / "run", "config": config, "corpus": corpus, "cache": tmp / "cache", "tmp": tmp}


def _flexmesh_bpe(run: dict[str, Path]):
    """The tokenizer the run trained on: the cached BPE of its corpus and the model's vocabulary."""
    from flexmesh.data.tokenizer import train_bpe

    return train_bpe(run["corpus"], vocab_size=320, cache_dir=run["cache"])


@pytest.mark.slow
def test_export_loads_in_transformers_encodes_as_training_did_and_generates(run, tmp_path):
    transformers = pytest.importorskip("transformers")
    from flexmesh.cli import main

    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run["run"]), "--out", str(out)]) == 0
    bpe = _flexmesh_bpe(run)
    recorded = run["run"] / RUN_TOKENIZER / "tokenizer.json"
    assert (out / "tokenizer.json").read_bytes() == recorded.read_bytes()
    assert json.loads(recorded.read_text()) == json.loads(bpe.to_str())

    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok(TEXT)["input_ids"]
    assert ids == bpe.encode(TEXT, add_special_tokens=False).ids  # the ids training fed the model
    assert tok.decode(ids) == TEXT
    # no BOS; <|endoftext|> ends every document training fed (as the run records) and pads
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (None, "<|endoftext|>", "<|endoftext|>")
    eos = bpe.token_to_id("<|endoftext|>")
    assert json.loads((run["run"] / "corpus.json").read_text())["end_of_text"] == eos
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    for d in (config, generation):  # not transformers' Llama defaults (bos 1, eos 2: byte tokens here)
        assert (d["bos_token_id"], d["eos_token_id"], d["pad_token_id"]) == (None, eos, eos)

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == eos
    prompt = tok(PROMPT, return_tensors="pt")
    n = prompt["input_ids"].shape[1]
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert generated.shape == (1, n + 20) and torch.equal(generated[0, :n], prompt["input_ids"][0])
    assert int(generated.max()) < 320 and tok.decode(generated[0, :n]) == PROMPT


def test_a_run_that_recorded_no_tokenizer_exports_with_a_warning(run, tmp_path, capsys):
    from flexmesh.cli import main

    old = tmp_path / "old"
    shutil.copytree(run["run"], old)
    shutil.rmtree(old / RUN_TOKENIZER)  # as runs made before flexmesh recorded their tokenizer
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(old), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "warning: the run of" in captured.err and "records no tokenizer" in captured.err
    assert "pass --tokenizer" in captured.err and "no tokenizer" in " ".join(captured.out.split())  # wrapped at 80
    assert not (out / "tokenizer.json").exists() and not (out / "generation_config.json").exists()
    assert "eos_token_id" not in json.loads((out / "config.json").read_text())

    cached = next((run["cache"] / "tokenizers").glob("bpe-*.json"))  # the BPE the run trained, as the warning says
    assert main(["export", "--checkpoint", str(old), "--out", str(out), "--tokenizer", str(cached),
                 "--overwrite"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert (out / "tokenizer.json").read_bytes() == cached.read_bytes()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
    # an export without a tokenizer over one with: the earlier tokenizer files go, they are not this model's
    assert main(["export", "--checkpoint", str(old), "--out", str(out), "--overwrite"]) == 0
    assert not any((out / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"))


def _own_tokenizer(folder: Path, vocab: int = 300):
    """A BPE with <s>, </s> and <pad> whose post-processor adds <s>, and the tokenizer_config.json that
    declares them, as a Hugging Face model folder holds them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT, PROMPT * 3], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "pad_token": "<pad>",
        "unk_token": None, "add_bos_token": True}))
    return tok


def _record(out, tok, source, max_length):
    """What `flexmesh train` does once a resume's checks pass: write the record; its warning."""
    write, warning = record_tokenizer(out, tok, source, max_length)
    if write is not None:
        write()
    return warning


def test_a_given_tokenizer_keeps_its_special_tokens_and_encodes_as_training_did(run, tmp_path):
    transformers = pytest.importorskip("transformers")
    from flexmesh.runtime.state.export import checkpoint_spec, export_checkpoint

    own = _own_tokenizer(tmp_path / "own")
    assert own.encode(PROMPT).ids[0] == 1  # its post-processor adds <s>; training encodes without it
    # what `flexmesh train --tokenizer own/tokenizer.json` records
    assert _record(tmp_path / "run", own, tmp_path / "own" / "tokenizer.json", 512) is None
    assert (tmp_path / "run" / RUN_TOKENIZER / "tokenizer.json").read_bytes() == \
        (tmp_path / "own" / "tokenizer.json").read_bytes()
    written = json.loads((tmp_path / "run" / RUN_TOKENIZER / "tokenizer_config.json").read_text())
    assert (written["bos_token"], written["eos_token"], written["pad_token"]) == ("<s>", "</s>", "<pad>")
    assert written["model_max_length"] == 512

    spec = checkpoint_spec(run["run"])
    report = export_checkpoint(run["run"], tmp_path / "hf", spec, tokenizer=tmp_path / "run" / RUN_TOKENIZER)
    assert report.tokenizer == tmp_path / "run" / RUN_TOKENIZER / "tokenizer.json" and report.warnings == ()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok(TEXT)["input_ids"] == own.encode(TEXT, add_special_tokens=False).ids  # no <s>, as training
    assert tok.decode(tok(TEXT)["input_ids"]) == TEXT
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)


def test_a_resume_under_another_tokenizer_is_refused_unless_asked(tmp_path):
    from flexmesh.errors import DataError

    first = _own_tokenizer(tmp_path / "a")
    second = _own_tokenizer(tmp_path / "b", vocab=280)
    assert _record(tmp_path / "run", first, None, 512) is None
    assert record_tokenizer(tmp_path / "run", first, None, 512) == (None, None)  # the same one again: nothing to do
    recorded = (tmp_path / "run" / RUN_TOKENIZER / "tokenizer.json").read_bytes()
    with pytest.raises(DataError, match="records another tokenizer.*--new-tokenizer"):
        record_tokenizer(tmp_path / "run", second, None, 512)
    assert (tmp_path / "run" / RUN_TOKENIZER / "tokenizer.json").read_bytes() == recorded  # nothing changed
    write, warning = record_tokenizer(tmp_path / "run", second, None, 512, replace=True)
    assert (tmp_path / "run" / RUN_TOKENIZER / "tokenizer.json").read_bytes() == recorded  # checked, not yet written
    assert write is not None and warning is not None and "held another tokenizer" in warning
    write()
    from flexmesh.data.tokenizer import load_tokenizer, tokenizer_hash

    assert tokenizer_hash(load_tokenizer(tmp_path / "run" / RUN_TOKENIZER)) == tokenizer_hash(second)


def test_a_tokenizer_larger_than_the_model_is_refused_before_writing(run, tmp_path):
    from tokenizers import Tokenizer, models

    from flexmesh.runtime.state.export import checkpoint_spec, export_checkpoint

    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(400)}, unk_token="w0"))
    big.save(str(tmp_path / "big.json"))
    with pytest.raises(DataError, match="has 400 tokens but model .* only 320: it is not the run's"):
        export_checkpoint(run["run"], tmp_path / "hf", checkpoint_spec(run["run"]), tokenizer=tmp_path / "big.json")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(DataError, match="does not exist"):
        export_checkpoint(run["run"], tmp_path / "hf", checkpoint_spec(run["run"]), tokenizer=tmp_path / "none.json")


def _failing_save(monkeypatch, after: int) -> None:
    """safetensors' writer as on a disk that fills up after ``after`` shards."""
    import errno

    import safetensors.torch

    real, calls = safetensors.torch.save_file, []

    def save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) > after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


@pytest.mark.parametrize("after", [0, 2])
def test_export_on_a_full_disk_leaves_nothing_half_written(run, tmp_path, capsys, monkeypatch, after):
    from flexmesh.cli import main

    _failing_save(monkeypatch, after)
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run["run"]), "--out", str(out), "--max-shard-size", "40KB"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "the disk is full" in err and "Traceback" not in err, err
    assert not out.exists()  # the folder it made, with every shard it wrote, is gone


def test_an_overwrite_on_a_full_disk_keeps_the_earlier_export_as_it_was(run, tmp_path, capsys, monkeypatch):
    from flexmesh.cli import main

    out = tmp_path / "hf"
    (out / "mine.txt").parent.mkdir()
    (out / "mine.txt").write_text(VICTIM := "a file of the user's")
    assert main(["export", "--checkpoint", str(run["run"]), "--out", str(out), "--max-shard-size", "40KB"]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "config.json" in before and sum(n.endswith(".safetensors") for n in before) > 1
    _failing_save(monkeypatch, 1)
    assert main(["export", "--checkpoint", str(run["run"]), "--out", str(out), "--max-shard-size", "40KB",
                 "--overwrite", "--dtype", "bf16"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the disk is full" in err and "the earlier export there is kept as it was" in err
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after == before and (out / "mine.txt").read_text() == VICTIM  # nothing of the new one, nothing lost


def test_a_safetensors_error_while_writing_is_one_line_and_leaves_nothing(run, tmp_path, capsys, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    from flexmesh.cli import main

    def save_file(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 5, kind: Other, message: \"I/O error\" })")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run["run"]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "cannot write the export" in err and "I/O error" in err
    assert not out.exists()  # it made the folder, so it removed it


def test_an_out_path_too_long_is_one_line(run, tmp_path, capsys):
    from flexmesh.cli import main

    for out in (tmp_path / ("x" * 300), tmp_path / "a" / ("x" * 300) / "b"):
        with pytest.raises(SystemExit) as stop:
            main(["export", "--checkpoint", str(run["run"]), "--out", str(out)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "Traceback" not in err
        assert "a name in it is 300 bytes, longer than the file system allows (255)" in err.splitlines()[-1]
