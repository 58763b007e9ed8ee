"""Training checkpoints: torch.distributed.checkpoint (DCP) written atomically, resumed exactly.

Layout of ``<out>/checkpoints/``::

    step_000006/             one finished checkpoint
        manifest.json        step, plan hash, world size, format; written last
        .metadata, *.distcp  DCP: model and optimizer shards (each rank writes its own)
        rank_00000.pt ...    per-rank RNG states, LR scheduler and loader position
    latest                   the name of the newest finished checkpoint

Atomicity: every rank writes into ``.tmp-step_000006``; after a barrier rank 0 adds the manifest,
renames the folder (a single ``os.replace``) and rewrites ``latest`` atomically. A crash at any
point leaves either the previous checkpoint or a ``.tmp-*`` folder that is never read.

Exact resume restores model, optimizer (AdamW moments and step), LR scheduler, RNG states and the
data loader's position. Resuming needs the same plan (same hash): the per-rank files follow ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from flexmesh.errors import CheckpointError
from flexmesh.files import write_atomic
from flexmesh.layout.plan import Plan

FORMAT = 1
MANIFEST = "manifest.json"


def plan_hash(plan: Plan) -> str:
    """Hash of the plan's layout (predicted figures excluded: they do not change what runs)."""
    d = plan.to_dict()
    d.pop("predicted", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(root: str | Path, step: int, trainer, loader_state: dict) -> Path:
    """Write checkpoint ``step`` of ``trainer`` (a flexmesh.runtime.trainer.Trainer); all ranks call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(trainer.state_module(), trainer.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    # The LR scheduler's state stays under the key "scheduler": checkpoints already on disk use it.
    torch.save({"rng": _rng_state(), "scheduler": trainer.lr_scheduler.state_dict(), "loader": loader_state,
                "step_index": trainer.step_index}, tmp / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        manifest = {"format": FORMAT, "step": step, "plan_hash": plan_hash(trainer.plan),
                    "plan_layout": trainer.plan.layout, "world_size": dist.get_world_size()}
        write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomic(root / "latest", final.name + "\n")
    dist.barrier()
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest finished checkpoint under ``root``, or None when there is none yet."""
    root = Path(root)
    pointer = root / "latest"
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if not (path / MANIFEST).is_file():
            raise CheckpointError(f"{pointer} names {path.name}, which has no {MANIFEST}; the checkpoint is "
                                  f"incomplete or was moved: delete {pointer} to start over or restore the folder")
        return path
    done = sorted(p for p in root.glob("step_*") if (p / MANIFEST).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; check the path or drop --resume")
    f = path / MANIFEST
    if not f.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete (a crash while saving?) or "
                              "not a flexmesh checkpoint; delete it or resume from an earlier one")
    try:
        manifest = json.loads(f.read_text())
        int(manifest["step"]), manifest["plan_hash"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{f} is corrupt ({e}); delete the checkpoint or resume from an earlier one") from e
    return manifest


def load_checkpoint(path: str | Path, trainer) -> dict:
    """Restore ``trainer`` from checkpoint folder ``path``; returns the loader state. All ranks call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    manifest = read_manifest(path)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {manifest.get('format')}, this flexmesh reads {FORMAT}")
    if manifest["plan_hash"] != plan_hash(trainer.plan):
        raise CheckpointError(
            f"checkpoint {path} was written under plan {manifest.get('plan_layout')!r} (hash {manifest['plan_hash']}) "
            f"but this run uses {trainer.plan.layout!r} (hash {plan_hash(trainer.plan)}); resume with the same plan "
            "file, or start a new output folder")
    if manifest.get("world_size") != dist.get_world_size():
        raise CheckpointError(f"checkpoint {path} was written by {manifest.get('world_size')} ranks, this run has "
                              f"{dist.get_world_size()}; launch the same number of ranks")
    rank_file = path / f"rank_{dist.get_rank():05d}.pt"
    if not rank_file.is_file():
        raise CheckpointError(f"checkpoint {path} lacks {rank_file.name}; it is incomplete: resume from an earlier one")
    model_sd, optim_sd = get_state_dict(trainer.state_module(), trainer.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, checkpoint_id=str(path))
        extra = torch.load(rank_file, weights_only=False)
    # DCP gathers every rank's read errors into a CheckpointException (a BaseException) on all ranks
    except (Exception, CheckpointException) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        cause = lines[-1][:300] if lines else type(e).__name__
        raise CheckpointError(f"checkpoint {path} could not be read ({cause}); it is corrupt: delete it or resume "
                              "from an earlier one") from e
    set_state_dict(trainer.state_module(), trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    trainer.lr_scheduler.load_state_dict(extra["scheduler"])  # the LR scheduler (key kept from older files)
    trainer.step_index = int(extra["step_index"])
    _set_rng_state(extra["rng"])
    return extra["loader"]
