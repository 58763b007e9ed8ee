"""The engine a serving plan runs on: one description of what the simulator, the planner and ``serve export`` need.

:class:`EngineSpec` says how an engine schedules its iterations (prompts mixed with decodes or first, chunked or whole:
one of the replica schedulers of :mod:`flexmesh.serve.schedulers`, or a registered one by name), its default token
budget and batch cap, whether decode runs as CUDA graphs, the tensor-parallel all-reduce it runs, what its CPU costs per
iteration and whether that overlaps the GPU, what a replica of more than one GPU adds (the workers' RPC), and its
kernels' rates on the device layer's (:class:`~flexmesh.cost.inference.engine_rates.EngineRates`). Presets
(``flexmesh/spec/presets/engines.toml``) describe what users run, each value with its source; the default is current
vLLM. A file of the same fields (TOML or JSON, a ``base`` preset to start from) describes one's own (docs/engines.md).
Every serving plan carries its description (``engine`` in the plan file), so a plan is simulated and exported as it was
planned.

>>> e = engine_spec("vllm-v0")
>>> e.scheduler_name, e.chunked_prefill, e.prefill_first, e.multi_gpu_ms
('prefill-first-whole', False, True, 6.258)
>>> from flexmesh.spec.devices import device
>>> e.knobs(device("H100"), context=32768).max_batched_tokens, engine_spec("vllm").knobs(device("H100")).max_seqs
(32768, 1024)
>>> EngineSpec.from_dict(e.to_dict()) == e
True
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

from flexmesh.cost.inference.analytic import ALL_REDUCES, VLLM_GRAPHS
from flexmesh.cost.inference.engine_rates import TERMS, EngineRates
from flexmesh.cost.inference.overhead import EngineOverhead, parse_overhead, preset_name
from flexmesh.errors import SpecError
from flexmesh.serve.layout.knobs import EngineKnobs, default_knobs
from flexmesh.spec.devices import DeviceSpec

DEFAULT_ENGINE = "vllm"
# What "device" and "context" budgets stand for (engines.toml's header)
DEVICE, CONTEXT = "device", "context"
# vLLM V0's floor on the budget without chunked prefill: max(max_model_len, 2048) (vllm/config.py SchedulerConfig)
MIN_WHOLE_BUDGET = 2048
_FLAGS = ("prefill_first", "chunked_prefill", "admit_whole", "cuda_graphs", "cpu_overlap")
_GRAPH_SIZES = ("graph_batch", "graph_tokens")
_FIELDS = ("name", "base", "title", "kind", "version", *_FLAGS, "scheduler", "max_batched_tokens", "max_seqs",
           *_GRAPH_SIZES, "all_reduce", "overhead", "multi_gpu_ms", "rates", "sources")


@dataclass(frozen=True)
class EngineSpec:
    """One engine as the serving simulator prices it (see the module doc and ``engines.toml``'s header)."""

    name: str
    title: str
    kind: str  # the launch registry's row (flexmesh.serve.engines)
    version: str = ""
    prefill_first: bool = False
    chunked_prefill: bool = True
    # a waiting request admitted only where the free KV holds all its known tokens, not its first chunk alone
    admit_whole: bool = False
    scheduler: str = ""  # a registered replica scheduler in place of the two above (flexmesh.serve.schedulers)
    max_batched_tokens: int | str = DEVICE
    max_seqs: int | str = DEVICE
    cuda_graphs: bool = True
    # with cuda_graphs, the largest decode-only batch (requests) and iteration with prompt tokens (new tokens; 0: none)
    # it replays as CUDA graphs (flexmesh.cost.inference.analytic.VLLM_GRAPHS)
    graph_batch: int = VLLM_GRAPHS[0]
    graph_tokens: int = VLLM_GRAPHS[1]
    cpu_overlap: bool = False
    all_reduce: str = "nccl"  # the tensor-parallel all-reduce it runs (flexmesh.cost.inference.analytic.ALL_REDUCES)
    overhead: EngineOverhead = field(default_factory=lambda: parse_overhead("vllm"))
    multi_gpu_ms: float = 0.0
    rates: EngineRates = EngineRates()
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name, allowed in (("max_batched_tokens", (DEVICE, CONTEXT)), ("max_seqs", (DEVICE,))):
            v = getattr(self, name)
            if not ((isinstance(v, int) and not isinstance(v, bool) and v >= 1) or v in allowed):
                raise SpecError(f"engine {self.name!r}: {name} is a whole number >= 1 or "
                                f"{' or '.join(repr(a) for a in allowed)}, got {v!r}")
        for name in _GRAPH_SIZES:
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise SpecError(f"engine {self.name!r}: {name} is a whole number >= 0, got {v!r}")
        if self.all_reduce not in ALL_REDUCES:
            raise SpecError(f"engine {self.name!r}: all_reduce is one of {', '.join(ALL_REDUCES)} (NCCL's, or the "
                            f"engine whose own all-reduce it runs), got {self.all_reduce!r}")
        if not (isinstance(self.multi_gpu_ms, (int, float)) and self.multi_gpu_ms >= 0):
            raise SpecError(f"engine {self.name!r}: multi_gpu_ms is >= 0, got {self.multi_gpu_ms!r}")

    @property
    def graphs(self) -> tuple[int, int]:
        """The largest decode-only batch and iteration with prompt tokens it replays as CUDA graphs; (0, 0): none."""
        return (self.graph_batch, self.graph_tokens) if self.cuda_graphs else (0, 0)

    @property
    def scheduler_name(self) -> str:
        """The replica scheduler it runs (flexmesh.serve.schedulers): its own, or the one its two flags name."""
        return self.scheduler or scheduler_for(self.prefill_first, self.chunked_prefill)

    # ---- pricing ---------------------------------------------------------------------------------------
    @property
    def costs(self) -> EngineOverhead:
        """Its per-iteration CPU cost, the multi-GPU RPC included."""
        return replace(self.overhead, multi_gpu_s=self.multi_gpu_ms * 1e-3)

    def iteration(self, model, hardware, tp: int = 1, pp: int = 1, block: int = 0,  # noqa: ANN001, ANN201
                  scale: float = 1.0):
        """Its :class:`~flexmesh.cost.inference.analytic.AnalyticIteration` of ``model`` on a ``tp x pp`` replica
        of ``hardware`` (at its kernels' rates; ``scale``: a factor on the device layer's prices, an end of the
        part's price band)."""
        from flexmesh.cost.inference.analytic import AnalyticIteration

        return AnalyticIteration(model, self.rates.on(hardware), tp, pp, self.costs, block=block,
                                 graphs=self.graphs, overlap=self.cpu_overlap, all_reduce=self.all_reduce, scale=scale)

    def knobs(self, dev: DeviceSpec, context: int = 0, **given: Any) -> EngineKnobs:
        """Its default knobs on ``dev`` (``context``: the model's, for a budget of the whole context), replaced by
        the ``given`` ones that are not None."""
        base = default_knobs(dev)
        budget = self.max_batched_tokens
        if budget == CONTEXT:
            budget = max(context, MIN_WHOLE_BUDGET)
        seqs = base.max_seqs if self.max_seqs == DEVICE else self.max_seqs
        tokens = base.max_batched_tokens if budget == DEVICE else budget
        knobs = replace(base, max_seqs=int(seqs), max_batched_tokens=max(int(tokens), int(seqs)))
        return replace(knobs, **{k: v for k, v in given.items() if v is not None})

    # ---- words and files ---------------------------------------------------------------------------------
    def label(self) -> str:
        """One line: what it is and does."""
        mix = "prompts first" if self.prefill_first else "prompts mixed with decodes"
        chunk = "chunked prefill" if self.chunked_prefill else "whole prompts"
        if self.chunked_prefill and self.admit_whole:
            chunk += " (admitted where the whole prompt fits)"
        if self.scheduler:
            mix, chunk = f"scheduler {self.scheduler}", ""
        graphs = "no CUDA graphs"
        if self.cuda_graphs:
            mixed = f", mixed up to {self.graph_tokens} tokens" if self.graph_tokens else ", mixed eagerly"
            graphs = f"CUDA graphs (decode up to {self.graph_batch}{mixed})"
        overlap = ", CPU work overlapped" if self.cpu_overlap else ""
        multi = f", {self.multi_gpu_ms:g} ms per iteration on more than one GPU" if self.multi_gpu_ms else ""
        multi += f", {self.all_reduce}'s own all-reduce" if self.all_reduce != "nccl" else ""
        version = f" {self.version}" if self.version else ""
        what = ", ".join(x for x in (mix, chunk, graphs) if x)
        return f"{self.name} ({self.title}{version}: {what}{overlap}{multi})"

    def to_dict(self) -> dict[str, Any]:
        o = self.overhead
        out: dict[str, Any] = {
            "name": self.name, "title": self.title, "kind": self.kind, "version": self.version,
            "prefill_first": self.prefill_first, "chunked_prefill": self.chunked_prefill,
            "admit_whole": self.admit_whole, **({"scheduler": self.scheduler} if self.scheduler else {}),
            "max_batched_tokens": self.max_batched_tokens, "max_seqs": self.max_seqs,
            "cuda_graphs": self.cuda_graphs, "graph_batch": self.graph_batch, "graph_tokens": self.graph_tokens,
            "cpu_overlap": self.cpu_overlap, "all_reduce": self.all_reduce,
            "overhead": preset_name(o) or {"fixed_ms": o.fixed_s * 1e3, "per_request_ms": o.per_request_s * 1e3,
                                           **({"layers": o.layers} if o.layers else {}), "source": o.source},
            "multi_gpu_ms": self.multi_gpu_ms}
        if not self.rates.unit:
            out["rates"] = {**self.rates.factors(), "source": self.rates.source}
        if self.sources:
            out["sources"] = dict(self.sources)
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "engine", *, folder: Path | None = None,
                  chain: tuple[Path, ...] = ()) -> EngineSpec:
        """A description from its fields (a ``base`` preset's or file's for those not given; a file named
        relative to ``folder``, the folder of the file ``d`` was read from, which ``chain`` ends with)."""
        if not isinstance(d, dict):
            raise SpecError(f"{where}: an engine description is a table of fields, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_FIELDS))
        if unknown:
            raise SpecError(f"{where}: unknown field(s) {', '.join(unknown)}; fields: {', '.join(_FIELDS)}")
        if not set(d) - {"name"}:
            raise SpecError(f"{where} gives no field: set base = a preset ({', '.join(presets())}) and the fields "
                            "that differ (docs/engines.md)")
        if not isinstance(d.get("name", ""), str) or not isinstance(d.get("title", ""), str):
            raise SpecError(f"{where}: name and title are text, got {d.get('name')!r}, {d.get('title')!r}")
        base = _base(d["base"], where, folder, chain) if "base" in d else None
        name = str(d.get("name") or (base.name if base else "")).strip()
        if not name:
            raise SpecError(f"{where}: an engine description needs a name (or a base preset)")
        kw: dict[str, Any] = {} if base is None else {f.name: getattr(base, f.name) for f in fields(cls)}
        kw.update(name=name, title=str(d.get("title", kw.get("title", name))),
                  kind=str(d.get("kind", kw.get("kind", name))))
        for key in ("version", "scheduler", "max_batched_tokens", "max_seqs", *_GRAPH_SIZES, "all_reduce"):  # checked
            if key in d:
                kw[key] = d[key]
        for key in _FLAGS:
            if key in d:
                if not isinstance(d[key], bool):
                    raise SpecError(f"{where}.{key} is true or false, got {d[key]!r}")
                kw[key] = d[key]
        if "overhead" in d:
            kw["overhead"] = _overhead(d["overhead"], f"{where}.overhead")
        if "multi_gpu_ms" in d:
            kw["multi_gpu_ms"] = _milliseconds(d["multi_gpu_ms"], f"{where}.multi_gpu_ms")
        if "rates" in d:
            rates = d["rates"]
            if not isinstance(rates, dict) or set(rates) - {*TERMS, "source"}:
                raise SpecError(f"{where}.rates is a table of {', '.join(TERMS)} (and their source), got {rates!r}")
            try:
                kw["rates"] = EngineRates(**{k: float(v) for k, v in rates.items() if k != "source"},
                                          source=str(rates.get("source", f"{where}.rates")))
            except (TypeError, ValueError, SpecError) as err:
                raise SpecError(f"{where}.rates: {err}") from None
        own = d.get("sources", {})
        if not isinstance(own, dict) or set(own) - set(_FIELDS):
            extra = sorted(set(own) - set(_FIELDS)) if isinstance(own, dict) else []
            raise SpecError(f"{where}.sources is a table of field = source" + (
                f"; not fields: {', '.join(map(str, extra))}" if extra else ""))
        # a base's sources stand for the fields this description keeps (its scheduler's for the two it is made of)
        given = set(d) | ({"scheduler"} if {"prefill_first", "chunked_prefill"} & set(d) else set())
        kept = {k: v for k, v in kw.get("sources", ()) if k not in given}
        kw["sources"] = tuple({**kept, **{str(k): str(v) for k, v in own.items()}}.items())
        try:
            return cls(**kw)
        except (TypeError, SpecError) as err:
            raise SpecError(f"{where}: {err}") from None


def planned_engine(d: Any, where: str = "engine") -> EngineSpec:
    """The description a plan file carries; one written before the CUDA graph sizes were fields (none given, no
    base) takes its preset's where it names one, as it was planned."""
    if isinstance(d, dict) and "base" not in d and not set(_GRAPH_SIZES) & set(d) and d.get("name") in presets():
        d = {**d, **{k: getattr(presets()[d["name"]], k) for k in _GRAPH_SIZES}}
    return EngineSpec.from_dict(d, where)


def scheduler_for(prefill_first: bool, chunked: bool) -> str:
    """The registered scheduler of an engine that runs prompts first or mixed, chunked or whole."""
    return f"{'prefill-first' if prefill_first else 'mixed'}-{'chunked' if chunked else 'whole'}"


def _overhead(raw: Any, where: str) -> EngineOverhead:
    """A preset's overhead, or one given as a table of ``fixed_ms``, ``per_request_ms``, ``layers`` (those of the
    model it was measured on, for a cost that scales with layers) and its ``source``."""
    if isinstance(raw, str):
        return parse_overhead(raw)
    if isinstance(raw, dict) and set(raw) <= {"fixed_ms", "per_request_ms", "layers", "source"} and "fixed_ms" in raw:
        given = parse_overhead(f"{raw['fixed_ms']!r},{raw.get('per_request_ms', 0)!r}")
        try:
            return replace(given, source=str(raw.get("source", given.source)), layers=raw.get("layers", 0))
        except SpecError as err:
            raise SpecError(f"{where}: {err}") from None
    raise SpecError(f"{where} is a preset name or a table of fixed_ms, per_request_ms, layers and source, got {raw!r}")


def _milliseconds(raw: Any, where: str) -> float:
    """A number of milliseconds, or measured samples (their median)."""
    if isinstance(raw, list) and raw and all(isinstance(v, (int, float)) for v in raw):
        return round(float(statistics.median(raw)), 3)
    if isinstance(raw, (int, float)) and not isinstance(raw, bool) and raw >= 0:
        return float(raw)
    raise SpecError(f"{where} is a number of milliseconds >= 0 or a list of measured ones, got {raw!r}")


@lru_cache(maxsize=None)
def presets() -> dict[str, EngineSpec]:
    """The engine presets (``flexmesh/spec/presets/engines.toml``), by name."""
    raw = tomllib.loads(resources.files("flexmesh.spec").joinpath("presets/engines.toml").read_text())
    return {name: EngineSpec.from_dict({**entry, "name": name}, f"engines.toml [{name}]")
            for name, entry in raw.items()}


def _base(value: Any, where: str, folder: Path | None, chain: tuple[Path, ...]) -> EngineSpec:
    """The description a ``base`` field names: a preset, or a file (relative to ``folder`` where one is there)
    that is not one of ``chain``, the files this description is read through."""
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"{where}.base names a preset ({', '.join(presets())}) or a description file, got {value!r}")
    if value not in presets() and folder is not None and (folder / value).is_file():
        value = str(folder / value)
    if value not in presets() and Path(value).resolve() in chain:
        loop = " -> ".join(p.name for p in (*chain, Path(value).resolve()))
        raise SpecError(f"{where}.base leads back to a file it is read through ({loop}); a base names a preset or "
                        "another description file")
    try:
        return engine_spec(value, chain)
    except SpecError as e:
        raise SpecError(f"{where}.base: {e}") from None


