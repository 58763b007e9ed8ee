"""Fine-tuning tasks: many LoRA adapters of one frozen base model, trained in one run (docs/adapters.md).

A job file (TOML) lists one ``[[task]]`` table per adapter::

    [[task]]
    name = "chat"              # the adapter's name: its folder in an export, its rows in the metrics
    corpus = "data/chat"       # a folder of .txt/.jsonl documents (flexmesh.data.corpus), relative to the file
    rank = 8                   # LoRA rank r
    alpha = 16                 # scaling alpha / r (alpha / sqrt(r) with rslora = true)
    targets = ["q_proj", "v_proj"]   # projections, named as in Hugging Face Llama models
    # optional: batch (sequences per step; default an equal share of --global-batch), lr (default the
    # run's --lr), steps (default the run's --max-steps; a task may finish early), clip (its own gradient
    # norm limit; default the run's --grad-clip), dropout (default 0), rslora (default false),
    # init (a PEFT adapter folder to continue from), lengths (a length set, shipped name or file, that
    # `flexmesh plan --tasks --replicas` plans with when the corpus is not at hand)

Torch-free: the planner and the simulator read tasks as well as the runtime. Every check that needs
only the file and the model is here, so a bad job file fails before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from flexmesh.errors import SpecError
from flexmesh.files import plain_name
from flexmesh.inputs import load_toml
from flexmesh.spec.model import ModelSpec

# Hugging Face projection name -> (flexmesh module path inside a layer, input features, output features)
TARGETS = {
    "q_proj": "attention.wq", "k_proj": "attention.wk", "v_proj": "attention.wv", "o_proj": "attention.wo",
    "gate_proj": "feed_forward.w1", "up_proj": "feed_forward.w3", "down_proj": "feed_forward.w2",
}
_KEYS = {"name", "corpus", "rank", "alpha", "targets", "batch", "lr", "steps", "clip", "dropout", "rslora", "init",
         "lengths"}


def projection_shape(spec: ModelSpec, target: str) -> tuple[int, int]:
    """(input features, output features) of projection ``target`` (a Hugging Face name) in ``spec``."""
    h, q, kv, f = spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn_hidden
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}[target]


@dataclass(frozen=True)
class Task:
    """One adapter and what trains it."""

    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    corpus: str = ""
    batch: int | None = None  # sequences per step; None: an equal share of the global batch
    lr: float | None = None  # None: the run's learning rate
    steps: int | None = None  # None: the run's max steps
    clip: float | None = None  # None: the run's gradient clipping
    dropout: float = 0.0
    rslora: bool = False
    init: str | None = None  # a PEFT adapter folder whose weights this task starts from
    lengths: str | None = None  # the task's sequence lengths for planning: a shipped length set or a file

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: dict) -> Task:
        # the name becomes a folder (adapters/<name>/): one plain name, whatever file it came from
        plain_name(d["name"], "task name", SpecError)
        return cls(**{**d, "targets": tuple(d["targets"])})

    @property
    def scaling(self) -> float:
        """What the adapter's product is multiplied by: alpha / r, or alpha / sqrt(r) (rsLoRA, 2312.03732)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass(frozen=True)
