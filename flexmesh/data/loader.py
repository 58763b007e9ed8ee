"""Tokenised document store and the loader that deals global batches of whole documents.

The store keeps a corpus's token ids as two ``.npy`` files (one flat array, one array of document
offsets) under ``<cache>/tokens/<key>/`` where the key hashes the corpus fingerprint, the tokenizer
and the end-of-text id put after each document (as torchtitan and Megatron-LM feed documents: each
one's ids, then the tokenizer's eos, so a model learns where a text ends), so tokenisation runs once
per (corpus, tokenizer, end of text) and later runs memory-map the result.
:func:`stdlib_lengths` reads the standard library's token lengths out of such a store.

The loader walks a seeded permutation of the documents per epoch and cuts it into global batches;
its position is two integers, so resuming from a checkpoint replays exactly the same batches.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from flexmesh.data.cache import cache_key, cache_root, file_lock
from flexmesh.data.corpus import Corpus, read_corpus, stdlib_corpus
from flexmesh.data.hf_tokenizer import end_of_text_id
from flexmesh.data.tokenizer import load_tokenizer, tokenizer_hash, train_bpe
from flexmesh.errors import DataError
from flexmesh.files import below, create_file, fresh_folder, make_folder

_ENCODE_CHUNK = 256  # documents per encode call: bounds memory while keeping the library's threads busy


@dataclass(frozen=True)
class TokenizedCorpus:
    """Documents as token ids: document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``."""

    tokens: np.ndarray  # int32 [total tokens], usually a read-only memory map
    offsets: np.ndarray  # int64 [num documents + 1]
    end_of_text: int | None = None  # the id that ends every document (its last token); None: none does

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per document (int64)."""
        return np.diff(self.offsets)

    @classmethod
    def from_documents(cls, docs: list[np.ndarray]) -> TokenizedCorpus:
        """Build an in-memory store from token arrays (tests, or tokens made elsewhere)."""
        offsets = np.zeros(len(docs) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(d) for d in docs])
        flat = np.concatenate(docs).astype(np.int32) if docs else np.zeros(0, dtype=np.int32)
        return cls(tokens=flat, offsets=offsets)


def tokenize_corpus(corpus: Corpus, tokenizer: Tokenizer, cache_dir: str | Path | None = None,
                    end_of_text: int | None = None) -> TokenizedCorpus:
    """Token ids of every document of ``corpus``, each followed by ``end_of_text`` (an id of ``tokenizer``;
    None: nothing), from the cache or encoded now and cached. The cache key names ``end_of_text``, so a
    store made without it (or before flexmesh put one) is never read as one with it."""
    if end_of_text is not None and not 0 <= end_of_text < tokenizer.get_vocab_size():
        raise DataError(f"end-of-text id {end_of_text} is outside the tokenizer's {tokenizer.get_vocab_size()} "
                        "tokens; give an id of this tokenizer")
    key = cache_key(corpus.fingerprint(), tokenizer_hash(tokenizer), f"end-of-text {end_of_text}")
    folder = cache_root(cache_dir) / "tokens" / key
    with file_lock(folder.with_suffix(".lock")):
        make_folder(folder, create=False)  # replaced when broken: a real folder, never a symlink
        if not (folder / "offsets.npy").is_file():
            _encode_to(folder, corpus, tokenizer, end_of_text)
    try:
        offsets = np.load(folder / "offsets.npy")
        tokens = np.load(folder / "tokens.npy", mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"token cache {folder} is corrupt ({e}); delete that folder to re-tokenise") from None
    if len(offsets) < 2 or offsets[-1] != len(tokens):
        raise DataError(f"token cache {folder} is inconsistent; delete that folder to re-tokenise")
    # ids the tokenizer cannot have made (a damaged store) would index past the embedding at step 1
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= tokenizer.get_vocab_size()):
        raise DataError(f"token cache {folder} holds ids outside the tokenizer's {tokenizer.get_vocab_size()} "
                        "tokens: it is damaged; delete that folder to re-tokenise")
    return TokenizedCorpus(tokens=tokens, offsets=offsets, end_of_text=end_of_text)


def _encode_to(folder: Path, corpus: Corpus, tokenizer: Tokenizer, end_of_text: int | None) -> None:
    texts = corpus.texts()  # raises DataError for a corpus with no documents
    lengths, chunks = [], []
    for i in range(0, len(texts), _ENCODE_CHUNK):
        # encode_batch_fast skips character offsets, which this store never uses.
        for enc in tokenizer.encode_batch_fast(texts[i:i + _ENCODE_CHUNK], add_special_tokens=False):
            ids = np.asarray(enc.ids if end_of_text is None else [*enc.ids, end_of_text], dtype=np.int32)
            lengths.append(len(ids))
            chunks.append(ids)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    tmp = fresh_folder(folder.with_name(f"{folder.name}.tmp{os.getpid()}"), folder.parent)
    for name, array in (("tokens.npy", np.concatenate(chunks)), ("offsets.npy", offsets)):
        with create_file(tmp / name, tmp) as f:  # np.save to a path would follow a link planted there
            np.save(f, array)
    below(folder.parent, folder)  # a symlink there is refused, never removed nor replaced
    shutil.rmtree(folder, ignore_errors=True)  # a broken earlier attempt, if any
    os.replace(tmp, folder)  # atomic: readers see the whole store or none


