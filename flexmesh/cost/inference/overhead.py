"""The per-iteration engine overhead: a named cost term, from a profile (never assumed zero).

An engine iteration costs more than its forward pass: the scheduler picks the batch, inputs are prepared,
tokens sampled, outputs processed. :class:`EngineOverhead` prices it as ``fixed + per_request x requests``
(the requests in the iteration's batch). The preset ``vllm`` is fitted (least squares, on loading) to
Vidur's published profile of vLLM on an A100 (``flexmesh/spec/presets/engine_overhead.toml`` has the
samples and their source); an engine profile of one's own, or ``--engine-overhead``, replaces it.

An engine that runs its forward eagerly (transformers' continuous batching) spends most of its host time
launching each layer's kernels: a preset measured on a model of ``layers`` layers scales with the priced
model's (the preset ``transformers``, from flexmesh's own engine on an H200: :func:`decode_cpu_samples` of the
iterations it logged).

>>> o = preset_overhead("vllm")
>>> round(o.fixed_s * 1e3, 3), round(o.per_request_s * 1e3, 4), round(o.seconds(64) * 1e3, 2)
(1.202, 0.1, 7.6)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources

import numpy as np
import tomllib

from flexmesh.errors import SpecError


@dataclass(frozen=True)
class EngineOverhead:
    """Seconds an iteration spends outside the forward pass: ``fixed_s + per_request_s x requests``, and
    ``multi_gpu_s`` more on a replica of more than one GPU (the RPC a multi-process engine adds). ``layers``:
    0, or the layers of the model the two terms were measured on (an eager engine's host time): they scale
    with the priced model's layers."""

    fixed_s: float
    per_request_s: float
    source: str
    multi_gpu_s: float = 0.0
    layers: int = 0

    def __post_init__(self) -> None:
        if not (self.fixed_s >= 0 and self.per_request_s >= 0 and self.multi_gpu_s >= 0):
            raise SpecError(f"an engine overhead is >= 0 s, got {self.fixed_s} s + {self.per_request_s} s per request"
                            f" + {self.multi_gpu_s} s on more than one GPU")
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 0:
            raise SpecError(f"an engine overhead's layers (those it was measured on) is a whole number >= 0, got "
                            f"{self.layers!r}")

    def seconds(self, requests: int, devices: int = 1, layers: int = 0) -> float:
        """Its seconds for an iteration of ``requests`` requests on ``devices`` GPUs, of a model of ``layers``
        layers (0: as measured)."""
        scale = layers / self.layers if self.layers and layers else 1.0
        return scale * (self.fixed_s + self.per_request_s * requests) + (self.multi_gpu_s if devices > 1 else 0.0)


def fit_overhead(requests: list[int], ms: list[float]) -> tuple[float, float]:
    """(fixed_s, per_request_s) of the least-squares line through (requests, ms) samples."""
    a = np.vstack([np.ones(len(requests)), np.asarray(requests, dtype=float)]).T
    (fixed, per), *_ = np.linalg.lstsq(a, np.asarray(ms, dtype=float), rcond=None)
    return max(0.0, float(fixed)) * 1e-3, max(0.0, float(per)) * 1e-3


@lru_cache(maxsize=None)
def _presets() -> dict[str, EngineOverhead]:
    raw = tomllib.loads(resources.files("flexmesh.spec").joinpath("presets/engine_overhead.toml").read_text())
    out = {}
    for name, entry in raw.items():
        fixed, per = fit_overhead(entry["requests"], entry["ms"])
        out[name] = EngineOverhead(fixed, per, f"preset {name}: fitted to {entry['source']}",
                                   layers=int(entry.get("layers", 0)))
    return out


# Request counts with fewer decode-only iterations than this in a profile are left out of its samples.
MIN_ITERATIONS = 10


def decode_cpu_samples(iterations: list[dict]) -> tuple[list[int], list[float]]:
    """An engine's logged iterations (``GET /iterations``: each with its ``batch`` of ``[cached, new]`` tokens per
    request and its loop's ``cpu_s``) as overhead samples: per request count, the median CPU milliseconds of its
    decode-only iterations (every request one new token), counts of at least :data:`MIN_ITERATIONS` only.

    >>> its = [{"batch": [[9, 1]] * (1 + i % 2), "cpu_s": 0.010 + 0.001 * (i % 2)} for i in range(40)]
    >>> decode_cpu_samples(its + [{"batch": [[0, 50]], "cpu_s": 0.02}])
    ([1, 2], [10.0, 11.0])
    """
    by: dict[int, list[float]] = {}
    for it in iterations:
        batch = it["batch"]
        if batch and all(new == 1 for _, new in batch):
            by.setdefault(len(batch), []).append(float(it["cpu_s"]) * 1e3)
    counts = sorted(n for n, v in by.items() if len(v) >= MIN_ITERATIONS)
    return counts, [round(float(np.median(by[n])), 3) for n in counts]


def preset_overhead(name: str = "vllm") -> EngineOverhead:
    """A preset's overhead (``flexmesh/spec/presets/engine_overhead.toml``)."""
    if name not in _presets():
        raise SpecError(f"unknown engine overhead {name!r}; presets: {', '.join(_presets())}")
    return _presets()[name]


def preset_name(o: EngineOverhead) -> str | None:
    """The preset ``o`` is (its per-iteration terms), or None."""
    return next((name for name, p in _presets().items() if replace(p, multi_gpu_s=o.multi_gpu_s) == o), None)


def parse_overhead(text: str) -> EngineOverhead:
    """``FIXED_MS`` or ``FIXED_MS,PER_REQUEST_MS`` (milliseconds) given by hand, or a preset name.

    >>> parse_overhead("2,0.05").seconds(10)
    0.0025
    """
    if text in _presets():
        return _presets()[text]
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or len(values) != len(parts) or not all(v >= 0 for v in values):
        raise SpecError(f"engine overhead {text!r} is not FIXED_MS[,PER_REQUEST_MS] (e.g. 1.2,0.1) nor a preset "
                        f"({', '.join(_presets())})")
    fixed, per = (values + [0.0])[:2]
    return EngineOverhead(fixed * 1e-3, per * 1e-3, f"given: {fixed:g} ms + {per:g} ms per request")
