"""Corpus reading, the tokenised store, stdlib lengths and the document loader (incl. exact resume)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from flexmesh.data import loader as loadermod
from flexmesh.data.corpus import read_corpus, stdlib_corpus, stdlib_corpus_dir
from flexmesh.data.loader import DocumentLoader, TokenizedCorpus, load_corpus_tokens, stdlib_lengths, tokenize_corpus
from flexmesh.data.tokenizer import train_bpe
from flexmesh.errors import DataError


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


# --- corpus -------------------------------------------------------------------------------------

def test_folder_is_read_recursively_with_configurable_extensions(tmp_path) -> None:
    _write(tmp_path, {"b.txt": "bee", "sub/a.md": "ay", "sub/deep/c.py": "see", "skip.bin": "x", "e.rst": "  \n"})
    c = read_corpus(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in c.files] == ["b.txt", "e.rst", "sub/a.md", "sub/deep/c.py"]
    assert c.texts() == ["bee", "ay", "see"]  # whitespace-only e.rst is no document
    assert read_corpus(tmp_path, extensions=("bin",)).texts() == ["x"]


def test_jsonl_with_configurable_field(tmp_path) -> None:
    p = tmp_path / "docs.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in [{"text": "one"}, {"text": "two", "body": "zwei"}]) + "\n\n")
    assert read_corpus(p).texts() == ["one", "two"]
    q = tmp_path / "body.jsonl"
    q.write_text(json.dumps({"body": "eins"}) + "\n")
    assert read_corpus(q, text_field="body").texts() == ["eins"]


@pytest.mark.parametrize("lines, msg", [
    (['{"text": "ok"}', '{"title": "no text"}'], "line 2 has no 'text' field"),
    (['{"text": "ok"}', "", "{broken"], "line 3 is not valid JSON"),
    (['{"text": 5}'], "line 1: field 'text' is a int"),
])
def test_jsonl_errors_name_the_line(tmp_path, lines, msg) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=msg):
        read_corpus(p).texts()


def test_corpus_errors(tmp_path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        read_corpus(tmp_path / "nowhere")
    with pytest.raises(DataError, match="no documents"):
        read_corpus(tmp_path)
    _write(tmp_path, {"empty.txt": ""})
    with pytest.raises(DataError, match="no documents"):
        read_corpus(tmp_path).texts()
    with pytest.raises(DataError, match="not .jsonl"):
        read_corpus(tmp_path / "empty.txt")


def test_fingerprint_follows_content_and_file_list(tmp_path) -> None:
    _write(tmp_path, {"a.txt": "alpha"})
    before = read_corpus(tmp_path).fingerprint()
    assert read_corpus(tmp_path).fingerprint() == before
    (tmp_path / "a.txt").write_text("alpha, longer")
    changed = read_corpus(tmp_path).fingerprint()
    assert changed != before
    _write(tmp_path, {"b.txt": "beta"})
    assert read_corpus(tmp_path).fingerprint() != changed


def test_stdlib_corpus_is_this_pythons_library() -> None:
    d = stdlib_corpus_dir()
    assert (d / "os.py").is_file()
    c = stdlib_corpus()
    assert d / "os.py" in c.files and len(c.files) > 500
    assert not any("site-packages" in f.parts for f in c.files)


# --- tokenised store ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Two real stdlib packages, a BPE trained on them, and a cache folder."""
    root = tmp_path_factory.mktemp("lib")
    for pkg in ("json", "email/mime"):
        shutil.copytree(stdlib_corpus_dir() / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path_factory.mktemp("cache")
    corpus = read_corpus(root)
    return corpus, train_bpe(corpus, vocab_size=384, cache_dir=cache), cache


def test_store_matches_direct_encoding_and_is_cached(small, monkeypatch) -> None:
    corpus, tok, cache = small
    store = tokenize_corpus(corpus, tok, cache_dir=cache)
    texts = corpus.texts()
    assert len(store) == len(texts)
    for i in (0, len(texts) // 2, len(texts) - 1):
        assert store[i].tolist() == tok.encode(texts[i], add_special_tokens=False).ids
    assert store.lengths.sum() == len(store.tokens)

    monkeypatch.setattr(loadermod, "_encode_to", lambda *a: pytest.fail("re-encoded a cached corpus"))
    again = tokenize_corpus(corpus, tok, cache_dir=cache)
    assert np.array_equal(again.offsets, store.offsets)


def test_corrupt_store_is_reported(small, tmp_path) -> None:
    corpus, tok, _ = small
    tokenize_corpus(corpus, tok, cache_dir=tmp_path)
    (offsets,) = (tmp_path / "tokens").glob("*/offsets.npy")
    offsets.write_bytes(b"garbage")
    with pytest.raises(DataError, match="delete that folder"):
        tokenize_corpus(corpus, tok, cache_dir=tmp_path)


def test_a_store_with_ids_the_tokenizer_cannot_make_is_refused(small, tmp_path) -> None:
    corpus, tok, _ = small
    tokenize_corpus(corpus, tok, cache_dir=tmp_path)
    (tokens,) = (tmp_path / "tokens").glob("*/tokens.npy")
    ids = np.load(tokens)
    ids[len(ids) // 2] = tok.get_vocab_size() + 7  # what a flipped bit can make of an id
    np.save(tokens, ids)
    with pytest.raises(DataError, match="holds ids outside the tokenizer's 384 tokens"):
        tokenize_corpus(corpus, tok, cache_dir=tmp_path)


def test_load_corpus_tokens_trains_or_loads(small, tmp_path) -> None:
    corpus, tok, cache = small
    tok.save(str(tmp_path / "tokenizer.json"))
    a, _ = load_corpus_tokens(corpus.root, tokenizer=tmp_path / "tokenizer.json", cache_dir=cache)
    b, tok_b = load_corpus_tokens(corpus.root, vocab_size=384, cache_dir=cache)
    assert tok_b.to_str() == tok.to_str()
    assert np.array_equal(a.tokens, b.tokens)


def test_stdlib_lengths_wiring(small, monkeypatch) -> None:
    """stdlib_lengths on a stand-in stdlib: one length per document, its token count and the end-of-text
    token training puts after it."""
    corpus, _, cache = small
    monkeypatch.setattr(loadermod, "stdlib_corpus", lambda: corpus)
    lengths = stdlib_lengths(vocab_size=384, cache_dir=cache)
    tok = train_bpe(corpus, vocab_size=384, cache_dir=cache)
    assert lengths.dtype == np.int64
    assert lengths.tolist() == [len(tok.encode(t, add_special_tokens=False).ids) + 1 for t in corpus.texts()]


def test_every_document_ends_with_the_tokenizers_end_of_text(small, tmp_path) -> None:
    """As torchtitan and Megatron-LM feed documents: each one's ids, then the eos. The flexmesh BPE's is
    <|endoftext|>; a tokenizer file's is the eos its tokenizer_config.json declares; without one, none."""
    corpus, tok, cache = small
    eos = tok.token_to_id("<|endoftext|>")
    store, _ = load_corpus_tokens(corpus.root, vocab_size=384, cache_dir=cache)
    texts = corpus.texts()
    assert store.end_of_text == eos and len(store) == len(texts)
    for i, text in enumerate(texts):
        assert store[i].tolist() == [*tok.encode(text, add_special_tokens=False).ids, eos]
    bare = tokenize_corpus(corpus, tok, cache_dir=cache)  # no end-of-text: documents as they are
    assert bare.end_of_text is None and np.array_equal(bare.lengths + 1, store.lengths)
    assert load_corpus_tokens(corpus.root, vocab_size=384, cache_dir=cache, end_of_text=False)[0].end_of_text is None

    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "Ġ("}))  # a declared eos wins
    declared, _ = load_corpus_tokens(corpus.root, tokenizer=folder, cache_dir=cache)
    assert declared.end_of_text == tok.token_to_id("Ġ(") != eos
    assert [int(declared[i][-1]) for i in range(len(declared))] == [declared.end_of_text] * len(declared)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))  # declared as none
    assert load_corpus_tokens(corpus.root, tokenizer=folder, cache_dir=cache)[0].end_of_text is None


