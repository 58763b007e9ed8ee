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
import io
import math
import zlib
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterator

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.errors import DataError, FlexmeshError
from flexmesh.inputs import parse_json, read_bytes

SHIPPED = {"wikipedia": "wikipedia.txt.gz", "prolong": "dist_prolong.json", "wlbllm": "dist_wlbllm.json"}
NAMES = (*SHIPPED, "stdlib", "synthetic")


# The longest length a file may give: 2**31 - 1 tokens. The cost model and the schedulers square
# lengths and sum the squares in int64 (attention work); 2**31 squared is 2**62, so a batch of a few
# longer ones would overflow. No document of a training corpus comes near it.
MAX_LENGTH = 2**31 - 1


def _parse(text: str, where: str) -> np.ndarray:
    """Lengths from a text (one whole number per line or whitespace-separated) or a JSON list."""
    text = text.strip()
    if not text:
        raise DataError(f"{where}: the file is empty; give one length (a whole number of tokens) per line or a "
                        "JSON list")
    if text.startswith(("[", "{")):
        values = parse_json(text, DataError, where, invalid="not a valid JSON list of lengths")
        if not isinstance(values, list):
            raise DataError(f"{where}: expected a JSON list of lengths (e.g. [512, 2048]), got a JSON "
                            f"{type(values).__name__}")
        # a whole number written as a float (1e12, 512.0) is that number; the bounds below judge its size
        values = [int(v) if isinstance(v, float) and math.isfinite(v) and v.is_integer() else v for v in values]
    else:
        try:  # every word a whole number: read at once (a million lengths in a fraction of a second)
            ints = list(map(int, text.split()))
        except ValueError:  # else word by word below, to name the line of the first that is not
            pass
        else:
            return _checked(ints, where)
        values = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            for word in line.split():
                try:
                    values.append(int(word))
                except ValueError:
                    raise DataError(f"{where} line {lineno}: {word[:40]!r} is not a whole number of tokens; give one "
                                    "integer per line (or a JSON list)") from None
    bad = next((v for v in values if not isinstance(v, int) or isinstance(v, bool)), _NONE)
    if bad is not _NONE:
        i = values.index(bad)
        what = "a fraction" if isinstance(bad, float) else ("null" if bad is None else type(bad).__name__)
        raise DataError(f"{where}: entry {i + 1} is {bad!r} ({what}), not a whole number of tokens; lengths are "
                        "token counts (rounding them is left to you)")
    return _checked(values, where)


def _checked(values: list[int], where: str) -> np.ndarray:
    """``values`` (whole numbers) as lengths, refused where empty, below 1 token or above :data:`MAX_LENGTH`."""
    if not values:
        raise DataError(f"{where}: expected a non-empty list of lengths")
    low, high = min(values), max(values)
    if low < 1:
        raise DataError(f"{where}: lengths must be >= 1 token; found {low}")
    if high > MAX_LENGTH:
        raise DataError(f"{where}: length {high} is above {MAX_LENGTH:,} tokens (2**31 - 1), the most flexmesh "
                        "accepts: its squared lengths are summed in 64-bit integers; check the file")
    return np.asarray(values, dtype=np.int64)


_NONE = object()


# A length file's bytes, decompressed: 256 MiB is about 30 million lengths, far more than a sample needs.
MAX_FILE_BYTES = 256 << 20


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
    if not path.exists():
        raise FlexmeshError(
            f"unknown lengths {name_or_path!r}: use one of {', '.join(NAMES)} or a path to a .txt (one length per "
            f"line) or .json (list) file"
        )
    raw = read_bytes(path, DataError, limit=MAX_FILE_BYTES)
    if path.suffix == ".gz":
        try:  # read at most one byte past the bound: a small file may expand to gigabytes
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as unpacked:
                raw = unpacked.read(MAX_FILE_BYTES + 1)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: not a readable gzip file ({e}); re-compress it or give the plain .txt") from None
        if len(raw) > MAX_FILE_BYTES:
            raise DataError(f"{path}: expands beyond the {MAX_FILE_BYTES:,} bytes a length file may hold; give a "
                            "sample of its lengths")
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not a text file of lengths (byte {e.start} is not UTF-8); give one length per "
                        "line or a JSON list") from None
    return _parse(content, str(path))


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
