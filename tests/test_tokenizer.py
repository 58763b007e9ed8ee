"""Tokenizer: local tokenizer.json loading, BPE training on a real corpus, caching, round trips."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flexmesh.data import tokenizer as tokmod
from flexmesh.data.corpus import read_corpus, stdlib_corpus_dir
from flexmesh.data.tokenizer import load_tokenizer, tokenizer_hash, train_bpe
from flexmesh.errors import DataError


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """A copy of one standard-library package: real Python text, small enough to train on quickly."""
    dst = tmp_path_factory.mktemp("corpus") / "json"
    shutil.copytree(stdlib_corpus_dir() / "json", dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


@pytest.fixture(scope="module")
def trained(small_corpus, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return train_bpe(small_corpus, vocab_size=400, cache_dir=cache), cache


def test_trained_bpe_has_bytes_merges_and_bounded_vocab(trained) -> None:
    tok, _ = trained
    vocab = tok.get_vocab()
    assert 257 < len(vocab) <= 400
    assert tokmod.END_OF_TEXT in vocab
    text = "def encode(self, obj):\n    return obj\n"
    # Merges must compress common Python text well below one token per byte.
    assert len(tok.encode(text).ids) < len(text.encode()) / 2


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200))
def test_byte_level_round_trip_for_any_text(trained, text) -> None:
    """Any text but the special token's own spelling, which the tokenizer reads as that token (next test)."""
    tok, _ = trained
    assume(tokmod.END_OF_TEXT not in text)
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids) == text


def test_the_special_tokens_spelling_is_read_as_the_token(trained) -> None:
    tok, _ = trained
    ids = tok.encode(f"a{tokmod.END_OF_TEXT}b", add_special_tokens=False).ids
    assert tok.token_to_id(tokmod.END_OF_TEXT) in ids
    assert tok.decode(ids) == "ab"  # decoding skips special tokens


def test_cache_is_reused_and_invalidated_by_corpus_change(small_corpus, tmp_path, monkeypatch) -> None:
    first = train_bpe(small_corpus, vocab_size=300, cache_dir=tmp_path)
    cached = list((tmp_path / "tokenizers").glob("bpe-*.json"))
    assert len(cached) == 1

    def no_training(*a, **k):
        raise AssertionError("retrained although the cache holds this tokenizer")

    monkeypatch.setattr(tokmod.trainers, "BpeTrainer", no_training)
    assert tokenizer_hash(train_bpe(small_corpus, vocab_size=300, cache_dir=tmp_path)) == tokenizer_hash(first)
    monkeypatch.undo()

    corpus_copy = tmp_path / "edited"
    shutil.copytree(small_corpus, corpus_copy)
    (corpus_copy / "extra.py").write_text("x = 1\n" * 50)
    train_bpe(corpus_copy, vocab_size=300, cache_dir=tmp_path)
    assert len(list((tmp_path / "tokenizers").glob("bpe-*.json"))) == 2


def test_training_is_deterministic(small_corpus, tmp_path) -> None:
    a = train_bpe(small_corpus, vocab_size=300, cache_dir=tmp_path / "a")
    b = train_bpe(small_corpus, vocab_size=300, cache_dir=tmp_path / "b")
    assert a.to_str() == b.to_str()


def test_cache_dir_from_environment(small_corpus, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLEXMESH_CACHE", str(tmp_path / "env"))
    train_bpe(read_corpus(small_corpus), vocab_size=280)
    assert list((tmp_path / "env" / "tokenizers").glob("bpe-*.json"))


def test_load_tokenizer_from_file_or_folder(trained, tmp_path) -> None:
    tok, _ = trained
    tok.save(str(tmp_path / "tokenizer.json"))
    for p in (tmp_path / "tokenizer.json", tmp_path):
        assert load_tokenizer(p).encode("import os").ids == tok.encode("import os").ids


def test_load_tokenizer_errors(tmp_path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        load_tokenizer(bad)


def test_vocab_too_small_is_rejected(small_corpus, tmp_path) -> None:
    with pytest.raises(DataError, match="at least 257"):
        train_bpe(small_corpus, vocab_size=100, cache_dir=tmp_path)
