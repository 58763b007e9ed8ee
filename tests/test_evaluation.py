"""Held-out evaluation and TensorBoard scalars of `flexmesh train` (flexmesh.runtime.train.evaluate,
flexmesh.runtime.train.scalars).

The held-out loss equals a plain single-process forward over the same documents (one process, and two
data ranks under FSDP2 in lockstep and uneven, a cut document included) before and after a step, and
evaluating changes no step: the losses of a run with `--eval-corpus` (resumed half way) equal those of
one without, bit for bit. This file is also the worker.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import flexmesh_here, flexmesh_ranks, launch, make_steps, tiny_spec, train_config, write_inputs

PLANS = {"z0": ["tp1-dp1z0"] * 4, "lockstep": ["tp1-dp2z3", "tp1-dp2z2", "tp1-dp2z3-ac", "tp1-dp2z2"],
         "uneven": ["tp1-dp2z2"] * 4}


def make_plan(name: str):
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    strategies = PLANS[name]
    world = LayerStrategy.parse(strategies[0]).dp
    st = StagePlan(0, 4, tuple(LayerStrategy.parse(s) for s in strategies))
    return Plan.uniform(model="test-tiny", cluster="cpu", world_size=world, pp=1, pipeline_schedule="1f1b",
                        num_microbatches=1, seq_len=256, global_batch=8, stages=(st,))


def worker(out: Path, names: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from helpers import reference_training

    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.evaluate import held_out_loss
    from flexmesh.runtime.train.reference import reference_loss
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=60)
    world, report = dist.get_world_size(), {}
    try:
        for name in names:
            (docs, schedule), (later_docs, later) = make_steps(world, 1, steps=2)  # a cut document in each
            model = build_model(tiny_spec(), device="cpu")
            model.init_weights(train_config().seed)
            before_ref = reference_loss(model, later_docs, later, backward=False)
            weights = reference_training([(docs, schedule)])[3]
            model.load_state_dict(weights)
            after_ref = reference_loss(model, later_docs, later, backward=False)
            evaluated = Trainer(make_plan(name), tiny_spec(), train_config())
            plain = Trainer(make_plan(name), tiny_spec(), train_config())
            before = held_out_loss(evaluated, later_docs, later)
            m = evaluated.step(docs, schedule)
            after = held_out_loss(evaluated, later_docs, later)
            again = held_out_loss(evaluated, later_docs, later)
            n = plain.step(docs, schedule)
            m2, n2 = evaluated.step(later_docs, later), plain.step(later_docs, later)
            report[name] = dict(before=before, before_ref=before_ref, after=after, after_ref=after_ref, again=again,
                                losses=[m.loss, m2.loss], plain=[n.loss, n2.loss],
                                norms=[m.grad_norm, m2.grad_norm], plain_norms=[n.grad_norm, n2.grad_norm])
        (out / f"report_{dist.get_rank()}.json").write_text(json.dumps(report))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _run(tmp: Path, world: int, names: list[str]) -> dict:
    proc = launch(world, ["worker", str(tmp), *names], script=__file__)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads((tmp / "report_0.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,names", [(1, ["z0"]), (2, ["lockstep", "uneven"])])
def test_held_out_loss_is_the_single_process_forward_and_changes_no_step(tmp_path, world, names):
    report = _run(tmp_path, world, names)
    for name in names:
        r = report[name]
        assert r["before"] == pytest.approx(r["before_ref"], rel=1e-6), name
        assert r["after"] == pytest.approx(r["after_ref"], rel=1e-6), name
        # exact: the same weights' forward, run again
        assert r["after"] != r["before"] and r["again"] == r["after"], name  # the weights of the step, each time
        assert r["losses"] == r["plain"] and r["norms"] == r["plain_norms"], name  # exact: the same steps


def _rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_with_evaluation_trains_the_same_and_resumes(tmp_path):
    cfg, corpus, plan = write_inputs(tmp_path, 1)
    common = ["train", "--plan", str(plan), "--model", str(cfg), "--corpus", str(corpus), "--no-progress",
              "--cache-dir", str(tmp_path / "cache")]
    plain, evaluated = tmp_path / "plain", tmp_path / "evaluated"
    for steps in ("3", "5"):  # as the evaluated run: 3 steps, then resumed to 5 (under another LR schedule)
        proc = flexmesh_ranks(1, *common, "--max-steps", steps, "--out", str(plain))
        assert proc.returncode == 0, proc.stderr[-3000:]
    with_eval = [*common, "--out", str(evaluated), "--eval-corpus", str(corpus), "--eval-every", "2",
                 "--eval-docs", "5", "--tensorboard"]
    first = flexmesh_ranks(1, *with_eval, "--max-steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step 2: held-out loss" in first.stderr and "step 3: held-out loss" in first.stderr
    resumed = flexmesh_ranks(1, *with_eval, "--max-steps", "5")  # resumes from step 3's checkpoint
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    want, got = _rows(plain), _rows(evaluated)
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # exact: the same steps, evaluation aside
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]  # exact: the same steps, evaluation aside
    assert [r["step"] for r in got if r["eval_loss"] is not None] == [2, 3, 4, 5]
    assert all(r["eval_loss"] is None and r["eval_ppl"] is None for r in want)
    for r in got:
        if r["eval_loss"] is not None:
            assert r["eval_ppl"] == pytest.approx(__import__("math").exp(r["eval_loss"]))
            assert 0 < r["eval_loss"] < 7  # below a uniform guess over the 320 ids (5.77) plus slack
    _check_scalars(evaluated / "tensorboard", got)


def _check_scalars(folder: Path, rows: list[dict]) -> None:
    """The event files hold each row's scalars, read back with TensorBoard's own reader."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(folder))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "eval_loss", "eval_ppl"} <= tags
    by_step = {e.step: e.value for e in acc.Scalars("loss")}
    assert by_step == pytest.approx({r["step"]: r["loss"] for r in rows}, rel=1e-6)  # float32 in the file
    evals = {e.step: e.value for e in acc.Scalars("eval_loss")}
    assert evals == pytest.approx({r["step"]: r["eval_loss"] for r in rows if r["eval_loss"] is not None}, rel=1e-6)