def load_corpus_tokens(
    corpus: str | Path | Corpus,
    tokenizer: str | Path | Tokenizer | None = None,
    vocab_size: int = 8192,
    cache_dir: str | Path | None = None,
    end_of_text: bool = True,
) -> tuple[TokenizedCorpus, Tokenizer]:
    """Corpus path in, tokenised store out: loads ``tokenizer`` or trains a BPE of ``vocab_size``; with
    ``end_of_text`` each document is followed by the tokenizer's eos (flexmesh.data.hf_tokenizer.
    end_of_text_id: the BPE's ``<|endoftext|>``, or the eos a ``tokenizer_config.json`` beside the file
    declares; none when it has none: the store's ``end_of_text`` says which).

    Safe to call from every rank at once: file locks make one rank build each cache entry while
    the others wait and then read it.
    """
    if not isinstance(corpus, Corpus):
        corpus = read_corpus(corpus)
    if tokenizer is None:
        tok = train_bpe(corpus, vocab_size=vocab_size, cache_dir=cache_dir)
    elif isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    else:
        tok = load_tokenizer(tokenizer)
    source = tokenizer if isinstance(tokenizer, str | Path) else None
    eot = end_of_text_id(tok, source) if end_of_text else None
    return tokenize_corpus(corpus, tok, cache_dir=cache_dir, end_of_text=eot), tok


DEFAULT_STDLIB_VOCAB = 8192


def stdlib_lengths(vocab_size: int = DEFAULT_STDLIB_VOCAB, cache_dir: str | Path | None = None) -> np.ndarray:
    """Token lengths of the standard library's ``.py`` files under the project's BPE, cached on disk: each
    file's tokens and the ``<|endoftext|>`` after it, as ``flexmesh train --corpus stdlib`` feeds them (the
    same store).

    The first call trains the BPE and tokenises the corpus (:func:`stdlib_corpus`, :func:`train_bpe`);
    later calls read the cache. Returns an int64 array with one length per non-empty file, in path order.
    """
    corpus = stdlib_corpus()
    tok = train_bpe(corpus, vocab_size=vocab_size, cache_dir=cache_dir)
    return tokenize_corpus(corpus, tok, cache_dir=cache_dir, end_of_text=end_of_text_id(tok)).lengths.astype(np.int64)


