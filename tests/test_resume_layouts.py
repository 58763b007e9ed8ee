"""Resume for every layout, pipelines included, and checkpoints that are damaged, planted or cut short
by a full disk.

Pipelines: 6 steps straight equal 3 steps + resume + 3 steps for pp 2 with 1F1B and interleaved
(world 2) and for pp 2 x dp 2 (world 4); before checkpoints kept optimizer groups per parameter,
every pp > 1 resume failed with KeyError 'lr'. The world-2 launch then damages its checkpoints: a
flipped byte in a shard (the sha256 check names the file), a rank file holding a pickle that would
run code (refused by ``weights_only=True`` even with the manifest rewritten to match), and a disk
that fills up on one rank while saving (every rank reports "disk full", the previous checkpoint
stays usable). This file is also the worker.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import launch, make_steps, tiny_spec, train_config

LAYOUTS: dict[str, dict] = {
    "pp_1f1b": dict(world=2, schedule="1f1b", v=1, layers=[[0, 3], [3, 4]], strategy="tp1-dp1z0"),
    "pp_interleaved": dict(world=2, schedule="interleaved", v=2, layers=[[0, 1], [1, 2], [2, 3], [3, 4]],
                           strategy="tp1-dp1z0"),
    "pp_x_dp": dict(world=4, schedule="1f1b", v=1, layers=[[0, 2], [2, 4]], strategy="tp1-dp2z2"),
}


def make_plan(name: str):
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    cfg = LAYOUTS[name]
    st = LayerStrategy.parse(cfg["strategy"])
    stages = tuple(StagePlan(a, b, (st,) * (b - a)) for a, b in cfg["layers"])
    return Plan.uniform(model="test-tiny", cluster="cpu", world_size=cfg["world"], pp=2,
                        pipeline_schedule=cfg["schedule"],
                        virtual_stages=cfg["v"], num_microbatches=1, seq_len=256, global_batch=8, stages=stages)


class _Planted:
    """A pickle that runs a shell command when loaded without ``weights_only``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def worker(out: Path, names: list[str]) -> None:
    import dataclasses
    import errno

    import torch
    import torch.distributed as dist

    from flexmesh.errors import FlexmeshError
    from flexmesh.layout.step import carries_pieces
    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.loop import ListSource, fit
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=60)
    rank = dist.get_rank()
    report: dict = {}

    def losses(folder: Path) -> list[float]:
        return [json.loads(ln)["loss"] for ln in (folder / "metrics.jsonl").read_text().splitlines()]

    def expect_error(key: str, fn) -> None:
        try:
            fn()
            report[key] = None
        except FlexmeshError as e:
            report[key] = f"{type(e).__name__}: {e}"

    import flexmesh.runtime.train.loop as loop

    in_background: list[int] = []  # the steps the loop checkpointed in a thread
    start = loop.start_checkpoint

    def spy(root, step, trainer, loader_state, background=None):
        in_background.extend([step] if background is not None else [])
        return start(root, step, trainer, loader_state, background)

    loop.start_checkpoint = spy
    try:
        for name in names:
            in_background.clear()
            # pp_1f1b checkpoints as it trains; the others write step 3's in the background (--async-checkpoint)
            base = dataclasses.replace(train_config(), max_steps=6, warmup_steps=2, checkpoint_every=3,
                                       async_checkpoint=name != "pp_1f1b")
            plan = make_plan(name)
            straight = out / name / "straight"
            trainer = Trainer(plan, tiny_spec(), base)
            steps = make_steps(trainer.layout.data_ranks, trainer.layout.cp, steps=6, seed=11,
                               cut=carries_pieces())
            fit(trainer, ListSource(steps), dataclasses.replace(base, out_dir=str(straight)))
            resumed = out / name / "resumed"
            cfg = dataclasses.replace(base, out_dir=str(resumed))
            fit(Trainer(plan, tiny_spec(), cfg), ListSource(steps[:3]), cfg)  # "crashes" after 3
            after_three = (resumed / "checkpoints" / "latest").read_text().strip()
            fit(Trainer(plan, tiny_spec(), cfg), ListSource(steps), cfg)
            report[name] = {"straight": losses(straight), "resumed": losses(resumed), "after_three": after_three,
                            "in_background": sorted(set(in_background))}
        if dist.get_world_size() == 2:
            _damage(out / "pp_1f1b" / "resumed", report, expect_error)
            # A disk that fills up on rank 1 only, in the middle of DCP's shard writes.
            import torch.distributed.checkpoint.filesystem as dcp_fs

            from flexmesh.runtime.state.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

            root = out / "pp_1f1b" / "straight" / "checkpoints"
            trainer = Trainer(make_plan("pp_1f1b"), tiny_spec(), train_config())
            original = dcp_fs._write_item

            def full_disk(*args, **kwargs):
                if rank == 1:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return original(*args, **kwargs)

            dcp_fs._write_item = full_disk
            try:
                expect_error("disk_full", lambda: save_checkpoint(root, 7, trainer, {"position": 7}))
            finally:
                dcp_fs._write_item = original
            dist.barrier()
            report["after_full"] = {"latest": (root / "latest").read_text().strip(),
                                    "left": sorted(p.name for p in root.iterdir())}
            expect_error("previous_loads", lambda: load_checkpoint(latest_checkpoint(root), trainer))
            # A folder of someone else's where the next checkpoint goes: refused, kept as it was.
            foreign = root / "step_000008"
            if rank == 0:
                foreign.mkdir()
                (foreign / "notes.txt").write_text("mine")
            dist.barrier()
            expect_error("in_the_way", lambda: save_checkpoint(root, 8, trainer, {"position": 8}))
            dist.barrier()
            report["foreign"] = {"kept": sorted(p.name for p in foreign.iterdir()),
                                 "latest": (root / "latest").read_text().strip()}
            # Written in the background: published by finish; a disk that fills up on rank 1 in the thread is
            # every rank's CheckpointError at finish, the previous checkpoint kept.
            from flexmesh.runtime.state.checkpoint import start_checkpoint

            group = dist.new_group(backend="gloo")
            pending = start_checkpoint(root, 9, trainer, {"position": 9}, background=group)
            report["async_step"] = pending.step
            pending.finish()
            report["async_latest"] = (root / "latest").read_text().strip()
            sums = json.loads((root / "step_000009" / "manifest.json").read_text())["sha256"]  # hashed as written
            report["async_hashed_all"] = sorted(sums) == sorted(
                p.name for p in (root / "step_000009").iterdir() if p.name != "manifest.json") and len(sums) > 3
            expect_error("async_loads", lambda: load_checkpoint(latest_checkpoint(root), trainer))
            dcp_fs._write_item = full_disk
            try:
                pending = start_checkpoint(root, 10, trainer, {"position": 10}, background=group)
                expect_error("async_disk_full", pending.finish)
            finally:
                dcp_fs._write_item = original
            dist.barrier()
            report["after_async_full"] = {"latest": (root / "latest").read_text().strip(),
                                          "left": sorted(p.name for p in root.iterdir())}
        (out / f"report_{rank}.json").write_text(json.dumps(report))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _damage(run: Path, report: dict, expect_error) -> None:
    """Flip a byte of a shard, then plant a code-running rank file behind a rewritten manifest."""
    import hashlib
    import shutil

    import torch
    import torch.distributed as dist

    from flexmesh.runtime.state.checkpoint import load_checkpoint
    from flexmesh.runtime.train.trainer import Trainer

    ckpt = run / "checkpoints" / "step_000006"
    flipped = run / "checkpoints" / "step_000009"
    planted = run / "checkpoints" / "step_000012"
    marker = run / "planted-code-ran"
    if dist.get_rank() == 0:
        shutil.copytree(ckpt, flipped)
        shard = sorted(flipped.glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: DCP alone would load it without noticing
        shard.write_bytes(bytes(data))
        shutil.copytree(ckpt, planted)
        torch.save({"rng": _Planted(marker)}, planted / "rank_00001.pt")
        manifest = json.loads((planted / "manifest.json").read_text())
        manifest["sha256"]["rank_00001.pt"] = hashlib.sha256((planted / "rank_00001.pt").read_bytes()).hexdigest()
        (planted / "manifest.json").write_text(json.dumps(manifest))
    dist.barrier()
    trainer = Trainer(make_plan("pp_1f1b"), tiny_spec(), train_config())
    expect_error("flipped", lambda: load_checkpoint(flipped, trainer))
    expect_error("planted", lambda: load_checkpoint(planted, trainer))
    dist.barrier()
    report["planted_code_ran"] = marker.exists()


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("resume2"), 2, ["pp_1f1b", "pp_interleaved"])


