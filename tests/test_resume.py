"""Checkpoint/resume: 6 steps straight equal 3 steps + resume + 3 steps; broken checkpoints fail clearly.

One torchrun launch (world 2, gloo, ZeRO-3 with recomputation on some layers) runs every
multi-process scenario and writes what it saw; the tests read it. This file is also the worker.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import launch, make_steps, tiny_spec, train_config

STRATEGIES = ["tp1-dp2z3", "tp1-dp2z3-ac", "tp1-dp2z2", "tp1-dp2z3"]


def make_plan(world: int = 2):
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    st = StagePlan(0, 4, tuple(LayerStrategy.parse(s) for s in STRATEGIES))
    if world != 2:
        st = StagePlan(0, 4, tuple(LayerStrategy.parse(s.replace("dp2", f"dp{world}")) for s in STRATEGIES))
    return Plan.uniform(model="test-tiny", cluster="cpu", world_size=world, pp=1, pipeline_schedule="1f1b",
                        num_microbatches=1,
                        seq_len=256, global_batch=8, stages=(st,))


def worker(out: Path) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from flexmesh.errors import FlexmeshError
    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.loop import ListSource, fit
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=60)
    steps = make_steps(2, 1, steps=6, seed=11)
    base = dataclasses.replace(train_config(), max_steps=6, warmup_steps=2, checkpoint_every=3)
    report: dict = {}

    def losses(folder: Path) -> list[float]:
        return [json.loads(ln)["loss"] for ln in (folder / "metrics.jsonl").read_text().splitlines()]

    def expect_error(name: str, fn) -> None:
        try:
            fn()
            report[name] = None
        except FlexmeshError as e:
            report[name] = f"{type(e).__name__}: {e}"

    try:
        straight = out / "straight"
        fit(Trainer(make_plan(), tiny_spec(), base), ListSource(steps),
            dataclasses.replace(base, out_dir=str(straight)))
        report["straight"] = losses(straight)

        resumed = out / "resumed"
        cfg = dataclasses.replace(base, out_dir=str(resumed))
        fit(Trainer(make_plan(), tiny_spec(), cfg), ListSource(steps[:3]), cfg)  # "crashes" after 3
        report["first_half"] = losses(resumed)
        fit(Trainer(make_plan(), tiny_spec(), cfg), ListSource(steps), cfg)
        report["resumed"] = losses(resumed)

        from flexmesh.runtime.state.checkpoint import load_checkpoint

        ckpt = resumed / "checkpoints" / "step_000003"
        trainer = Trainer(make_plan(), tiny_spec(), cfg)
        expect_error("missing", lambda: load_checkpoint(out / "nowhere", trainer))
        other = Trainer(make_plan(), tiny_spec(), dataclasses.replace(cfg, lr=2e-3))
        other.plan = dataclasses.replace(other.plan, seq_len=512)  # another plan, same shapes
        expect_error("other_plan", lambda: load_checkpoint(ckpt, other))
        dist.barrier()
        if dist.get_rank() == 0:  # corrupt one shard file of the DCP payload
            shard = sorted(ckpt.glob("*.distcp"))[0]
            shard.write_bytes(shard.read_bytes()[:40])
        dist.barrier()
        expect_error("corrupt", lambda: load_checkpoint(ckpt, trainer))
        expect_error("world", lambda: Trainer(make_plan(world=4), tiny_spec(), cfg))
        if dist.get_rank() == 0:
            (out / "report.json").write_text(json.dumps(report))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("resume")
    proc = launch(2, ["worker", str(tmp)], script=__file__)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads((tmp / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_gives_the_same_losses(report):
    assert len(report["straight"]) == 6
    assert report["first_half"] == report["straight"][:3]  # exact: the same first steps
    assert report["resumed"] == report["straight"]  # exact: same ops, same order, restored state


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bad_checkpoints_and_launches_fail_clearly(report):
    assert report["missing"].startswith("CheckpointError") and "does not exist" in report["missing"]
    assert report["other_plan"].startswith("CheckpointError") and "same plan" in report["other_plan"]
    assert report["corrupt"].startswith("CheckpointError") and "corrupt" in report["corrupt"]
    assert report["world"].startswith("PlanError") and "--nproc-per-node 4" in report["world"]


def test_incomplete_checkpoints_are_never_picked(tmp_path):
    from flexmesh.errors import CheckpointError
    from flexmesh.runtime.state.checkpoint import latest_checkpoint, read_manifest

    assert latest_checkpoint(tmp_path) is None
    (tmp_path / ".tmp-step_000009").mkdir()  # a crash while saving
    (tmp_path / "step_000004").mkdir()  # no manifest: never finished
    assert latest_checkpoint(tmp_path) is None
    done = tmp_path / "step_000002"
    done.mkdir()
    (done / "manifest.json").write_text(json.dumps({"format": 1, "step": 2, "plan_hash": "x"}))
    assert latest_checkpoint(tmp_path) == done
    with pytest.raises(CheckpointError, match="incomplete"):
        read_manifest(tmp_path / "step_000004")
    (done / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        read_manifest(done)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    worker(Path(sys.argv[2]))