def test_evaluation_of_a_pipeline_is_refused_in_one_line(tmp_path):
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    cfg, corpus, _ = write_inputs(tmp_path, 1)
    st = LayerStrategy.parse("tp1-dp1z0")
    plan = Plan.uniform(model=str(cfg), cluster="2xA100-80GB", world_size=2, pp=2, pipeline_schedule="1f1b",
                        num_microbatches=2, seq_len=128, global_batch=4,
                        stages=(StagePlan(0, 1, (st,)), StagePlan(1, 2, (st,))))
    plan.save(tmp_path / "pp2.json")
    proc = flexmesh_here("train", "--plan", str(tmp_path / "pp2.json"), "--corpus", str(corpus), "--max-steps", "1",
                         "--out", str(tmp_path / "run"), "--nproc", "2", "--eval-corpus", str(corpus))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "--eval-corpus" in proc.stderr and "pp 1" in proc.stderr


def test_tensorboard_without_the_package_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find(name, *a))
    cfg, corpus, plan = write_inputs(tmp_path, 1)
    proc = flexmesh_here("train", "--plan", str(plan), "--corpus", str(corpus), "--max-steps", "1",
                         "--out", str(tmp_path / "run"), "--tensorboard")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "pip install tensorboard" in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_the_tensorboard_folder_belongs_to_a_run(tmp_path):
    from flexmesh.runtime.state.rundir import foreign_entries

    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    assert foreign_entries(tmp_path) == []


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    worker(Path(sys.argv[2]), sys.argv[3:])
