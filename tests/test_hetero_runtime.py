"""Heterogeneous plans on torch.distributed give the single-process losses, gradients and parameters.

Replicas that differ in stage boundaries, micro-batch counts and batch shares, and tensor-parallel
degree run under one torchrun (gloo, CPU, fp32) per world size; this file is also the worker
(``python tests/test_hetero_runtime.py worker OUT NAME...``). The reference is a plain PyTorch loop
in the test process over the same documents and micro-batches (flexmesh.runtime.reference).
Every replica saves its own copy of the parameters, so replicas that drifted apart fail too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import SEED, STEPS, flexmesh, launch, reference_training, tiny_spec, train_config, write_inputs


def _stage(a: int, b: int, *devices: int, recompute: str = "none") -> dict:
    return {"layers": [a, b], "devices": list(devices), "recompute": recompute}


# name -> (world, replicas, unused). The tiny model has 4 layers.
PLANS: dict[str, tuple[int, list[dict], list[int]]] = {
    # (1) different stage boundaries: all four layers on one rank vs split at layer 1 over two (whose
    # one micro-batch 1F1B pads with an empty one)
    "boundaries": (3, [{"batch": 4, "num_microbatches": 2, "stages": [_stage(0, 4, 0)]},
                       {"batch": 4, "num_microbatches": 1, "stages": [_stage(0, 1, 1), _stage(1, 4, 2)]}], []),
    # (2) different micro-batch counts and batch shares (6 of 8 documents in 3 micro-batches vs 2 in 2)
    "shares": (3, [{"batch": 6, "num_microbatches": 3, "stages": [_stage(0, 4, 0, recompute="full")]},
                   {"batch": 2, "num_microbatches": 2, "stages": [_stage(0, 2, 1), _stage(2, 4, 2)]}], []),
    # (3) tp 2 in one replica, tp 1 in the other
    "tp": (3, [{"batch": 4, "num_microbatches": 2, "stages": [_stage(0, 4, 0, 1)]},
               {"batch": 4, "num_microbatches": 1, "stages": [_stage(0, 4, 2)]}], []),
    # tp 2 against a pipeline whose stages sit on falling ranks (stage 0 on rank 3), gpipe
    "tp_vs_pp": (4, [{"batch": 4, "num_microbatches": 2, "stages": [_stage(0, 4, 0, 1, recompute="selective")]},
                     {"batch": 4, "num_microbatches": 2, "stages": [_stage(0, 3, 3), _stage(3, 4, 2)]}], []),
    # a device left unused, a pipeline from rank 2 to rank 0, one micro-batch per document
    "unused": (4, [{"batch": 2, "num_microbatches": 1, "stages": [_stage(0, 4, 3)]},
                   {"batch": 3, "num_microbatches": 3, "stages": [_stage(0, 2, 2), _stage(2, 4, 0)]}], [1]),
}
SCHEDULES = {"tp_vs_pp": "gpipe"}


def plan_dict(name: str, model: str = "test-tiny") -> dict:
    world, replicas, unused = PLANS[name]
    return {"version": 3, "model": model, "cluster": "cpu", "world_size": world, "seq_len": 64,
            "global_batch": sum(r["batch"] for r in replicas), "pipeline_schedule": SCHEDULES.get(name, "1f1b"),
            "replicas": replicas, "unused": unused}


def make_plan(name: str):
    from flexmesh.layout.hetero import HeteroPlan

    return HeteroPlan.from_dict(plan_dict(name))


def make_steps(plan, steps: int = STEPS) -> list:
    """Random documents (3 to 40 tokens) of the plan's global batch, scheduled as the runtime does."""
    from flexmesh.runtime.hetero import hetero_schedule

    rng = np.random.default_rng(SEED)
    schedule = hetero_schedule(plan)
    out = []
    for _ in range(steps):
        docs = [rng.integers(1, 256, size=int(n)) for n in rng.integers(3, 40, size=plan.global_batch)]
        out.append((docs, schedule([len(d) for d in docs])))
    return out