class TaskSet:
    """The tasks of one run, in file order; a task's slot is its index here."""

    tasks: tuple[Task, ...]

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self):  # noqa: ANN204
        return iter(self.tasks)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tasks)

    def adapters(self) -> list[tuple[str, int, tuple[str, ...]]]:
        """What the adapters' tensors depend on, per slot: (name, rank, targets)."""
        return [(t.name, t.rank, t.targets) for t in self.tasks]

    def targets(self) -> tuple[str, ...]:
        """Every projection some task adapts, in the order of :data:`TARGETS`."""
        return tuple(t for t in TARGETS if any(t in task.targets for task in self.tasks))

    def batches(self, global_batch: int) -> tuple[int, ...]:
        """Sequences per step of each task: its own ``batch``, else an equal share of what is left of
        ``global_batch`` (at least 1)."""
        fixed = sum(t.batch for t in self.tasks if t.batch is not None)
        free = [t for t in self.tasks if t.batch is None]
        share = max(1, (global_batch - fixed) // len(free)) if free else 0
        return tuple(t.batch if t.batch is not None else share for t in self.tasks)

    def check(self, spec: ModelSpec) -> None:
        """Refuse what ``spec`` cannot carry: a rank larger than a target projection; an MLP projection
        of a mixture of experts (its experts are not adapted)."""
        for t in self.tasks:
            for target in t.targets:
                if spec.is_moe and TARGETS[target].startswith("feed_forward"):
                    raise SpecError(f"task {t.name!r}: {target} of {spec.name!r} is a mixture of experts' MLP, "
                                    "which flexmesh does not adapt; target q_proj, k_proj, v_proj and o_proj")
                fan_in, fan_out = projection_shape(spec, target)
                if t.rank > min(fan_in, fan_out):
                    raise SpecError(f"task {t.name!r}: rank {t.rank} is larger than {target} of {spec.name!r} "
                                    f"({fan_in} -> {fan_out}); use a rank of at most {min(fan_in, fan_out)}")


def _number(where: str, key: str, value: object, kind: type, low: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise SpecError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if not math.isfinite(value) or value < low or (low_open and value == low):
        raise SpecError(f"{where}: {key} must be {'above' if low_open else 'at least'} {low}, got {value!r}")
    return value


def parse_task(table: dict, where: str, base: Path | None = None) -> Task:
    """One ``[[task]]`` table (``where`` names it in errors; ``base``: the folder paths are relative to)."""
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise SpecError(f"{where}: unknown key {unknown[0]!r}; a task takes {', '.join(sorted(_KEYS))}")
    for key in ("name", "rank", "alpha", "targets"):
        if key not in table:
            raise SpecError(f"{where}: missing {key!r}")
    name = table["name"]
    plain_name(name, f"{where}: name", SpecError)
    where = f"{where} ({name!r})"
    targets = table["targets"]
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise SpecError(f"{where}: targets must be a list of projection names such as [\"q_proj\", \"v_proj\"]")
    for t in targets:
        if t not in TARGETS:
            raise SpecError(f"{where}: the model has no projection {t!r}; targets are {', '.join(TARGETS)}")
    if len(set(targets)) != len(targets):
        raise SpecError(f"{where}: targets name a projection twice")

    def path(key: str) -> str | None:
        value = table.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise SpecError(f"{where}: {key} must be a path, got {value!r}")
        return str(base / value) if base is not None and not Path(value).is_absolute() else value

    def opt(key: str, kind: type, low: float, low_open: bool = False) -> float | None:
        return None if key not in table else kind(_number(where, key, table[key], kind, low, low_open))

    def lengths(value: object) -> str | None:  # a shipped set's name, or a file relative to the job file
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise SpecError(f"{where}: lengths must be a length set's name or a file, got {value!r}")
        return str(base / value) if base is not None and (base / value).is_file() else value

    def whole(key: str) -> int | None:
        return None if key not in table else int(_number(where, key, table[key], int, 1))

    dropout = opt("dropout", float, 0.0) or 0.0
    if dropout >= 1.0:
        raise SpecError(f"{where}: dropout must be below 1, got {dropout}")
    rslora = table.get("rslora", False)
    if not isinstance(rslora, bool):
        raise SpecError(f"{where}: rslora must be true or false, got {rslora!r}")
    return Task(name=name, rank=int(_number(where, "rank", table["rank"], int, 1)),
                alpha=float(_number(where, "alpha", table["alpha"], float, 0.0, low_open=True)),
                targets=tuple(t for t in TARGETS if t in targets), corpus=path("corpus") or "",
                batch=whole("batch"), lr=opt("lr", float, 0.0), steps=whole("steps"),
                clip=opt("clip", float, 0.0), dropout=dropout, rslora=rslora, init=path("init"),
                lengths=lengths(table.get("lengths")))


def make_tasks(tasks: list[Task]) -> TaskSet:
    """A TaskSet, refusing none and two tasks of one name."""
    if not tasks:
        raise SpecError("the job file lists no task; add one [[task]] table per adapter")
    seen: set[str] = set()
    for t in tasks:
        if t.name in seen:
            raise SpecError(f"two tasks are named {t.name!r}; give every task its own name")
        seen.add(t.name)
    return TaskSet(tuple(tasks))


def load_tasks(path: str | Path) -> TaskSet:
    """The tasks of job file ``path`` (see the module doc); corpus and init paths relative to its folder."""
    path = Path(path)
    data = load_toml(path, SpecError, missing=f"job file {path} does not exist; pass --tasks a TOML file of [[task]] "
                     "tables", invalid="not a valid TOML job file")
    extra = sorted(set(data) - {"task"})
    if extra:
        raise SpecError(f"job file {path}: unknown table or key {extra[0]!r}; list tasks as [[task]] tables")
    tables = data.get("task", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise SpecError(f"job file {path}: write tasks as [[task]] tables (an array of tables)")
    for t in tables:
        if "corpus" not in t and "lengths" not in t:
            raise SpecError(f"job file {path}: task {t.get('name', '?')!r} has no corpus (nor lengths, to plan with)")
    return make_tasks([parse_task(t, f"job file {path}, task {i + 1}", path.parent) for i, t in enumerate(tables)])