def test_a_store_cached_without_end_of_text_is_not_read_as_one_with_it(small, tmp_path, monkeypatch) -> None:
    """The cache key names the end-of-text id: a store made before (or without) it is never reused silently."""
    corpus, tok, _ = small
    bare = tokenize_corpus(corpus, tok, cache_dir=tmp_path)
    encoded = []
    real = loadermod._encode_to
    monkeypatch.setattr(loadermod, "_encode_to", lambda *a: (encoded.append(a[-1]), real(*a)))
    with_eos = tokenize_corpus(corpus, tok, cache_dir=tmp_path, end_of_text=0)
    assert encoded == [0] and len(with_eos.tokens) == len(bare.tokens) + len(bare)
    assert len(list((tmp_path / "tokens").glob("*/offsets.npy"))) == 2
    with pytest.raises(DataError, match="end-of-text id 384 is outside the tokenizer's 384 tokens"):
        tokenize_corpus(corpus, tok, cache_dir=tmp_path, end_of_text=384)


# --- loader -------------------------------------------------------------------------------------

def _docs(lengths: list[int]) -> list[np.ndarray]:
    # The first token names the document, so batches can be traced back.
    return [np.concatenate([[i], np.full(n - 1, 7)]).astype(np.int64) if n else np.zeros(0, np.int64)
            for i, n in enumerate(lengths)]


def test_batches_truncate_skip_tiny_and_cover_each_epoch_once() -> None:
    lengths = [5, 1, 0, 30, 2, 9, 12, 3, 40, 6, 7]  # docs 1 and 2 are too short: 9 usable
    store = TokenizedCorpus.from_documents(_docs(lengths))
    ld = DocumentLoader(store, global_batch=4, max_len=8, seed=3)
    assert ld.batches_per_epoch == 2
    for _epoch in range(3):
        seen = []
        for _ in range(2):
            batch = next(ld)
            assert len(batch) == 4
            for d in batch:
                assert d.dtype == np.int64 and 2 <= len(d) <= 8 and len(d) == min(lengths[d[0]], 8)
                seen.append(int(d[0]))
        assert len(set(seen)) == 8 and not {1, 2} & set(seen)  # 9 usable, one left out per epoch
    assert ld.step == 6


