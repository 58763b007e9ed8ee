"""Training checkpoints: torch.distributed.checkpoint (DCP) written atomically, resumed exactly.

Layout of ``<out>/checkpoints/``::

    step_000006/             one finished checkpoint
        manifest.json        step, plan hash, world size, format, sha256 of every file and the
                             model spec (``ModelSpec.to_dict()``); written last
        .metadata, *.distcp  DCP: model and optimizer shards (each rank writes its own)
        rank_00000.pt ...    per-rank RNG states, LR scheduler and loader position (plain tensors,
                             lists and numbers: read with ``weights_only=True``)
    latest                   the name of the newest finished checkpoint (``step_NNNNNN``, nothing else)

Atomicity: every rank writes into ``.tmp-step_000006``; after a barrier rank 0 adds the manifest,
renames the folder (a single ``os.replace``) and rewrites ``latest`` atomically. A crash at any
point leaves either the previous checkpoint or a ``.tmp-*`` folder that is never read. A rank that
fails while saving (a full disk above all) makes every rank raise the same CheckpointError, after
the ``.tmp-*`` folder is removed, instead of leaving the others waiting at a barrier.

Trust: resume and export (:func:`verify_checkpoint`) check every file against the manifest's sha256,
read the rank files with ``weights_only=True`` and DCP's ``.metadata`` pickle with only DCP's own
classes allowed, so a planted pickle is refused before anything runs. The manifest can still be
rewritten together with the files it hashes: the checks find corruption and planted code, not a
checkpoint replaced whole (docs/failures.md).

Exact resume restores model, optimizer (AdamW moments and step), LR scheduler, RNG states and the
data loader's position. Resuming needs the same plan (same hash): the per-rank files follow ranks.
A migration to a new layout (``load_checkpoint(..., reshard=True)``, allowed only for the checkpoint
the migration wrote) resumes under another plan of the same world size: DCP reshards by name.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from flexmesh.errors import CheckpointError
from flexmesh.files import create_file, fresh_folder, make_folder, write_atomic
from flexmesh.inputs import load_json, read_bytes
from flexmesh.layout.plan import Plan
from flexmesh.runtime.model.params import host_threads
from flexmesh.runtime.parallel.distributed import cpu_group
from flexmesh.runtime.state.checkpoint_io import bytes_loading_planner, guarded_reader, guarded_writer, hash_files
from flexmesh.spec.tasks import Task, TaskSet

if TYPE_CHECKING:  # DCP itself is imported when a checkpoint is saved or loaded
    from torch.distributed.checkpoint.state_dict import StateDictOptions

# 2: per-parameter optimizer groups, checksums, rank files without pickled objects.
FORMAT = 2
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"step_\d{6}")


def _state_options() -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Optimizer groups keyed per parameter ("param_groups.<fqn>.lr"): by default they are one list
    # under one key, which DCP keeps once for all ranks, so pipeline stages (different parameters)
    # overwrote each other's and every pp > 1 resume failed with KeyError 'lr'.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def plan_hash(plan: Plan) -> str:
    """Hash of the plan's layout. Excluded, as they do not change what runs: the predicted figures, the
    overlap options the cost model assumed (the runtime always runs its own) and where the model's
    config.json lies (``model_config``), so checkpoints of plans written before any of them existed
    still resume. Hashed in the form an older flexmesh wrote
    where one exists (flexmesh.layout.legacy.legacy_dict), so a checkpoint written before plan version 4
    resumes under its old plan file and under the same plan upgraded."""
    from flexmesh.layout.legacy import legacy_dict

    d = legacy_dict(plan.to_dict(), plan.version)
    for key in ("predicted", "overlap", "model_config"):  # the model is checked apart (plan_model, check_model)
        d.pop(key, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _state_dicts(trainer, saving: bool) -> tuple[dict, dict]:
    """The (model, optimizer) state dicts a checkpoint writes or reads into: the trainer chooses them
    (a run of several replica groups writes each weight from one group only)."""
    return trainer.checkpoint_state(saving, _state_options())


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _rng_state() -> dict:
    # numpy's key array becomes a tensor: rank files hold only what weights_only=True may read.
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple)  # the legacy form: (kind, keys, pos, has_gauss, cached)
    kind, keys, pos, has_gauss, cached = legacy
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(root: str | Path, step: int, trainer, loader_state: dict) -> Path:
    """Write checkpoint ``step`` of ``trainer`` (a flexmesh.runtime.train.trainer.Trainer); all ranks call it.

    A failure on any rank (CheckpointError on every rank; "disk full" for ENOSPC) leaves the
    previous checkpoint and ``latest`` untouched.
    """
    return start_checkpoint(root, step, trainer, loader_state).finish()


def start_checkpoint(root: str | Path, step: int, trainer, loader_state: dict,
                     background: dist.ProcessGroup | None = None) -> PendingCheckpoint:
    """Begin checkpoint ``step`` of ``trainer``; all ranks call it, and later :meth:`PendingCheckpoint.finish`.

    The step's state (the rank files, the manifest's entries) is taken now. With ``background`` (a gloo group of
    every rank, used by nothing else) DCP's shards are copied to host memory now and written by a thread (DCP's
    ``async_save``, its collectives on that group) while training goes on; without it they are written before this
    returns. Either way the checkpoint is published (checksums, manifest, rename, ``latest``) by ``finish``.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    rank = dist.get_rank()

    def prepare() -> None:
        if rank == 0:
            make_folder(root, root=root.parent)  # a real folder in the run folder, not a symlink to somewhere else
            if os.path.lexists(final) and not _written_here(final):  # replaced in publish: only one of ours is
                raise CheckpointError(f"{final} is in the way and is not a checkpoint flexmesh wrote (no manifest of "
                                      "its own); nothing was deleted: move it out of the checkpoints folder")
            fresh_folder(tmp, root)

    writing: list = []

    def write_shards() -> None:
        model_sd, optim_sd = _state_dicts(trainer, saving=True)
        # Serialised in memory, written with a plain write: torch.save to a path turns a full disk
        # into "enforce fail ... unexpected pos", a file write into OSError(ENOSPC).
        # The LR scheduler's state stays under the key "scheduler": checkpoints already on disk use it.
        buf = io.BytesIO()
        torch.save({"rng": _rng_state(), "scheduler": trainer.lr_scheduler.state_dict(), "loader": loader_state,
                    "step_index": trainer.step_index, "parts": [part.state() for part in trainer.parts]}, buf)
        with create_file(tmp / f"rank_{rank:05d}.pt", root) as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        # several files per rank, written by as many threads (a 1.1B model's fp32 weights and AdamW
        # states are 12 GiB: one thread writes them at a fraction of a disk's bandwidth)
        writer = guarded_writer(tmp, host_threads())
        if background is None:
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
            return
        # staged (copied) before it returns: the next optimizer step cannot change what is written
        shards = dcp.async_save({"model": model_sd, "optim": optim_sd}, storage_writer=writer,
                                process_group=background)
        pool = ThreadPoolExecutor(1, thread_name_prefix="flexmesh-checkpoint")
        writing.append(pool.submit(_hash_own_files, shards, tmp, rank))  # hashed off the step's path too
        pool.shutdown(wait=False)

    manifest = {"format": FORMAT, "step": step, "plan_hash": plan_hash(trainer.plan),
                "plan_layout": trainer.plan.layout, "world_size": dist.get_world_size(), "sha256": {},
                "model": trainer.spec.to_dict()}  # what `flexmesh export` rebuilds the model from
    manifest.update(part_entries(trainer))  # e.g. LoRA tasks, the experts' layout in the weights file
    _on_all_ranks(prepare, root, tmp, final)
    _on_all_ranks(write_shards, root, tmp, final)
    return PendingCheckpoint(root, tmp, final, manifest, writing[0] if writing else None)