# ---- reference ------------------------------------------------------------------------------------
def reference(steps: list) -> tuple[list[float], dict, dict]:
    """Losses, parameters after the last step and (clipped) gradients of the first step, one process."""
    losses, _, grads, params = reference_training(steps)
    return losses, params, grads

# ---- worker ---------------------------------------------------------------------------------------
def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def worker(out: Path, names: list[str]) -> None:
    """Run each named plan for STEPS steps; each stage's first rank saves its full parameters and the
    first step's gradients (per replica and stage)."""
    import torch
    import torch.distributed as dist

    from flexmesh.runtime.distributed import init_distributed
    from flexmesh.runtime.hetero import HeteroTrainer
    from flexmesh.runtime.weights import canonical_name

    torch.set_num_threads(1)
    init_distributed(timeout_s=60)
    try:
        for name in names:
            plan = make_plan(name)
            trainer = HeteroTrainer(plan, tiny_spec(), train_config())
            losses, grads = [], {}
            for i, (docs, sched) in enumerate(make_steps(plan)):
                losses.append(trainer.step(docs, sched).loss)
                if i == 0 and trainer.model is not None:
                    grads = {canonical_name(k): _full(p.grad) for k, p in trainer.model.named_parameters()}
            params = {canonical_name(k): _full(v) for k, v in trainer.model.state_dict().items()} \
                if trainer.model is not None else {}
            folder = out / name
            place = trainer.place
            if place is not None and place.tp_index == 0:
                folder.mkdir(parents=True, exist_ok=True)
                torch.save({"params": params, "grads": grads}, folder / f"r{place.replica}_s{place.stage}.pt")
            dist.barrier()
            if dist.get_rank() == 0:
                (folder / "result.json").write_text(json.dumps({"losses": losses}))
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()


# ---- tests ----------------------------------------------------------------------------------------
def _run(tmp: Path, world: int, names: list[str]) -> None:
    proc = launch(world, ["worker", str(tmp), *names], script=__file__)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")


def _check(name: str, folder: Path) -> None:
    import torch

    plan = make_plan(name)
    ref_losses, ref_params, ref_grads = reference(make_steps(plan))
    losses = json.loads((folder / "result.json").read_text())["losses"]
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"{name} step {step + 1}: loss {got} vs reference {want}"
    first: dict = {}  # replica 0's parameters: every replica must hold the very same bits
    for i, r in enumerate(plan.replicas):
        seen: set = set()
        for k in range(r.pp):
            saved = torch.load(folder / f"r{i}_s{k}.pt")
            seen |= set(saved["params"])
            for key, p in saved["params"].items():
                assert torch.equal(first.setdefault(key, p), p), f"{name}: replica {i} drifted from replica 0 at {key}"
            for key, g in saved["grads"].items():
                want = ref_grads[key]
                scale = want.abs().max().item()
                diff = (g - want).abs().max().item()
                assert diff <= 1e-5 * scale + 1e-9, f"{name} replica {i}: gradient of {key} off by {diff} ({scale})"
            for key, p in saved["params"].items():
                diff = (p - ref_params[key]).abs().max().item()
                assert diff <= 1e-4, f"{name} replica {i}: {key} differs from the reference by {diff}"
        assert seen == set(ref_params), f"{name} replica {i} holds {sorted(seen ^ set(ref_params))} wrongly"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [3, 4])
def test_hetero_plans_match_single_process(tmp_path, world):
    """Every plan of this world size, under one torchrun to pay start-up once."""
    names = [n for n, (w, _, _) in PLANS.items() if w == world]
    _run(tmp_path, world, names)
    for name in names:
        _check(name, tmp_path / name)


def test_schedule_splits_contiguously_in_replica_order():
    plan = make_plan("shares")
    (docs, schedule), = make_steps(plan, steps=1)
    ids = [[[p.seq_id for p in mb] for mb in g.microbatches] for g in schedule.groups]
    assert ids == [[[0, 1], [2, 3], [4, 5]], [[6], [7]]]
    schedule.validate(len(plan.replicas))