def engine_spec(text: str | EngineSpec | None = None, chain: tuple[Path, ...] = ()) -> EngineSpec:
    """A preset by name, or a description file (TOML or JSON); None: the default (current vLLM). ``chain``: the
    files whose ``base`` led here (one of them again is a loop, refused)."""
    if isinstance(text, EngineSpec):
        return text
    text = DEFAULT_ENGINE if text is None else text
    found = presets().get(text)
    if found is not None:
        return found
    path = Path(text)
    if path.suffix.lower() not in (".toml", ".json") or not path.is_file():
        what = "no such file" if path.suffix.lower() in (".toml", ".json") and not path.exists() else (
            "a folder" if path.is_dir() else "")
        raise SpecError(f"unknown engine {text!r}{f' ({what})' if what else ''}: give a preset "
                        f"({', '.join(presets())}) or a .toml/.json description file (docs/engines.md)")
    try:
        body = path.read_text(encoding="utf-8")
        data = tomllib.loads(body) if path.suffix.lower() == ".toml" else json.loads(body)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise SpecError(f"engine file {text}: {err}") from None
    if isinstance(data, dict) and "name" not in data:
        data = {**data, "name": path.stem}
    return EngineSpec.from_dict(data, f"engine file {text}", folder=path.parent, chain=(*chain, path.resolve()))