def _hash_own_files(shards: Any, tmp: Path, rank: int) -> dict[str, str]:
    """Once DCP's write ``shards`` (a future) is done on every rank: sha256 of the files this rank wrote (its
    rank file, DCP's ``__<rank>_*`` shards, rank 0 DCP's ``.metadata``)."""
    shards.result()
    names = [f"rank_{rank:05d}.pt"] + sorted(p.name for p in tmp.iterdir() if p.name.startswith(f"__{rank}_")
                                             or (rank == 0 and p.name == ".metadata"))
    return hash_files(tmp, names)


class PendingCheckpoint:
    """A checkpoint begun by :func:`start_checkpoint`, not yet published. ``future``: with a background write,
    the sha256 of this rank's files once every rank's are written."""

    def __init__(self, root: Path, tmp: Path, final: Path, manifest: dict, future: Any = None):
        self.root, self.tmp, self.final, self.manifest, self.future = root, tmp, final, manifest, future

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def done(self) -> bool:
        """Whether every rank's shards are written (or failed): one small all-reduce, on every rank."""
        mine = torch.tensor([1 if self.future is None or self.future.done() else 0], dtype=torch.int32)
        if dist.get_world_size() > 1:
            dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=cpu_group())
        return bool(mine.item())

    def finish(self) -> Path:
        """Wait for the shards, then publish: checksums, the manifest, the rename and ``latest``; all ranks call
        it. A failure on any rank is every rank's CheckpointError, the previous checkpoint kept."""
        mine: dict[str, str] = {}
        if self.future is not None:
            future = self.future

            def written() -> None:
                mine.update(future.result())  # DCP's CheckpointException of any rank's failed write, or the hashes

            _on_all_ranks(written, self.root, self.tmp, self.final)
        # reads only: not one of the parts a full disk can break; what the ranks hashed as they wrote is not read again
        sums = _checksums(self.tmp, hashed=mine if self.future is not None else None)
        _on_all_ranks(lambda: self._publish(sums), self.root, self.tmp, self.final)
        return self.final

    def _publish(self, sums: dict[str, str]) -> None:
        if dist.get_rank() != 0:
            return
        write_atomic(self.tmp / MANIFEST, json.dumps({**self.manifest, "sha256": sums}, indent=2) + "\n")
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.tmp, self.final)
        write_atomic(self.root / "latest", self.final.name + "\n")