class DocumentLoader:
    """Endless global batches of whole documents, each truncated to ``max_len`` tokens: ``global_batch``
    documents per batch, or, with ``tokens_per_step``, as many documents as fill that many tokens (as
    torchtitan and Megatron-LM count a batch; the document that would overflow the budget opens the next
    batch, and a document longer than the budget makes a batch alone).

    Documents shorter than ``min_len`` (default 2: one token has no next-token label) are skipped.
    Epoch ``e`` visits the documents in the order ``default_rng((seed, e)).permutation``; the documents
    left at an epoch's end that fill no whole batch are dropped, so no batch repeats a document.

    Example: 10 eligible documents, ``global_batch=4``: each epoch gives 2 batches; batch 3 is the
    first batch of epoch 1, whatever happened before a resume.

    >>> docs = [np.ones(n, dtype=np.int64) for n in (300, 50, 700, 60, 200, 20)]
    >>> [sum(map(len, b)) for b, _ in zip(DocumentLoader(docs, max_len=512, tokens_per_step=600), range(3))]
    [592, 310, 300]
    """

    def __init__(self, corpus_tokens: TokenizedCorpus | list[np.ndarray], global_batch: int | None = None,
                 max_len: int = 0, seed: int = 0, min_len: int = 2, tokens_per_step: int | None = None) -> None:
        if (global_batch is None) == (tokens_per_step is None):
            raise DataError("give the batch as documents (global_batch) or as tokens (tokens_per_step), one of them")
        if global_batch is not None and global_batch < 1:
            raise DataError(f"global_batch must be at least 1 document, got {global_batch}")
        if tokens_per_step is not None and tokens_per_step < min_len:
            raise DataError(f"tokens_per_step {tokens_per_step} holds no document of {min_len} tokens; raise it")
        if max_len < min_len:
            raise DataError(
                f"max_len {max_len} is below the shortest usable document ({min_len} tokens); raise max_len")
        self.docs = corpus_tokens
        self.global_batch = global_batch
        self.tokens_per_step = tokens_per_step
        self.max_len = max_len
        self.seed = seed
        lengths = (corpus_tokens.lengths if isinstance(corpus_tokens, TokenizedCorpus)
                   else np.array([len(d) for d in corpus_tokens], dtype=np.int64))
        self.eligible = np.flatnonzero(lengths >= min_len)
        self._lengths = np.minimum(lengths, max_len)
        if len(self.eligible) == 0:
            raise DataError(f"the corpus has no documents of at least {min_len} tokens; add text to the corpus")
        if global_batch is not None and len(self.eligible) < global_batch:
            raise DataError(
                f"the corpus has {len(self.eligible)} usable documents, fewer than the global batch of "
                f"{global_batch}; lower the global batch or add documents"
            )
        if tokens_per_step is not None and int(self._lengths[self.eligible].sum()) < tokens_per_step:
            raise DataError(f"the corpus holds {int(self._lengths[self.eligible].sum()):,} tokens of documents up to "
                            f"{max_len} tokens, fewer than one step of {tokens_per_step:,}; lower --tokens-per-step "
                            "or add documents")
        self.epoch = 0
        self.batch_in_epoch = 0
        self.steps = 0  # batches handed out so far (across epochs)
        self._order: np.ndarray | None = None
        self._bounds: list[int] | None = None

    @property
    def step(self) -> int:
        """Batches handed out so far (across epochs)."""
        return self.steps

    @property
    def batches_per_epoch(self) -> int:
        """Whole batches in the current epoch (with ``tokens_per_step`` it depends on the epoch's order)."""
        return len(self._epoch_bounds()) - 1

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            self._order = self.eligible[np.random.default_rng((self.seed, self.epoch)).permutation(len(self.eligible))]
        return self._order

    def _epoch_bounds(self) -> list[int]:
        """Where the current epoch's batches start in its order, and where the last one ends."""
        if self._bounds is None:
            order = self._epoch_order()
            if self.tokens_per_step is None:
                assert self.global_batch is not None
                n = len(order) // self.global_batch
                self._bounds = [i * self.global_batch for i in range(n + 1)]
            else:
                bounds, filled = [0], 0
                for i, length in enumerate(self._lengths[order].tolist()):
                    if filled and filled + length > self.tokens_per_step:
                        bounds.append(i)
                        filled = 0
                    filled += length
                if filled >= self.tokens_per_step:  # the epoch's last batch, when its documents fill it
                    bounds.append(len(order))
                self._bounds = bounds
        return self._bounds

    def __iter__(self) -> Iterator[list[np.ndarray]]:
        return self

    def __next__(self) -> list[np.ndarray]:
        bounds = self._epoch_bounds()
        while len(bounds) < 2:  # an epoch whose order fills no whole batch (a few long documents): the next one
            self.epoch, self.batch_in_epoch, self._order, self._bounds = self.epoch + 1, 0, None, None
            bounds = self._epoch_bounds()
        order = self._epoch_order()
        ids = order[bounds[self.batch_in_epoch]:bounds[self.batch_in_epoch + 1]]
        batch = [np.asarray(self.docs[int(i)][:self.max_len], dtype=np.int64) for i in ids]
        self.batch_in_epoch += 1
        self.steps += 1
        if self.batch_in_epoch == len(bounds) - 1:
            self.epoch, self.batch_in_epoch, self._order, self._bounds = self.epoch + 1, 0, None, None
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, batch) and the settings a resume must match; JSON-serialisable."""
        return {
            "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "steps": self.steps, "seed": self.seed,
            "global_batch": self.global_batch, "tokens_per_step": self.tokens_per_step, "max_len": self.max_len,
            "num_eligible": int(len(self.eligible)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off; refuses a state from a different corpus or settings."""
        mine = self.state_dict()
        state = {"tokens_per_step": None, **state}  # a run from before batches counted in tokens
        for k in ("seed", "global_batch", "tokens_per_step", "max_len", "num_eligible"):
            if k not in state:
                raise DataError(f"loader state lacks {k!r}; the checkpoint is not from this version of flexmesh")
            if state[k] != mine[k]:
                raise DataError(
                    f"loader state has {k}={state[k]} but this run has {k}={mine[k]}; resume with the same "
                    "corpus, seed, batch size (documents or tokens per step) and max length as the checkpointed run"
                )
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self._order = self._bounds = None
        if not 0 <= self.batch_in_epoch < self.batches_per_epoch:
            raise DataError(f"loader state batch {self.batch_in_epoch} is outside an epoch of {self.batches_per_epoch}")
        # batches before: recorded, or (documents per batch: every epoch alike) counted from the position
        before = self.epoch * self.batches_per_epoch + self.batch_in_epoch
        self.steps = int(state["steps"]) if "steps" in state else before