def test_order_depends_on_seed_and_is_reproducible() -> None:
    docs = _docs([4] * 50)

    def take(seed: int) -> list[int]:
        ld = DocumentLoader(docs, 5, 16, seed)
        return [int(d[0]) for _ in range(5) for d in next(ld)]

    assert take(1) == take(1)
    assert take(1) != take(2)


def test_resume_replays_the_same_batches() -> None:
    docs = _docs(list(range(2, 25)))
    straight = DocumentLoader(docs, global_batch=3, max_len=10, seed=11)
    expected = [[d.tolist() for d in next(straight)] for _ in range(17)]  # crosses epoch boundaries

    first = DocumentLoader(docs, global_batch=3, max_len=10, seed=11)
    got = [[d.tolist() for d in next(first)] for _ in range(8)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a round trip through a checkpoint
    resumed = DocumentLoader(docs, global_batch=3, max_len=10, seed=11)
    resumed.load_state_dict(state)
    got += [[d.tolist() for d in next(resumed)] for _ in range(9)]
    assert got == expected


def test_tokens_per_step_fills_each_batch_and_resumes_exactly() -> None:
    lengths = [int(x) for x in np.random.default_rng(5).integers(2, 60, size=80)]
    docs = _docs(lengths)
    budget, cap = 100, 40
    straight = DocumentLoader(docs, max_len=cap, seed=3, tokens_per_step=budget)
    batches = [next(straight) for _ in range(30)]  # several epochs
    for b in batches:  # within the budget, and full: the next document of the order did not fit
        assert sum(map(len, b)) <= budget and all(len(d) <= cap for d in b)
    firsts = [int(d[0]) for b in batches[:straight.batches_per_epoch] for d in b]
    assert len(firsts) == len(set(firsts))  # no document twice in an epoch
    assert max(map(len, batches)) > min(map(len, batches))  # documents per step vary, tokens do not
    first = DocumentLoader(docs, max_len=cap, seed=3, tokens_per_step=budget)
    got = [next(first) for _ in range(13)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = DocumentLoader(docs, max_len=cap, seed=3, tokens_per_step=budget)
    resumed.load_state_dict(state)
    got += [next(resumed) for _ in range(17)]
    assert [[d.tolist() for d in b] for b in got] == [[d.tolist() for d in b] for b in batches]
    assert resumed.step == 30
    with pytest.raises(DataError, match="global_batch=None but this run has global_batch=4"):
        DocumentLoader(docs, 4, cap, seed=3).load_state_dict(state)
    with pytest.raises(DataError, match="one of them"):
        DocumentLoader(docs, 4, cap, tokens_per_step=budget)


def test_a_state_from_before_tokens_per_step_resumes() -> None:
    docs = _docs(list(range(2, 25)))
    ld = DocumentLoader(docs, global_batch=3, max_len=10, seed=11)
    for _ in range(9):
        next(ld)
    old = {k: v for k, v in ld.state_dict().items() if k not in ("tokens_per_step", "steps")}
    again = DocumentLoader(docs, global_batch=3, max_len=10, seed=11)
    again.load_state_dict(old)
    assert again.step == 9 and [d.tolist() for d in next(again)] == [d.tolist() for d in next(ld)]


def test_resume_refuses_other_settings() -> None:
    docs = _docs([5] * 10)
    state = DocumentLoader(docs, 2, 8, seed=0).state_dict()
    with pytest.raises(DataError, match="seed=0 but this run has seed=1"):
        DocumentLoader(docs, 2, 8, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="num_eligible"):
        DocumentLoader(docs[:8], 2, 8, seed=0).load_state_dict(state)


@pytest.mark.parametrize("lengths, batch, msg", [
    ([1, 0, 1], 1, "no documents of at least 2"),
    ([3, 4], 3, "lower the global batch"),
    ([3, 4], 0, "at least 1 document"),
])
def test_loader_errors(lengths, batch, msg) -> None:
    with pytest.raises(DataError, match=msg):
        DocumentLoader(_docs(lengths), batch, 8)


def test_cache_location_default(monkeypatch, tmp_path) -> None:
    from flexmesh.data.cache import cache_root

    monkeypatch.delenv("FLEXMESH_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == Path(os.path.expanduser("~")) / ".cache" / "flexmesh"
    assert cache_root(tmp_path / "x") == tmp_path / "x"


def test_an_edit_in_place_that_keeps_size_and_time_changes_the_fingerprint(tmp_path) -> None:
    import os

    doc = tmp_path / "a.txt"
    doc.write_text("hello world")
    before = read_corpus(tmp_path).fingerprint()
    st = doc.stat()
    doc.write_text("HELLO WORLD")  # same size
    os.utime(doc, ns=(st.st_atime_ns, st.st_mtime_ns))  # same modification time
    assert doc.stat().st_size == st.st_size and doc.stat().st_mtime_ns == st.st_mtime_ns
    assert read_corpus(tmp_path).fingerprint() != before