def _written_here(folder: Path) -> bool:
    """Whether ``folder`` is a checkpoint flexmesh wrote: a real folder holding a manifest of this format (the
    one a save may replace: a resumed run saving a step again)."""
    m = folder / MANIFEST
    if folder.is_symlink() or not folder.is_dir() or m.is_symlink() or not m.is_file():
        return False
    try:
        d = load_json(m, CheckpointError)
    except CheckpointError:
        return False
    return isinstance(d, dict) and d.get("format") == FORMAT


def _on_all_ranks(part: Callable[[], None], root: Path, tmp: Path, final: Path) -> None:
    """Run this rank's ``part`` of a save; when any rank fails, every rank raises the same error.

    One rank's full disk must not leave the others waiting at the next collective until it times out.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    error: BaseException | None = None
    try:
        part()
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        error = e
    failed = _failures(error)
    if not failed:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        previous = latest_checkpoint(root)
    except CheckpointError:
        previous = None
    kept = f"{previous.name} is intact" if previous is not None else "there is no earlier checkpoint"
    full = [r for r in failed if r[1]]
    if full:
        raise CheckpointError(f"disk full while writing checkpoint {final} (rank {full[0][0]}: no space left on "
                              f"device); {kept}: free space there or use another --out, then resume") from error
    r, _, cause = failed[0]
    raise CheckpointError(f"checkpoint {final} could not be written (rank {r}: {cause}); {kept}: fix the cause "
                          "and resume") from error


def _failures(error: BaseException | None) -> list[tuple[int, bool, str]]:
    """Every rank's (rank, disk full, cause) of a part that failed there, on every rank."""
    mine = None if error is None else (_origin(error), _disk_full(error), _cause(error))
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine, group=cpu_group())
    return [r for r in rows if r is not None]


def _disk_full(e: BaseException | None, depth: int = 0) -> bool:
    """Whether ``e`` (or what it wraps: DCP's per-rank failures, causes) is an OSError ENOSPC."""
    from torch.distributed.checkpoint.api import CheckpointException

    if e is None or depth > 8:
        return False
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    if isinstance(e, CheckpointException):
        return any(_disk_full(f[0] if isinstance(f, tuple) else f, depth + 1) for f in e.failures.values())
    return _disk_full(e.__cause__ or e.__context__, depth + 1)


