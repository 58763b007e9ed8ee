"""Sequence-length sources for scheduling and simulation: real distributions, synthetic ones, batches.

Shipped distributions (files under ``flexmesh/data/lengths/``, see its README for provenance):

- ``wikipedia``: 1,000,000 document lengths (FlexSP's evaluation data), gzipped;
- ``prolong``: 77,932 lengths sampled from the ProLong long-context mix;
- ``wlbllm``: 99,519 lengths shaped like a 128K-context production mix;
- ``stdlib``: the Python standard library's source files tokenized with the project tokenizer
  (computed on demand by :func:`flexmesh.data.loader.stdlib_lengths`);
- ``synthetic``: :func:`synthetic_lengths` with its defaults and seed 0.

>>> a = load_lengths("prolong")
>>> int(a.min()) >= 1 and a.dtype == np.int64
True
>>> b1 = [b.tolist() for _, b in zip(range(2), BatchSampler(a, seed=3, seqs_per_batch=4))]
>>> b2 = [b.tolist() for _, b in zip(range(2), BatchSampler(a, seed=3, seqs_per_batch=4))]
>>> b1 == b2
True
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterator

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.errors import FlexmeshError

SHIPPED = {"wikipedia": "wikipedia.txt.gz", "prolong": "dist_prolong.json", "wlbllm": "dist_wlbllm.json"}
NAMES = (*SHIPPED, "stdlib", "synthetic")


def _parse(text: str, where: str) -> np.ndarray:
    text = text.strip()
    try:
        values = json.loads(text) if text.startswith("[") else [int(x) for x in text.split()]
    except ValueError as e:
        raise FlexmeshError(f"{where}: cannot read lengths ({e}); give one integer per line or a JSON list") from None
    a = np.asarray(values, dtype=np.int64)
    if a.ndim != 1 or a.size == 0:
        raise FlexmeshError(f"{where}: expected a non-empty list of lengths")
    if (a < 1).any():
        raise FlexmeshError(f"{where}: lengths must be >= 1 token; found {int(a.min())}")
    return a


@lru_cache(maxsize=None)
def _shipped(name: str) -> np.ndarray:
    f = resources.files("flexmesh.data").joinpath("lengths").joinpath(SHIPPED[name])
    raw = f.read_bytes()
    if SHIPPED[name].endswith(".gz"):
        raw = gzip.decompress(raw)
    a = _parse(raw.decode(), f"shipped distribution {name!r}")
    a.setflags(write=False)  # cached and shared: callers get a read-only array
    return a


def load_lengths(name_or_path: str) -> np.ndarray:
    """Sequence lengths (tokens, int64) by shipped name or from a file (.txt one per line, .json list)."""
    if name_or_path in SHIPPED:
        return _shipped(name_or_path)
    if name_or_path == "synthetic":
        return synthetic_lengths(100_000, seed=0)
    if name_or_path == "stdlib":
        # Imported lazily: tokenizing the standard library needs the tokenizers library, which the
        # shipped distributions do not.
        from flexmesh.data.loader import stdlib_lengths

        return np.asarray(stdlib_lengths(), dtype=np.int64)
    path = Path(name_or_path)
    if not path.is_file():
        raise FlexmeshError(
            f"unknown lengths {name_or_path!r}: use one of {', '.join(NAMES)} or a path to a .txt (one length per "
            f"line) or .json (list) file"
        )
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return _parse(raw.decode(), str(path))


def synthetic_lengths(n: int, seed: int, *, median: float = 400.0, sigma: float = 1.3, tail_fraction: float = 0.03,
                      tail_alpha: float = 1.1, tail_start: float = 4096.0, min_len: int = 16,
                      max_len: int = 1 << 20) -> np.ndarray:
    """``n`` heavy-tailed lengths: a lognormal body plus a Pareto tail, clipped to [min_len, max_len].

    The defaults mimic real pre-training mixes: median ~400 tokens, ~3% of documents beyond 4K whose
    Pareto tail (alpha 1.1) holds a large share of all tokens. Same ``seed``, same lengths.
    """
    if n < 0 or not 0.0 <= tail_fraction <= 1.0 or min_len < 1 or max_len < min_len:
        raise FlexmeshError("synthetic_lengths needs n >= 0, 0 <= tail_fraction <= 1 and 1 <= min_len <= max_len")
    rng = np.random.default_rng(seed)
    body = rng.lognormal(np.log(median), sigma, size=n)
    tail = tail_start * (1.0 + rng.pareto(tail_alpha, size=n))
    a = np.where(rng.random(n) < tail_fraction, tail, body)
    return np.clip(np.rint(a), min_len, max_len).astype(np.int64)


class BatchSampler:
    """Global batches of lengths drawn from a distribution, reproducibly.

    Each batch holds ``seqs_per_batch`` sequences, or as many as keep the total within
    ``tokens_per_batch`` (at least one). Lengths above ``max_len`` are truncated to it, as training
    pipelines truncate documents to the context length. The stream is infinite: draw with ``zip`` or
    ``itertools.islice``; the same seed yields the same batches.
    """

    def __init__(self, lengths: ArrayLike, seed: int, seqs_per_batch: int | None = None,
                 tokens_per_batch: int | None = None, max_len: int | None = None) -> None:
        a = np.asarray(lengths, dtype=np.int64)
        if a.ndim != 1 or a.size == 0 or (a < 1).any():
            raise FlexmeshError("BatchSampler needs a non-empty 1-D array of lengths >= 1")
        if (seqs_per_batch is None) == (tokens_per_batch is None):
            raise FlexmeshError("BatchSampler: give exactly one of seqs_per_batch or tokens_per_batch")
        if min(x for x in (seqs_per_batch, tokens_per_batch) if x is not None) < 1:
            raise FlexmeshError("BatchSampler: the batch size must be >= 1")
        if max_len is not None and max_len < 1:
            raise FlexmeshError("BatchSampler: max_len must be >= 1 (the context length)")
        self.lengths = np.minimum(a, max_len) if max_len is not None else a
        self.seed = seed
        self.seqs_per_batch = seqs_per_batch
        self.tokens_per_batch = tokens_per_batch

    def __iter__(self) -> Iterator[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        a = self.lengths
        while True:
            if self.seqs_per_batch is not None:
                yield a[rng.integers(0, a.size, size=self.seqs_per_batch)].copy()
                continue
            # Draw in blocks and cut where the running total would pass the token budget.
            budget = self.tokens_per_batch
            assert budget is not None  # the constructor set exactly one of the two sizes
            out: list[np.ndarray] = []
            total = 0
            while True:
                block = a[rng.integers(0, a.size, size=256)]
                cum = total + np.cumsum(block)
                k = int(np.searchsorted(cum, budget, side="right"))
                if k < block.size:
                    out.append(block[: max(k, 1 if not out else k)])
                    break
                out.append(block)
                total = int(cum[-1])
            yield np.concatenate(out)
