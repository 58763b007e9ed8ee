"""Profile files: versioned plain JSON with units in key names; see docs/profiles.md for every key.

Two kinds: a *hardware* profile (compute throughput, memory bandwidth, alpha-beta per collective and
group size) and a *model* profile (per-layer time fits, activation bytes per token by tp/cp degree
and recomputation, parameter and optimizer bytes). Both carry ``produced_by``: the machine and
software that measured them.

>>> import tempfile, pathlib
>>> hw = HardwareProfile(device={"type": "cpu", "name": "cpu", "nodes": 1, "devices_per_node": 2,
...                              "memory_bytes": 8 * 2**30}, dtype="fp32",
...                      matmul_flops_per_s={"fp32": 5e10}, memory_bytes_per_s=1e10,
...                      attention={"fp32": {"alpha_s": 0.0, "s_per_sq_token": 1e-9, "flops_per_s": 2e9}},
...                      collectives=[CollectiveFit("all_reduce", 2, "intra", 3e-5, 1e-9)])
>>> path = pathlib.Path(tempfile.mkdtemp()) / "hw.json"
>>> hw.save(path)
>>> back = load_profile(path)
>>> back.name, back.kind, back.collectives[0].time(1e6)
('hw.json', 'hardware', 0.00103)
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, overload

from flexmesh.errors import ProfileError, SpecError
from flexmesh.files import read_json
from flexmesh.profile.fit import LayerFit
from flexmesh.spec.values import mapping, number, sequence, text, whole

VERSION = 1
END_KEYS = ("embedding_forward", "embedding_backward", "head_forward", "head_backward")
KINDS = ("hardware", "model")
SCOPES = ("intra", "inter")

# Keys every profile of a kind must have (dotted paths), checked on load.
REQUIRED = {
    "hardware": ("produced_by", "device.type", "device.name", "device.nodes", "device.devices_per_node",
                 "device.memory_bytes", "dtype", "matmul_flops_per_s", "memory_bytes_per_s", "attention",
                 "collectives"),
    "model": ("produced_by", "model", "model_hash", "dtype", "layer.forward", "layer.backward",
              "layer.backward_recompute", "embedding.forward", "embedding.backward", "head.forward",
              "head.backward", "activations.layers", "activations.attention_mask_bytes_per_sq_row_token",
              "activations.embedding_bytes_per_token", "activations.head_bytes_per_token",
              "states.weight_bytes_per_param", "states.grad_bytes_per_param", "states.optimizer_bytes_per_param",
              "states.optimizer_step_s_per_param"),
}


def produced_by(processes: int = 1, device_name: str | None = None, device_count: int | None = None,
                device_type: str | None = None) -> dict:
    """What measured a profile: machine, software, date, and how many processes ran at the same time.

    ``device_type`` ("cpu" or "cuda"): the device the measurements ran on, which names it when
    ``device_name`` is not given (default: the GPU when there is one).
    """
    import torch

    import flexmesh

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    measured = gpu if device_type != "cpu" else None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "gpu": gpu,
        "device_name": device_name or measured or _cpu_name(),
        "device_count": device_count if device_count is not None else (torch.cuda.device_count() or 1),
        "torch_version": torch.__version__,
        "flexmesh_version": flexmesh.__version__,
        "python_version": platform.python_version(),
        "threads_per_process": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "processes": processes,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def spec_hash(spec_dict: dict) -> str:
    """Hash of a model's shape: every ModelSpec field except ``name`` and ``dtype``.

    The name is left out so that a config.json and the preset of the same shape share profiles; the
    dtype because the profile records the dtype it measured in (the runtime's), whatever the spec says.
    """
    shape = {k: v for k, v in spec_dict.items() if k not in ("name", "dtype")}
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CollectiveFit:
    """``seconds = alpha_s + beta_s_per_byte * nbytes`` for one collective over a group of ``group_size``.

    ``scope`` is ``intra`` (the group inside one node) or ``inter`` (one rank per node). ``nbytes``
    follows flexmesh.cost.device.hardware: the all-reduce buffer, the all-gather output, the reduce-scatter
    input, one rank's all-to-all send buffer, one send/recv message.
    """

    collective: str
    group_size: int
    scope: str
    alpha_s: float
    beta_s_per_byte: float
    samples: tuple = ()  # ((nbytes, seconds), ...) the fit came from

    def time(self, nbytes):
        return self.alpha_s + self.beta_s_per_byte * nbytes

    def to_dict(self) -> dict:
        return {"collective": self.collective, "group_size": self.group_size, "scope": self.scope,
                "alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte,
                "samples_bytes_s": [list(s) for s in self.samples]}

    @classmethod
    def from_dict(cls, d: dict) -> "CollectiveFit":
        return cls(d["collective"], int(d["group_size"]), d["scope"], float(d["alpha_s"]),
                   float(d["beta_s_per_byte"]), tuple(tuple(s) for s in d.get("samples_bytes_s", ())))


@dataclass
class HardwareProfile:
    """A measured machine (see docs/profiles.md); ``name`` is the file name once saved or loaded."""

    device: dict
    dtype: str
    matmul_flops_per_s: dict
    memory_bytes_per_s: float
    attention: dict
    collectives: list[CollectiveFit] = field(default_factory=list)
    produced_by: dict = field(default_factory=dict)
    name: str = "hardware"
    overlap: dict = field(default_factory=dict)  # how much communication hides under compute (optional)
    kind: str = "hardware"

    def matmul(self, dtype: str) -> float:
        if dtype not in self.matmul_flops_per_s:
            raise ProfileError(f"hardware profile {self.name} has no matmul throughput for {dtype}; it measured "
                               f"{sorted(self.matmul_flops_per_s)}: use one of those or re-profile on this device")
        return float(self.matmul_flops_per_s[dtype])

    def attention_flops(self, dtype: str) -> float:
        if dtype not in self.attention:
            raise ProfileError(f"hardware profile {self.name} has no attention throughput for {dtype}; it measured "
                               f"{sorted(self.attention)}")
        return float(self.attention[dtype]["flops_per_s"])

    def memory_per_device(self, processes: int) -> float:
        """Bytes one of ``processes`` training processes on a node may use: a GPU's own memory, or on
        CPU the RAM the profiled processes shared, divided among ``processes``."""
        if self.device["type"] == "cpu":
            return float(self.device["memory_bytes"]) * int(self.device["devices_per_node"]) / max(1, processes)
        return float(self.device["memory_bytes"])

    def fits(self, collective: str) -> list[CollectiveFit]:
        return [c for c in self.collectives if c.collective == collective]

    def to_dict(self) -> dict:
        return {"version": VERSION, "kind": "hardware", "produced_by": self.produced_by, "device": self.device,
                "dtype": self.dtype, "matmul_flops_per_s": self.matmul_flops_per_s,
                "memory_bytes_per_s": self.memory_bytes_per_s, "attention": self.attention,
                "collectives": [c.to_dict() for c in self.collectives], "overlap": self.overlap}

    @classmethod
    def from_dict(cls, d: dict, name: str = "hardware") -> "HardwareProfile":
        _check(d, "hardware", name)
        _hardware_values(d, name)
        try:
            colls = [CollectiveFit.from_dict(c) for c in d["collectives"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{name}: a collectives entry is malformed ({e!r}); each needs collective, "
                               "group_size, scope, alpha_s, beta_s_per_byte") from e
        return cls(device=d["device"], dtype=d["dtype"], matmul_flops_per_s=d["matmul_flops_per_s"],
                   memory_bytes_per_s=float(d["memory_bytes_per_s"]), attention=d["attention"], collectives=colls,
                   produced_by=d["produced_by"], name=name, overlap=_overlap(d.get("overlap") or {}, name))

    def save(self, path: str | Path) -> None:
        _save(self, path)


def recompute_name(value: bool | str) -> str:
    """An activation entry's ``recompute`` as none / selective / full (a bool: full or none).

    >>> recompute_name(True), recompute_name(False), recompute_name("selective")
    ('full', 'none', 'selective')
    """
    return ("full" if value else "none") if isinstance(value, bool) else str(value)


@dataclass
class ModelProfile:
    """A measured model (see docs/profiles.md); times are per layer (or per end) per micro-batch."""

    model: dict  # the ModelSpec it was measured with (ModelSpec.to_dict)
    dtype: str
    layer: dict  # forward / backward / backward_recompute: LayerFit
    embedding: dict  # forward / backward: LayerFit (linear only)
    head: dict  # final norm + LM head + cross-entropy; forward / backward: LayerFit (linear only)
    activations: dict
    states: dict
    produced_by: dict = field(default_factory=dict)
    samples: dict = field(default_factory=dict)
    name: str = "model"
    kind: str = "model"
    # Times under real process groups (optional; profiled with more than one process): "layers", one
    # entry per (tp, cp_kind, cp) with forward / backward / backward_recompute LayerFits, and "ends",
    # one per tp with embedding_* / head_* LayerFits; see docs/profiles.md.
    parallel: dict = field(default_factory=dict)
    # The whole model timed as the trainer runs it against the sum of its parts (optional; older
    # profiles have none): "layers", "forward" and "backward" factors, "samples"; see docs/profiles.md.
    whole_model: dict = field(default_factory=dict)
    # The framework's fixed cost per pipeline chunk per micro-batch (optional; older profiles have none):
    # "stages", "microbatches", "tokens", "step_s", "stage_fixed_s"; see docs/profiles.md.
    pipeline: dict = field(default_factory=dict)

    def whole_factor(self, direction: str) -> float:
        """The whole-model factor of ``direction`` (forward / backward); 1.0 where not measured."""
        return float(self.whole_model.get(direction, 1.0))

    def whole_fixed(self, direction: str) -> float:
        """The whole model's fixed seconds per micro-batch in ``direction``; 0 where not measured."""
        return float(self.whole_model.get(f"{direction}_fixed_s", 0.0))

    def stage_fixed(self) -> float:
        """The framework's fixed seconds per pipeline chunk per micro-batch; 0 where not measured."""
        return float(self.pipeline.get("stage_fixed_s", 0.0))

    @property
    def model_hash(self) -> str:
        return spec_hash(self.model)

    def check_model(self, spec) -> None:
        """Raise ProfileError unless ``spec`` (a ModelSpec) has the shape this profile measured."""
        if spec_hash(spec.to_dict()) != self.model_hash:
            mine = self.model
            diff = [f"{k} {mine.get(k)} vs {v}" for k, v in spec.to_dict().items()
                    if k not in ("name", "dtype") and mine.get(k) != v]
            raise ProfileError(
                f"model profile {self.name} was measured on model {mine.get('name')!r}, not {spec.name!r} "
                f"({'; '.join(diff[:4])}); run `flexmesh profile model --model {spec.name}` for this model")

    def activation_entry(self, tp: int, cp: int, recompute: bool | str) -> dict | None:
        """The activation table's entry for (tp, cp, recompute); ``recompute`` is false / true (none /
        full, as older profiles write it) or ``"none"`` / ``"selective"`` / ``"full"``."""
        want = recompute_name(recompute)
        for e in self.activations["layers"]:
            if int(e["tp"]) == tp and int(e["cp"]) == cp and recompute_name(e["recompute"]) == want:
                return e
        return None

    def parallel_layer(self, tp: int, cp_kind: str, cp: int) -> dict | None:
        """The layer's fits timed under a real tp x cp group of ``cp_kind``, or None if not profiled."""
        kind = cp_kind if cp > 1 else "none"
        return next((e for e in self.parallel.get("layers", ())
                     if (int(e["tp"]), e["cp_kind"], int(e["cp"])) == (tp, kind, cp)), None)

    def parallel_ends(self, tp: int) -> dict | None:
        """The embedding's and head's fits timed under a real tp group, or None if not profiled."""
        return next((e for e in self.parallel.get("ends", ()) if int(e["tp"]) == tp), None)

    def to_dict(self) -> dict:
        def fits(d):
            return {k: v.to_dict() if isinstance(v, LayerFit) else v for k, v in d.items()}

        parallel = {**self.parallel, **{part: [fits(e) for e in self.parallel.get(part, ())]
                                        for part in ("layers", "ends") if part in self.parallel}}
        return {"version": VERSION, "kind": "model", "produced_by": self.produced_by, "model": self.model,
                "model_hash": self.model_hash, "dtype": self.dtype, "layer": fits(self.layer),
                "embedding": fits(self.embedding), "head": fits(self.head), "activations": self.activations,
                "states": self.states, "samples": self.samples, "parallel": parallel, "whole_model": self.whole_model,
                "pipeline": self.pipeline}

    @classmethod
    def from_dict(cls, d: dict, name: str = "model") -> "ModelProfile":
        _check(d, "model", name)
        _model_values(d, name)
        if spec_hash(d["model"]) != d["model_hash"]:
            raise ProfileError(f"{name}: model_hash does not match the recorded model (the file was edited); "
                               "re-run `flexmesh profile model`")
        try:
            def fits(part, keys):
                return {k: LayerFit.from_dict(d[part][k]) for k in keys}

            parallel = dict(d.get("parallel") or {})
            for part, keys in (("layers", ("forward", "backward", "backward_recompute")), ("ends", END_KEYS)):
                if part in parallel:
                    parallel[part] = [{**e, **{k: LayerFit.from_dict(e[k]) for k in keys}} for e in parallel[part]]
            profile = cls(model=d["model"], dtype=d["dtype"],
                          layer=fits("layer", ("forward", "backward", "backward_recompute")),
                          embedding=fits("embedding", ("forward", "backward")),
                          head=fits("head", ("forward", "backward")),
                          activations=d["activations"], states=d["states"], produced_by=d["produced_by"],
                          samples=d.get("samples", {}), name=name, parallel=parallel,
                          whole_model=dict(mapping(d.get("whole_model") or {}, f"{name}: whole_model", ProfileError)),
                          pipeline=dict(mapping(d.get("pipeline") or {}, f"{name}: pipeline", ProfileError)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProfileError(f"{name}: a time fit is malformed ({e!r}); each needs c0_s, c1_s_per_token, "
                               "c2_s_per_sq_token") from None
        for part in ("layer", "embedding", "head"):
            _fit_values(getattr(profile, part), f"{name}: {part}")
        for part, keys in (("layers", ("forward", "backward", "backward_recompute")), ("ends", END_KEYS)):
            for i, entry in enumerate(parallel.get(part, ())):
                _fit_values({k: entry[k] for k in keys}, f"{name}: parallel.{part}[{i}]")
        for key in ("forward", "backward", "forward_fixed_s", "backward_fixed_s"):
            if key in profile.whole_model:
                number(profile.whole_model[key], f"{name}: whole_model.{key}", ProfileError,
                       strict=not key.endswith("_fixed_s"))  # a factor > 0, a fixed time >= 0
        if "stage_fixed_s" in profile.pipeline:
            number(profile.pipeline["stage_fixed_s"], f"{name}: pipeline.stage_fixed_s", ProfileError, strict=False)
        return profile

    def save(self, path: str | Path) -> None:
        _save(self, path)


def _overlap(d: dict, name: str) -> dict:
    if d:
        number(mapping(d, f"{name}: overlap", ProfileError).get("hidden_fraction"), f"{name}: overlap.hidden_fraction",
               ProfileError, strict=False, maximum=1.0)
    return d


def _fit_values(fits: dict, where: str) -> None:
    """Time fits are sums of non-negative terms (the fit is bounded below by 0): finite and >= 0."""
    for k, f in fits.items():
        for c in ("c0_s", "c1_s_per_token", "c2_s_per_sq_token", "c3_s_per_sq_row_token"):
            number(getattr(f, c), f"{where}.{k}.{c}", ProfileError, strict=False)


def _hardware_values(d: dict, name: str) -> None:
    """Types and ranges of what a hardware profile says (ProfileError naming the key)."""
    w = f"{name}: "
    dev = mapping(d["device"], f"{w}device", ProfileError)
    text(dev["type"], f"{w}device.type", ProfileError)
    for k in ("nodes", "devices_per_node"):
        whole(dev[k], f"{w}device.{k}", ProfileError)
    number(dev["memory_bytes"], f"{w}device.memory_bytes", ProfileError)
    text(d["dtype"], f"{w}dtype", ProfileError)
    for k, v in mapping(d["matmul_flops_per_s"], f"{w}matmul_flops_per_s", ProfileError).items():
        number(v, f"{w}matmul_flops_per_s.{k}", ProfileError)
    number(d["memory_bytes_per_s"], f"{w}memory_bytes_per_s", ProfileError)
    for k, v in mapping(d["attention"], f"{w}attention", ProfileError).items():
        number(mapping(v, f"{w}attention.{k}", ProfileError).get("flops_per_s"), f"{w}attention.{k}.flops_per_s",
               ProfileError)
    for i, c in enumerate(sequence(d["collectives"], f"{w}collectives", ProfileError)):
        mapping(c, f"{w}collectives[{i}]", ProfileError)
        where = f"{w}collectives[{i}]"
        text(c.get("collective"), f"{where}.collective", ProfileError)
        whole(c.get("group_size"), f"{where}.group_size", ProfileError)
        if c.get("scope") not in SCOPES:
            raise ProfileError(f"{where}.scope must be one of {', '.join(SCOPES)}, got {c.get('scope')!r}")
        for k in ("alpha_s", "beta_s_per_byte"):
            number(c.get(k), f"{where}.{k}", ProfileError, strict=False)
        for s in sequence(c.get("samples_bytes_s", []), f"{where}.samples_bytes_s", ProfileError):
            if len(sequence(s, f"{where}.samples_bytes_s entry", ProfileError)) != 2:
                raise ProfileError(f"{where}.samples_bytes_s entries must be [bytes, seconds] pairs, got {s!r}")
            for value, what in zip(s, ("bytes", "seconds")):  # the cost model prices by these
                number(value, f"{where}.samples_bytes_s {what}", ProfileError, strict=False)
    mapping(d["produced_by"], f"{w}produced_by", ProfileError)


def _model_values(d: dict, name: str) -> None:
    """Types and ranges of what a model profile says, before its fits are read (ProfileError naming the key)."""
    from flexmesh.spec.model import ModelSpec

    w = f"{name}: "
    try:
        ModelSpec.from_dict(mapping(d["model"], f"{w}model", ProfileError))
    except SpecError as e:
        raise ProfileError(f"{w}the recorded model is malformed ({e}); re-run `flexmesh profile model`") from None
    text(d["dtype"], f"{w}dtype", ProfileError)
    acts = mapping(d["activations"], f"{w}activations", ProfileError)
    for i, entry in enumerate(sequence(acts["layers"], f"{w}activations.layers", ProfileError)):
        where = f"{w}activations.layers[{i}]"
        mapping(entry, where, ProfileError)
        for k in ("tp", "cp"):
            whole(entry.get(k), f"{where}.{k}", ProfileError)
        # true: the whole layer is recomputed; "selective": the attention core only
        if not (isinstance(entry.get("recompute"), bool) or entry.get("recompute") == "selective"):
            raise ProfileError(f"{where}.recompute must be false, true or \"selective\", "
                               f"got {entry.get('recompute')!r}")
        number(entry.get("bytes_per_token"), f"{where}.bytes_per_token", ProfileError, strict=False)
    for k in ("attention_mask_bytes_per_sq_row_token", "embedding_bytes_per_token", "head_bytes_per_token"):
        number(acts[k], f"{w}activations.{k}", ProfileError, strict=False)
    states = mapping(d["states"], f"{w}states", ProfileError)
    number(states["weight_bytes_per_param"], f"{w}states.weight_bytes_per_param", ProfileError)
    for k in ("grad_bytes_per_param", "optimizer_bytes_per_param", "optimizer_step_s_per_param"):
        number(states[k], f"{w}states.{k}", ProfileError, strict=False)
    mapping(d["produced_by"], f"{w}produced_by", ProfileError)
    mapping(d.get("samples", {}), f"{w}samples", ProfileError)
    parallel = mapping(d.get("parallel") or {}, f"{w}parallel", ProfileError)
    for part in ("layers", "ends"):
        for i, entry in enumerate(sequence(parallel.get(part, []), f"{w}parallel.{part}", ProfileError)):
            where = f"{w}parallel.{part}[{i}]"
            whole(mapping(entry, where, ProfileError).get("tp"), f"{where}.tp", ProfileError)
            if part == "layers":
                whole(entry.get("cp"), f"{where}.cp", ProfileError)
                text(entry.get("cp_kind"), f"{where}.cp_kind", ProfileError)


def _check(d: dict, kind: str, name: str) -> None:
    if not isinstance(d, dict):
        raise ProfileError(f"{name}: a profile is a JSON object, got {type(d).__name__}")
    version = d.get("version")
    if version != VERSION:
        raise ProfileError(f"{name}: profile version {version!r} is not supported (this flexmesh reads version "
                           f"{VERSION}); re-run `flexmesh profile {d.get('kind', kind)}`")
    if d.get("kind") != kind:
        raise ProfileError(f"{name}: this is a {d.get('kind')!r} profile, but a {kind} profile is needed here; "
                           f"pass the file written by `flexmesh profile {kind}`")
    missing = []
    for path in REQUIRED[kind]:
        node = d
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                missing.append(path)
                break
            node = node[part]
    if missing:
        raise ProfileError(f"{name}: {kind} profile is missing {', '.join(missing)}; re-run `flexmesh profile {kind}`")


def _save(profile, path: str | Path) -> None:
    from flexmesh.files import write_atomic

    path = Path(path)
    # write_atomic makes the missing folders: the path is the user's (--out) or the cache's, whose
    # parents may be links the user chose; the file itself is never written through a link.
    write_atomic(path, json.dumps(profile.to_dict(), indent=1) + "\n")
    profile.name = path.name


@overload
def load_profile(path: str | os.PathLike[str], kind: Literal["hardware"]) -> HardwareProfile: ...
@overload
def load_profile(path: str | os.PathLike[str], kind: Literal["model"]) -> ModelProfile: ...
@overload
def load_profile(path: str | os.PathLike[str], kind: str | None = None) -> HardwareProfile | ModelProfile: ...


def load_profile(path: str | os.PathLike[str], kind: str | None = None) -> HardwareProfile | ModelProfile:
    """Read a profile file; ``kind`` ("hardware" or "model") insists on one kind.

    Raises ProfileError for a missing or unreadable file, an unknown version, the wrong kind or
    missing keys. A model profile's ``check_model(spec)`` rejects another model.
    """
    path = Path(path)
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    d = read_json(path, ProfileError, invalid="not a JSON profile",
                  missing=f"profile {str(path)!r} does not exist; write one with `flexmesh profile "
                          f"{kind or 'hardware|model'} --out {path}`")
    found = d.get("kind") if isinstance(d, dict) else None
    if kind is None:
        if found not in KINDS:
            _check(d, "hardware", path.name)  # reports the version or the kind
        kind = found
    if kind == "hardware":
        return HardwareProfile.from_dict(d, name=path.name)
    return ModelProfile.from_dict(d, name=path.name)


ProfileSource = str | os.PathLike[str] | HardwareProfile | ModelProfile  # a profile, or the path of its file


@overload
def as_profile(p: ProfileSource, kind: Literal["hardware"]) -> HardwareProfile: ...
@overload
def as_profile(p: ProfileSource, kind: Literal["model"]) -> ModelProfile: ...


def as_profile(p: ProfileSource, kind: str) -> HardwareProfile | ModelProfile:
    """A profile object from a path or a profile (passed through after a kind check)."""
    if isinstance(p, (str, os.PathLike)):
        return load_profile(p, kind)
    if p.kind != kind:
        raise ProfileError(f"expected a {kind} profile, got {type(p).__name__}")
    return p