def _origin(e: BaseException) -> int:
    """The rank an error comes from: DCP hands every rank the same CheckpointException of the ranks that failed."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:
        return int(next(iter(e.failures)))
    return dist.get_rank()


def _cause(e: BaseException) -> str:
    """A one-line account of ``e``: DCP's CheckpointException holds every rank's traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:
        inner = next(iter(e.failures.values()))
        e = inner[0] if isinstance(inner, tuple) else inner
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1][:300]}" if lines else type(e).__name__


def _stored_files(folder: Path) -> list[str]:
    """The files of a checkpoint folder a manifest lists: all but the manifest, sorted."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)


def _checksums(folder: Path, names: list[str] | None = None, hashed: dict[str, str] | None = None) -> dict[str, str]:
    """sha256 of the files in ``folder`` (default: all but the manifest), each rank hashing a share.

    Rank 0 lists the folder and broadcasts the names, so every rank agrees on the shares; all ranks
    call it and get the whole table. ``hashed``: this rank's files it hashed already (a background write's);
    the ranks' tables are gathered and only files none of them hashed are read.
    """
    if hashed is not None and dist.is_initialized():
        tables: list = [None] * dist.get_world_size()
        dist.all_gather_object(tables, hashed, group=cpu_group())
        known = {k: v for t in tables for k, v in t.items()}
        box = [[n for n in _stored_files(folder) if n not in known] if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0, group=cpu_group())
        rest = _checksums(folder, box[0]) if box[0] else {}
        return dict(sorted({**known, **rest}.items()))
    if not dist.is_initialized():  # one process (flexmesh export): hash everything here
        names = names if names is not None else _stored_files(folder)
        return hash_files(folder, names)
    if names is None and dist.get_rank() == 0:
        names = _stored_files(folder)
    box = [names if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=cpu_group())
    rank, world = dist.get_rank(), dist.get_world_size()
    every = box[0]
    assert every is not None  # rank 0's list, broadcast
    mine = hash_files(folder, [n for i, n in enumerate(every) if i % world == rank])
    parts: list = [None] * world
    dist.all_gather_object(parts, mine, group=cpu_group())
    return {k: v for p in parts for k, v in sorted(p.items())}


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest finished checkpoint under ``root``, or None when there is none yet."""
    root = Path(root)
    pointer = root / "latest"
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8", errors="replace").strip()  # garbage is refused below
        path = root / name
        # Only a step folder of this run: a planted pointer must not lead a resume elsewhere.
        if not STEP_DIR.fullmatch(name) or path.is_symlink():
            raise CheckpointError(f"{pointer} names {name[:80]!r}, which is not a step_NNNNNN folder of this run; "
                                  f"delete {pointer} (the newest finished checkpoint is then used) or fix it")
        if not (path / MANIFEST).is_file():
            raise CheckpointError(f"{pointer} names {path.name}, which has no {MANIFEST}; the checkpoint is "
                                  f"incomplete or was moved: delete {pointer} to start over or restore the folder")
        return path
    done = sorted(p for p in root.glob("step_*") if STEP_DIR.fullmatch(p.name) and not p.is_symlink()
                  and (p / MANIFEST).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def manifest_step(manifest: dict) -> int:
    """The manifest's step: a whole number >= 0 (ValueError otherwise, the caller's "corrupt")."""
    step = manifest["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step {step!r} is not a whole number >= 0")
    return step


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; check the path or start over (--no-resume)")
    f = path / MANIFEST
    if not f.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete (a crash while saving?) or "
                              "not a flexmesh checkpoint; delete it or resume from an earlier one")
    try:
        manifest = load_json(f, CheckpointError)
        manifest_step(manifest), manifest["plan_hash"]
    except (CheckpointError, KeyError, TypeError, ValueError) as e:
        why = str(e).removeprefix(f"{f}: ")
        raise CheckpointError(f"{f} is corrupt ({why}); delete the checkpoint or resume from an earlier one") from None
    return manifest


