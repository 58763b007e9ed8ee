"""How far a part's serving prices may sit from what its kernels take: the band ``serve simulate`` and ``serve plan``
report their figures over.

A part priced from its own measured tables (:func:`flexmesh.cost.device.hardware.unmeasured` is None) is held to
:data:`KERNEL_BOUND`: the largest held-out error ``bench/kernel_tables.py`` lets the device layer's fits have on the
rows of their own tables they were not fitted to (GEMMs 10%, attention and decode attention 12%). A part priced from
another's tables has no such check. Its band spans the prices that each measured table of its architecture gives it
(every measured table where its architecture has none), each scaled to its datasheet as the device layer scales a
borrowed table, and widens that spread by the same bound. The prices are taken at a decode step of
:data:`DECODE_PROBE` requests and a prompt chunk of :data:`PREFILL_PROBE` tokens of the served model. Scaled within
an architecture, a table has held: ``bench/vidur_layers.py`` prices an A40 from the A100's tables within 7% of
Vidur's A40 profile. Across architectures nothing has checked it, so the band of an RTX 2080 Ti (Turing; the tables
timed Ampere, Hopper, Blackwell and Ada parts) is as wide as their kernels disagree on it. A part with a GEMM table of
its own (``gemm_table``: DeepBench's V100 and T4) spans the attention tables only. A power-capped part
(``sustained_tflops``: the T4) also reaches down to its tables' prices without the cap: DeepBench timed the T4's
GEMMs in short runs, up to 46 TFLOP/s, where sustained load holds it to about 24.

>>> from flexmesh.spec import parse_model
>>> from flexmesh.spec.devices import device
>>> b = kernel_band(parse_model("llama3-8b"), device("H100"))
>>> b.low, b.high, b.own
(0.88, 1.12, True)
>>> t4 = kernel_band(parse_model("llama3-8b"), device("T4"))
>>> t4.low < b.low, t4.short
(True, 'no turing attention tables, power cap')
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

from flexmesh.cost.device.hardware import Hardware, unmeasured
from flexmesh.cost.inference.memory import served_dtype
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.devices import ATTENTION_KERNELS, DECODE_KERNELS, GEMM_KERNELS, GEMM_TABLES, DeviceSpec
from flexmesh.spec.model import ModelSpec

# bench/kernel_tables.py's held-out bounds: GEMMs 10%, prefill and decode attention 12%; the larger
KERNEL_BOUND = 0.12
# The iterations a borrowed part's prices are compared at: a decode step of this many requests of this many tokens
# of context each, and a prompt chunk of this many tokens
DECODE_PROBE, DECODE_CONTEXT, PREFILL_PROBE = 32, 1024, 2048
# The two ends of a band: every part at its fast end, every part at its slow end
ENDS = ("low", "high")
# Every kernel table the device layer has all three fits of (GEMM, prefill and decode attention)
MEASURED_TABLES = tuple(t for t in GEMM_KERNELS if t in ATTENTION_KERNELS and t in DECODE_KERNELS)


@dataclass(frozen=True)
class Band:
    """Factors on a part's device-layer prices at the fast (``low``) and slow (``high``) ends, and why."""

    low: float
    high: float
    own: bool  # priced from its own tables
    why: str
    short: str = ""  # the why in a few words

    def label(self) -> str:
        return f"x{self.low:.2f}-{self.high:.2f}" + (f" ({self.short})" if self.short else "")

    def to_dict(self) -> dict:
        return {"low": self.low, "high": self.high, "why": self.why}


def _probes(model: ModelSpec, d: DeviceSpec) -> tuple[float, float]:
    from flexmesh.cost.inference.analytic import AnalyticIteration  # (analytic imports the device layer too)

    it = AnalyticIteration(model, Hardware(ClusterSpec(1, 1, d), served_dtype(model.dtype, d)))
    decode = it.dense_s(DECODE_PROBE, True) + it.attention_s(DECODE_PROBE, DECODE_PROBE * DECODE_CONTEXT, ())
    prefill = it.dense_s(PREFILL_PROBE) + it.attention_s(0, 0, [(0, PREFILL_PROBE)])
    return decode, prefill


def with_kernel_table(d: DeviceSpec, table: str) -> DeviceSpec:
    """``d`` priced from ``table``'s kernel fits, scaled to its own datasheet (as the catalogue prices a part that
    borrows a table); a part with a GEMM table of its own (``gemm_table``) keeps it."""
    return replace(d, kernel_table=table, kernel_mm_efficiency=GEMM_KERNELS[d.gemm_table or table]["efficiency"],
                   kernel_attn_efficiency=ATTENTION_KERNELS[table]["efficiency"])


@cache
def kernel_band(model: ModelSpec, d: DeviceSpec) -> Band:
    """``d``'s band on ``model``'s iterations (see the module doc)."""
    lo, hi = 1.0 - KERNEL_BOUND, 1.0 + KERNEL_BOUND
    others: list[DeviceSpec] = []  # the other prices the measurements give the part
    whys, shorts = [], []
    if unmeasured(d) is not None:
        kin = [t for t in MEASURED_TABLES if GEMM_TABLES[t].architecture == d.architecture]
        tables = kin or list(MEASURED_TABLES)
        others += [with_kernel_table(d, t) for t in tables]
        names = ", ".join(sorted({GEMM_TABLES[t].architecture for t in tables}))
        what = "attention " if d.gemm_table else ""
        whys.append(f"the spread of its architecture's {what}tables ({', '.join(tables)}) scaled to its datasheet"
                    if kin else f"no {d.architecture} {what}tables: the spread of every measured architecture's "
                    f"({names}), scaled to its datasheet")
        shorts.append(f"{d.architecture} {what}tables" if kin else f"no {d.architecture} {what}tables")
    if d.sustained_tflops:  # its table's short runs, at a clock the power cap holds it below under sustained load
        others.append(replace(d, sustained_tflops={}))
        whys.append(f"its kernel table's short runs, faster than the sustained rate of its power cap "
                    f"({d.sustained_source})")
        shorts.append("power cap")
    if not others:
        return Band(lo, hi, True, f"its own kernel tables, held to {KERNEL_BOUND:.0%} on held-out rows "
                                  "(bench/kernel_tables.py)", "own tables")
    base = _probes(model, d)
    ratios = [p / b for o in others for p, b in zip(_probes(model, o), base)]
    return Band(min(1.0, min(ratios)) * lo, max(1.0, max(ratios)) * hi, unmeasured(d) is None,
                f"{'; '.join(whys)}, each within {KERNEL_BOUND:.0%}", ", ".join(shorts))


def part_bands(model: ModelSpec, devices) -> dict[str, Band]:  # noqa: ANN001 - DeviceSpecs
    """The band of each distinct part among ``devices`` on ``model``'s iterations, by name."""
    return {d.name: kernel_band(model, d) for d in devices}


def bands_label(bands: dict[str, Band]) -> str:
    """The parts' bands in one line, as the commands print them."""
    return ", ".join(f"{n} {b.label()}" for n, b in bands.items())
