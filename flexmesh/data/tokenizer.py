"""Tokenizers: load a local ``tokenizer.json``, or train a small byte-level BPE on a corpus once.

Both go through the Hugging Face ``tokenizers`` library; nothing here touches the network. A
trained tokenizer is cached as ``<cache>/tokenizers/bpe-<key>.json`` where the key hashes the
corpus fingerprint (file names and contents) and the training settings, so a second run with the
same corpus reuses it and an edited corpus retrains.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flexmesh.data.cache import cache_key, cache_root, file_lock
from flexmesh.data.corpus import Corpus, read_corpus
from flexmesh.errors import DataError
from flexmesh.files import write_atomic

END_OF_TEXT = "<|endoftext|>"
# Training cost grows with the text seen; beyond a few MB the merges barely change (measured on the
# standard library: BPE-8K trained on 1/4 of its 31 MB gives 1.5% more tokens than on all of it,
# in a sixth of the time), so training reads at most this much, spread over the whole corpus.
DEFAULT_MAX_TRAIN_BYTES = 8_000_000
_FORMAT = "bytelevel-bpe-v1"  # bump when training settings change, so old caches are not reused


def tokenizer_hash(tok: Tokenizer) -> str:
    """Hash of a tokenizer's full definition (vocabulary, merges, normalisation)."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a local ``tokenizer.json`` (a file, or a folder that holds one)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataError(f"tokenizer file {p} does not exist; pass a local tokenizer.json or train one with train_bpe")
    try:
        return Tokenizer.from_file(str(p))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a bare Exception for malformed JSON; a Rust panic (a BaseException) for some
        reason = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{p} is not a valid tokenizer.json ({reason}); replace it or delete it to retrain") from None


def _training_texts(corpus: Corpus, max_bytes: int) -> list[str]:
    """Documents to train on: all of them when small, else an evenly spaced subset of ~max_bytes.

    Evenly spaced (not the first files) so every part of a sorted folder tree is represented.
    """
    if corpus.kind == "dir":
        sizes = [f.stat().st_size for f in corpus.files]
        total = sum(sizes)
        step = max(1, -(-total // max_bytes))
        picked = Corpus(root=corpus.root, files=corpus.files[::step], kind="dir")
        texts = list(picked.documents())
    else:
        texts, seen = [], 0
        for t in corpus.documents():
            if seen >= max_bytes:
                break
            texts.append(t)
            seen += len(t)
    if not texts:
        raise DataError(f"corpus {corpus.root} has no documents to train a tokenizer on; point it at text data")
    return texts


def train_bpe(
    corpus: Corpus | str | Path,
    vocab_size: int,
    cache_dir: str | Path | None = None,
    max_train_bytes: int = DEFAULT_MAX_TRAIN_BYTES,
) -> Tokenizer:
    """Train (or fetch from the cache) a byte-level BPE of ``vocab_size`` tokens on ``corpus``.

    Byte-level: every byte is in the base alphabet, so any text encodes without unknown tokens and
    decodes back exactly. ``vocab_size`` counts the 256 byte tokens and ``<|endoftext|>``.
    """
    if not isinstance(corpus, Corpus):
        corpus = read_corpus(corpus)
    if vocab_size < 257:
        raise DataError(f"vocab_size {vocab_size} is below the 256 byte tokens + 1 special; use at least 257")
    key = cache_key(_FORMAT, corpus.fingerprint(), vocab_size, max_train_bytes)
    path = cache_root(cache_dir) / "tokenizers" / f"bpe-{key}.json"
    with file_lock(path.with_suffix(".lock")):
        if path.is_file():
            return load_tokenizer(path)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        texts = _training_texts(corpus, max_train_bytes)
        tok.train_from_iterator(texts, trainer, length=len(texts))
        # Atomic: a reader never sees a half-written file. pretty=True is what Tokenizer.save writes.
        write_atomic(path, tok.to_str(pretty=True), root=path.parent.parent)
    return tok