# ---- `flexmesh train` ------------------------------------------------------------------------------
def _cli_plan(tmp: Path, **change) -> Path:
    """A heterogeneous plan for write_inputs' 2-layer model on 3 ranks: tp 2 on ranks 0-1, rank 2 alone."""
    cfg, corpus, _ = write_inputs(tmp, world=3) if not (tmp / "config.json").exists() else (tmp / "config.json",
                                                                                              None, None)
    d = {"version": 3, "model": str(cfg), "cluster": "cpu", "world_size": 3, "seq_len": 128, "global_batch": 4,
         "pipeline_schedule": "1f1b", "unused": [],
         "replicas": [{"batch": 2, "num_microbatches": 1, "stages": [_stage(0, 2, 0, 1)]},
                      {"batch": 2, "num_microbatches": 2, "stages": [_stage(0, 2, 2)]}]}
    d.update(change)
    path = tmp / f"hetero{len(list(tmp.glob('hetero*.json')))}.json"
    path.write_text(json.dumps(d))
    return path


BAD_PLANS = {  # what is wrong -> (plan fields changed, words the one-line error must hold)
    "device missing": ({"world_size": 4}, "not placed: [3]"),
    "batch sum wrong": ({"global_batch": 5}, "replica batches sum to 4, not the global batch 5"),
    "tp mixed in a replica": ({"replicas": [{"batch": 4, "num_microbatches": 2,
                                             "stages": [_stage(0, 1, 0, 1), _stage(1, 2, 2)]}]},
                              "mixes tp degrees"),
}


# A bad plan file fails in the launcher too, before any rank starts; a replica mixing tp degrees is
# found once the model is known (in the ranks), so it is checked in a single process only.
@pytest.mark.parametrize(("bad", "nproc"), [(b, n) for b in sorted(BAD_PLANS) for n in (None, "3")
                                            if not (b == "tp mixed in a replica" and n)])
def test_bad_hetero_plan_is_one_line_error(tmp_path, bad, nproc):
    change, words = BAD_PLANS[bad]
    plan = _cli_plan(tmp_path, **change)
    launch_flags = ["--nproc", nproc] if nproc else []
    proc = flexmesh("train", *launch_flags, "--plan", str(plan), "--corpus", str(tmp_path / "corpus"), "--max-steps",
                    "1", "--out", str(tmp_path / "run"), "--no-progress", timeout=120)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err and err.count("error:") == 1, err[-3000:]  # one message (rich may wrap it)
    assert err.startswith("error:") and words in " ".join(err.split()), err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_train_hetero_plan_resumes_exactly(tmp_path):
    """`flexmesh train --nproc 3` on a heterogeneous plan: metrics.jsonl, a checkpoint, and a resume
    whose third step has the loss of an uninterrupted three-step run (1e-5)."""
    plan = _cli_plan(tmp_path)

    def train(out: str, steps: int) -> list[dict]:
        proc = flexmesh("train", "--nproc", "3", "--plan", str(plan), "--corpus", str(tmp_path / "corpus"),
                        "--out", str(tmp_path / out), "--cache-dir", str(tmp_path / "cache"), "--checkpoint-every",
                        "2", "--no-progress", "--lr", "1e-3", "--max-steps", str(steps),
                        "--min-lr-ratio", "1", timeout=300)  # a flat LR: the same whatever --max-steps
        assert proc.returncode == 0, proc.stderr[-4000:]
        return [json.loads(x) for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]

    first = train("run", 2)
    assert [r["step"] for r in first] == [1, 2]
    assert all(r["loss"] > 0 and r["tokens"] > 0 and r["tokens_per_s"] > 0 and len(r["busy_s"]) == 3 for r in first)
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "manifest.json").is_file()
    resumed = train("run", 3)
    assert [r["step"] for r in resumed] == [1, 2, 3] and resumed[:2] == first
    whole = train("whole", 3)
    for a, b in zip(whole, resumed, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a["step"], a["loss"], b["loss"])
    # the checkpoint holds every weight once, under the model's names: it exports like a uniform run's
    export = flexmesh("export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--plan",
                      str(plan), timeout=120)
    assert export.returncode == 0, export.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file() and list((tmp_path / "hf").glob("*.safetensors"))


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    worker(Path(sys.argv[2]), sys.argv[3:])
