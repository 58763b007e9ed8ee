"""What an engine's own kernels reach of the device layer's rates: named framework terms above the device layer.

The device layer (``Hardware.device_kernels``) prices each kernel as aiconfigurator-core's vLLM tables time it.
An engine that runs kernels of its own (an older vLLM, sarathi-serve, a hand-written norm that loads one scalar a
thread) reaches other rates on the same GPU. :class:`EngineRates` names four of them, each a factor on one rate of
the device layer's kernels (1: the kernel as the tables time it; below 1 slower, above 1 faster), and nothing
else: every fixed cost a call (launch, the tables' per-call and per-key costs) stays the device layer's.

- ``gemm``: the GEMMs' tensor-core rate (``Kernels.mm_flops``); their memory-bound side (a small batch reading its
  weights) keeps the device layer's bandwidth;
- ``pointwise``: the streaming kernels' bandwidth (``Kernels.hbm_bytes_per_s``: norms, rotary, activation, the
  residual add, the KV-cache write);
- ``prefill_attention``: the attention FLOP rate of a prefill chunk (``Kernels.attn_flops``);
- ``decode_attention``: the rate decode attention reads the KV cache at (``MeasuredDecode.hbm_bytes_per_s``; a
  device layer without a measured decode kernel reads it at the streaming rate, which ``pointwise`` scales).

:meth:`EngineRates.kernels` applies them to a device layer's :class:`~flexmesh.cost.device.kernels.Kernels`;
:meth:`EngineRates.on` gives a hardware whose device layer runs at them, so that whatever prices from a hardware
(``AnalyticIteration``, the serving simulator and planner) prices the engine with nothing else to pass (unit
rates: the hardware itself, the same floats). :func:`fit_rate` redoes one term from an engine's measurements: the
factor whose prices minimise the squared log error against the measured seconds (as the training fits do,
``flexmesh.cost.training.calibrate.fit_constants``); :func:`fit_engine_rates` fits each term named on its own rows.
``bench/vidur_layers.py`` fits them to Vidur's published sarathi-serve profiles and scores them on rows the fit
did not see.

>>> from flexmesh.cost.device.hardware import Hardware
>>> from flexmesh.spec import parse_cluster
>>> k = Hardware(parse_cluster("1xA100-80GB")).device_kernels
>>> true = EngineRates(gemm=0.8)
>>> shapes = np.array([256.0, 4096.0])
>>> measured = true.kernels(k).gemm(shapes, 4096, 4096)
>>> round(fit_rate(lambda f: EngineRates(gemm=f).kernels(k).gemm(shapes, 4096, 4096), measured), 4)
0.8
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from flexmesh.cost.device.kernels import Kernels
from flexmesh.errors import SpecError

TERMS = ("gemm", "pointwise", "prefill_attention", "decode_attention")
BOUNDS = (0.05, 5.0)  # a factor on a rate: 20x slower to 5x faster than the device layer's kernel


@dataclass(frozen=True)
class EngineRates:
    """Factors on the device layer's rates an engine's kernels reach (see the module doc); 1: the device layer's."""

    gemm: float = 1.0
    pointwise: float = 1.0
    prefill_attention: float = 1.0
    decode_attention: float = 1.0
    source: str = "the device layer's kernels"

    def __post_init__(self) -> None:
        for name in TERMS:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and np.isfinite(v)):
                raise SpecError(f"an engine's {name} rate is a factor > 0 on the device layer's, got {v!r}")

    def factors(self) -> dict[str, float]:
        """The four factors by name."""
        return {name: float(getattr(self, name)) for name in TERMS}

    @property
    def unit(self) -> bool:
        """Every factor 1: the device layer's kernels as they are."""
        return all(v == 1.0 for v in self.factors().values())

    def on(self, hardware):  # noqa: ANN001, ANN201 - a Hardware, or a profiled hardware with kernels of its own
        """``hardware`` as this engine's kernels run on it: a copy whose device layer (``device_kernels``, or the
        ``kernels`` of a profiled hardware without one) is at these rates; unit rates: ``hardware`` itself."""
        if self.unit:
            return hardware
        out = copy.copy(hardware)
        if getattr(hardware, "device_kernels", None) is not None:
            out.device_kernels = self.kernels(hardware.device_kernels)
        else:
            out.kernels = self.kernels(hardware.kernels)
        return out

    def kernels(self, k: Kernels) -> Kernels:
        """``k`` (a device layer's kernels) at this engine's rates."""
        if self.unit:
            return k
        d = k.decode_measured
        return replace(k, mm_flops=k.mm_flops * self.gemm, hbm_bytes_per_s=k.hbm_bytes_per_s * self.pointwise,
                       attn_flops=k.attn_flops * self.prefill_attention,
                       decode_measured=None if d is None else
                       replace(d, hbm_bytes_per_s=d.hbm_bytes_per_s * self.decode_attention))


def fit_rate(price: Callable[[float], np.ndarray], measured, bounds: tuple[float, float] = BOUNDS) -> float:  # noqa: ANN001
    """The factor ``f`` minimising ``sum(log(price(f) / measured)^2)`` over the rows ``price`` prices (the rows
    the fit sees, and no others), within ``bounds``."""
    from scipy.optimize import minimize_scalar  # only fits need it, not pricing (every `flexmesh` process imports this)

    y = np.asarray(measured, dtype=float)
    if y.size == 0 or np.any(~(y > 0)):
        raise ValueError("a rate is fitted to one or more measured times, each > 0")
    lo, hi = bounds
    res = minimize_scalar(lambda f: float(np.sum(np.log(np.asarray(price(f), dtype=float) / y) ** 2)),
                          bounds=(lo, hi), method="bounded", options={"xatol": 1e-6})
    return float(res.x)


def fit_engine_rates(rows: Mapping[str, tuple[Callable[[EngineRates], np.ndarray], np.ndarray]],
                     source: str, base: EngineRates | None = None) -> EngineRates:
    """Each term of ``rows`` (a name of :data:`TERMS` -> ``(price, measured)``: ``price(rates)`` prices that
    term's rows at ``rates``) fitted on its own rows, every other term at ``base``'s (default 1: the device
    layer's); terms not named keep ``base``'s."""
    unknown = set(rows) - set(TERMS)
    if unknown:
        raise ValueError(f"unknown engine rate(s) {', '.join(sorted(unknown))}; known: {', '.join(TERMS)}")
    start = base or EngineRates()

    def at(name: str, price: Callable[[EngineRates], np.ndarray]) -> Callable[[float], np.ndarray]:
        return lambda f: price(replace(start, **{name: f}))  # type: ignore[arg-type]  # name is one of TERMS

    fitted = {name: fit_rate(at(name, price), measured) for name, (price, measured) in rows.items()}
    return replace(start, source=source, **fitted)