def _run(tmp: Path, world: int, names: list[str]) -> dict:
    proc = launch(world, ["worker", str(tmp), *names], script=__file__)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {r: json.loads((tmp / f"report_{r}.json").read_text()) for r in range(world)}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["pp_1f1b", "pp_interleaved"])
def test_pipeline_resume_gives_the_same_losses(world2, name):
    got = world2[0][name]
    assert len(got["straight"]) == 6 and got["after_three"] == "step_000003"
    assert got["in_background"] == ([] if name == "pp_1f1b" else [3])  # --async-checkpoint: step 3's in a thread
    assert got["resumed"] == got["straight"]  # exact: same ops, same order, restored state


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_x_data_parallel_resume_gives_the_same_losses(tmp_path):
    got = _run(tmp_path, 4, ["pp_x_dp"])[0]["pp_x_dp"]
    assert len(got["straight"]) == 6 and got["after_three"] == "step_000003" and got["in_background"] == [3]
    assert got["resumed"] == got["straight"]  # exact: the same operations in the same order from the restored state


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_damaged_or_planted_checkpoints_are_refused(world2):
    for rank in (0, 1):
        flipped, planted = world2[rank]["flipped"], world2[rank]["planted"]
        assert flipped.startswith("CheckpointError") and "distcp does not match its sha256" in flipped
        assert planted.startswith("CheckpointError") and "could not be read" in planted
    assert world2[0]["planted_code_ran"] is False


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_full_disk_while_saving_says_so_and_keeps_the_previous_checkpoint(world2):
    for rank in (0, 1):  # rank 0's disk was fine: it must not wait for rank 1, but fail with it
        msg = world2[rank]["disk_full"]
        assert msg.startswith("CheckpointError") and "disk full" in msg and "rank 1" in msg, msg
        assert "step_000006 is intact" in msg and "unexpected pos" not in msg
        assert world2[rank]["previous_loads"] is None
    assert world2[0]["after_full"]["latest"] == "step_000006"
    assert not any(n.startswith(".tmp-") or n == "step_000007" for n in world2[0]["after_full"]["left"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checkpoint_written_in_the_background_is_published_by_finish_and_a_full_disk_there_keeps_the_last(world2):
    assert world2[0]["async_step"] == 9 and world2[0]["async_latest"] == "step_000009"
    assert world2[0]["async_hashed_all"]  # every file in the manifest, each checked again by the load below
    for rank in (0, 1):
        assert world2[rank]["async_loads"] is None
        msg = world2[rank]["async_disk_full"]  # raised by finish, on both ranks
        assert msg.startswith("CheckpointError") and "disk full" in msg and "rank 1" in msg, msg
        assert "step_000009 is intact" in msg
    assert world2[0]["after_async_full"]["latest"] == "step_000009"
    assert not any(n.startswith(".tmp-") or n == "step_000010" for n in world2[0]["after_async_full"]["left"])


def test_a_folder_not_ours_where_the_next_checkpoint_goes_is_refused_and_kept(world2):
    for r in (0, 1):
        assert "is in the way and is not a checkpoint flexmesh wrote" in world2[r]["in_the_way"]
        assert "\n" not in world2[r]["in_the_way"]
    assert world2[0]["foreign"] == {"kept": ["notes.txt"], "latest": "step_000006"}


def test_latest_may_only_name_a_step_folder_of_this_run(tmp_path):
    from flexmesh.errors import CheckpointError
    from flexmesh.runtime.state.checkpoint import latest_checkpoint

    root = tmp_path / "run" / "checkpoints"
    elsewhere = tmp_path / "other" / "checkpoints" / "step_000003"
    elsewhere.mkdir(parents=True)
    (elsewhere / "manifest.json").write_text(json.dumps({"format": 2, "step": 3, "plan_hash": "x"}))
    root.mkdir(parents=True)
    for name in ("../../other/checkpoints/step_000003", str(elsewhere), "step_3"):
        (root / "latest").write_text(name + "\n")
        with pytest.raises(CheckpointError, match="not a step_NNNNNN folder of this run"):
            latest_checkpoint(root)
    (root / "step_000003").symlink_to(elsewhere)
    (root / "latest").write_text("step_000003\n")
    with pytest.raises(CheckpointError, match="not a step_NNNNNN folder"):
        latest_checkpoint(root)
    (root / "latest").unlink()
    assert latest_checkpoint(root) is None  # a linked folder is never picked either


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    worker(Path(sys.argv[2]), sys.argv[3:])