def manifest_tasks(manifest: dict, path: Path) -> TaskSet | None:
    """The LoRA tasks a checkpoint's manifest records (None: a run without tasks)."""
    if "tasks" not in manifest:
        return None
    try:
        return TaskSet(tuple(Task.from_dict(t) for t in manifest["tasks"]))
    except (TypeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: its manifest's tasks are corrupt ({e})") from None


def part_entries(trainer) -> dict:  # noqa: ANN001 - a flexmesh.runtime.train.trainer.Trainer
    """What the run's parts record in a manifest (flexmesh.runtime.train.parts.TrainingPart.manifest):
    ``tasks`` for LoRA tasks, ``expert_layout`` for experts loaded from Hugging Face weights."""
    return {key: value for part in trainer.parts for key, value in part.manifest().items()}


def check_tasks(manifest: dict, tasks: TaskSet | None, path: Path) -> None:
    """Refuse to resume adapters of other tasks, ranks or targets (slot by slot) than the job file's."""
    held = manifest_tasks(manifest, path)
    if (held.adapters() if held else None) != (tasks.adapters() if tasks else None):
        have = ", ".join(f"{n} (rank {r})" for n, r, _ in held.adapters()) if held else "no LoRA tasks"
        raise CheckpointError(f"checkpoint {path} holds {have}; this run's job file differs in its tasks, ranks "
                              "or targets: resume with the job file the run started with, or start a new --out")


def load_checkpoint(path: str | Path, trainer, reshard: bool = False) -> dict:
    """Restore ``trainer`` from checkpoint folder ``path``; returns the loader state. All ranks call it.

    ``reshard``: the checkpoint may come from another plan of the same world size (a migration,
    flexmesh.commands.migrate): DCP reads each parameter and AdamW state by its name into whatever
    shards this plan holds; the rank files (RNG, LR scheduler, loader position) follow global ranks.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    manifest = read_manifest(path)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {manifest.get('format')}, this flexmesh reads {FORMAT}")
    if manifest["plan_hash"] != plan_hash(trainer.plan) and not reshard:
        raise CheckpointError(
            f"checkpoint {path} was written under plan {manifest.get('plan_layout')!r} (hash {manifest['plan_hash']}) "
            f"but this run uses {trainer.plan.layout!r} (hash {plan_hash(trainer.plan)}); resume with the same plan "
            "file, or start a new output folder")
    check_tasks(manifest, manifest_tasks(part_entries(trainer), path), path)
    if manifest.get("world_size") != dist.get_world_size():
        raise CheckpointError(f"checkpoint {path} was written by {manifest.get('world_size')} ranks, this run has "
                              f"{dist.get_world_size()}; launch the same number of ranks")
    rank_file = path / f"rank_{dist.get_rank():05d}.pt"
    if not rank_file.is_file():
        raise CheckpointError(f"checkpoint {path} lacks {rank_file.name}; it is incomplete: resume from an earlier one")
    metadata = verify_checkpoint(path, manifest)
    model_sd, optim_sd = _state_dicts(trainer, saving=False)
    state = {"model": model_sd, "optim": optim_sd}
    error: BaseException | None = None
    try:
        # the metadata as read through the allow-list, storage files checked, bytes read weights-only
        dcp.load(state, storage_reader=guarded_reader(path, metadata, CheckpointError),
                 planner=bytes_loading_planner())
        extra = torch.load(rank_file, weights_only=True)  # tensors, lists and numbers only: no code runs
    # DCP gathers every rank's read errors into a CheckpointException (a BaseException) on all ranks;
    # a rank file only one rank reads is agreed on, or the others would train on and then hang.
    except (Exception, CheckpointException) as e:
        error = e
    failed = _failures(error)
    if failed:
        r, _, cause = failed[0]
        raise CheckpointError(f"checkpoint {path} could not be read (rank {r}: {cause}); it is corrupt: delete it "
                              "or resume from an earlier one") from error
    trainer.load_checkpoint_state(state["model"], state["optim"], _state_options())
    trainer.lr_scheduler.load_state_dict(extra["scheduler"])  # the LR scheduler (key kept from older files)
    trainer.step_index = int(extra["step_index"])
    states = extra.get("parts") or [{}] * len(trainer.parts)
    if len(states) != len(trainer.parts):
        raise CheckpointError(f"checkpoint {path} was made by a run of other features (tasks, experts, domains) than "
                              "this one; resume with the flags the run started with")
    for part, state in zip(trainer.parts, states, strict=True):
        if state:  # a part that carries nothing, or a checkpoint from before parts carried state, has none
            part.load_state(state)
    _set_rng_state(extra["rng"])
    return extra["loader"]


def verify_checkpoint(path: Path, manifest: dict) -> Any:
    """Every check a reader of checkpoint ``path`` needs before reading it (resume and export alike):
    each file against the manifest's sha256 (:func:`_verify`), and DCP's ``.metadata`` read without
    running code (:func:`read_metadata`); returns that metadata."""
    _verify(path, manifest)
    return read_metadata(path)


# What DCP's .metadata pickle may name: exactly the classes torch 2.x writes there (found by listing
# the GLOBAL opcodes of the .metadata files DCP writes; tests/test_dcp_metadata.py redoes this), each a
# plain data class whose construction runs no code of the file's choosing, plus torch's dtypes (by
# name, checked to be a dtype) and its layout lookup. Never a whole module: a module's namespace
# reaches further (``torch.distributed.checkpoint.filesystem.os.system`` is a dotted name in it).
_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
})


def metadata_global_allowed(module: str, name: str) -> bool:
    """Whether DCP's ``.metadata`` may name ``module.name``: one of :data:`_METADATA_GLOBALS`, or a
    torch dtype (``torch.float32``); a dotted name never."""
    if (module, name) in _METADATA_GLOBALS:
        return True
    if module != "torch" or not name.isidentifier():
        return False
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


def read_metadata(path: Path) -> Any:
    """DCP's ``.metadata`` of checkpoint ``path``, unpickled with only the classes DCP writes allowed
    (:func:`metadata_global_allowed`: DCP's metadata dataclasses, torch dtypes, sizes and layouts);
    CheckpointError for anything else, before any of it is called."""
    import pickle

    class Refused(pickle.UnpicklingError):
        """A global the allow-list does not hold (a truncated pickle is another UnpicklingError)."""

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if not metadata_global_allowed(module, name):
                raise Refused(f"{module}.{name}")
            return super().find_class(module, name)

    try:
        # a regular file only, bounded: a fifo planted as .metadata is refused, not waited on
        raw = read_bytes(path / ".metadata", CheckpointError, limit=1 << 30)
        return Restricted(io.BytesIO(raw)).load()
    except CheckpointError:
        raise
    except Refused as e:
        raise CheckpointError(f"checkpoint {path}: .metadata names {e}, which a DCP checkpoint never holds (a pickle "
                              "made to run code?); delete the checkpoint, do not load it") from None
    except Exception as e:  # truncated or foreign files raise EOF, OS or attribute errors
        raise CheckpointError(f"checkpoint {path}: .metadata cannot be read ({type(e).__name__}: {e}); it is corrupt: "
                              "delete it or use an earlier checkpoint") from None


def _verify(path: Path, manifest: dict) -> None:
    """Check every file of checkpoint ``path`` against the manifest's sha256; all ranks call it and
    raise the same CheckpointError naming the bad files (each rank hashes a share)."""
    sums = manifest.get("sha256")
    if not isinstance(sums, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items()):
        raise CheckpointError(f"{path / MANIFEST} has no valid sha256 table; the checkpoint is corrupt: delete it "
                              "or resume from an earlier one")
    odd = [n for n in sums if n in ("", ".", "..") or "/" in n or "\\" in n]
    if odd:  # names are of files inside the folder, never paths
        raise CheckpointError(f"{path / MANIFEST} names {odd[0]!r}, not a file of the checkpoint; it is corrupt or "
                              "was tampered with: delete it or resume from an earlier one")
    # every checkpoint hashes DCP's .metadata and each shard it wrote: a table without them checks nothing
    unlisted = [".metadata"] * (".metadata" not in sums) + sorted(
        p.name for p in path.glob("*.distcp") if p.name not in sums)
    if unlisted:
        raise CheckpointError(f"{path / MANIFEST}'s sha256 table does not list {unlisted[0]}; the checkpoint is "
                              "corrupt or was tampered with: delete it or resume from an earlier one")
    found = _checksums(path, sorted(sums))
    bad = [n for n in sorted(sums) if found.get(n) != sums[n]]
    if bad:
        what = "is missing" if found.get(bad[0]) == "missing" else "does not match its sha256 in the manifest"
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(f"checkpoint file {path / bad[0]} {what}{more}; the checkpoint is corrupt: delete "
                              "it or resume from an earlier one")
