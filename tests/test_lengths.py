"""Length sources: shipped distributions, files, synthetic lengths and reproducible batches."""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pytest

from flexmesh.data.lengths import BatchSampler, load_lengths, synthetic_lengths
from flexmesh.errors import FlexmeshError


@pytest.mark.parametrize("name,n,mean", [("wikipedia", 1_000_000, 1014), ("prolong", 77_932, 3052),
                                         ("wlbllm", 99_519, 3962)])
def test_shipped_distributions_match_their_readme(name, n, mean):
    a = load_lengths(name)
    assert a.dtype == np.int64 and a.size == n and a.min() >= 1
    assert abs(a.mean() - mean) < 1.0  # means as published in the data README


def test_synthetic_name_is_seeded_and_heavy_tailed():
    a = load_lengths("synthetic")
    assert np.array_equal(a, load_lengths("synthetic"))
    top = np.sort(a)[-len(a) // 20:]
    assert top.sum() > 0.3 * a.sum()  # the longest 5% hold a large share of tokens


def test_files_txt_and_json(tmp_path):
    (tmp_path / "a.txt").write_text("5\n7\n\n9\n")
    (tmp_path / "b.json").write_text(json.dumps([3, 4]))
    assert load_lengths(str(tmp_path / "a.txt")).tolist() == [5, 7, 9]
    assert load_lengths(str(tmp_path / "b.json")).tolist() == [3, 4]


def test_bad_inputs_say_what_to_change(tmp_path):
    with pytest.raises(FlexmeshError, match="wikipedia"):
        load_lengths("no-such-dataset")
    (tmp_path / "bad.txt").write_text("5\nfive\n")
    with pytest.raises(FlexmeshError, match="one integer per line"):
        load_lengths(str(tmp_path / "bad.txt"))
    (tmp_path / "zero.json").write_text("[3, 0]")
    with pytest.raises(FlexmeshError, match=">= 1"):
        load_lengths(str(tmp_path / "zero.json"))


def test_synthetic_lengths_seeded_and_clipped():
    a, b, c = synthetic_lengths(5000, 1), synthetic_lengths(5000, 1), synthetic_lengths(5000, 2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    d = synthetic_lengths(5000, 3, min_len=100, max_len=20000)
    assert d.min() >= 100 and d.max() <= 20000
    assert np.median(a) < a.mean()  # right-skewed
    with pytest.raises(FlexmeshError):
        synthetic_lengths(10, 0, tail_fraction=2.0)


def test_batch_sampler_reproducible_and_bounded():
    src = load_lengths("prolong")
    first = [b.tolist() for b in islice(BatchSampler(src, seed=7, seqs_per_batch=16, max_len=4096), 3)]
    again = [b.tolist() for b in islice(BatchSampler(src, seed=7, seqs_per_batch=16, max_len=4096), 3)]
    other = [b.tolist() for b in islice(BatchSampler(src, seed=8, seqs_per_batch=16, max_len=4096), 3)]
    assert first == again and first != other
    assert all(len(b) == 16 and max(b) <= 4096 for b in first)
    for b in islice(BatchSampler(src, seed=1, tokens_per_batch=50_000), 5):
        assert b.sum() <= 50_000 or b.size == 1
        assert b.sum() + 400_000 > 50_000  # never empty-ish: filled up to the budget


def test_batch_sampler_rejects_ambiguous_sizes():
    with pytest.raises(FlexmeshError, match="exactly one"):
        BatchSampler([1, 2], seed=0)
    with pytest.raises(FlexmeshError, match="exactly one"):
        BatchSampler([1, 2], seed=0, seqs_per_batch=2, tokens_per_batch=5)


def test_stdlib_lengths_when_the_corpus_module_exists(tmp_path, monkeypatch):
    """"stdlib" is the standard library's lengths under the project's BPE (flexmesh.data.loader.stdlib_lengths),
    here on one of its packages standing in for the whole (a BPE trained on all of it: 25 s). The whole
    library as the corpus: tests/test_corpus.py::test_stdlib_corpus_is_this_pythons_library (its files) and
    tests/test_train_without_plan.py (a run trained on it)."""
    loader = pytest.importorskip("flexmesh.data.loader")
    from flexmesh.data.corpus import read_corpus, stdlib_corpus_dir

    corpus = read_corpus(stdlib_corpus_dir() / "json", extensions=(".py",))
    monkeypatch.setattr(loader, "stdlib_corpus", lambda: corpus)
    monkeypatch.setenv("FLEXMESH_CACHE", str(tmp_path))
    a = load_lengths("stdlib")
    assert a.dtype == np.int64 and a.size == len(corpus.files) > 1 and a.min() >= 1
    assert np.array_equal(a, loader.stdlib_lengths())  # the default vocabulary and cache: read back, not retrained
