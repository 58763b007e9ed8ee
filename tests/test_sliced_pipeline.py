"""Documents cut into slices across pipeline stages train exactly as whole documents.

Under torchrun (gloo, CPU, fp32): pp 2 and pp 4, plain, with activation checkpointing, interleaved
(two chunks per rank), with data parallelism (ZeRO-3, whose ranks pair their weight gathers micro-
batch by micro-batch, so both pipelines run one order built from both groups' units), with tensor
parallelism, and with Ulysses and ring context parallelism inside a stage. Documents are cut into 2
to 4 slices that span micro-batches and share them with short documents. Every run's losses and
first-step gradients equal a single process that never cuts (1e-5); the trainer ran the sliced order
(flexmesh.layout.pipeline_order) and emptied the carried keys and values after each step.

This file is also the torchrun worker (``python tests/test_sliced_pipeline.py worker OUT NAME...``).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import launch, reference_training, tiny_spec, train_config

if __name__ == "__main__":  # a torchrun worker: the repository is not installed on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flexmesh.layout.step import Group, Piece, StepSchedule

LAYOUTS = {  # name -> (world, pp, pipeline schedule, partition, per-layer strategy)
    "pp2": (2, 2, "1f1b", [[0, 2], [2, 4]], "tp1-dp1z0"),
    "pp2_ac": (2, 2, "1f1b", [[0, 3], [3, 4]], "tp1-dp1z0-ac"),
    "pp2_interleaved": (2, 2, "interleaved", [[0, 1], [1, 2], [2, 3], [3, 4]], "tp1-dp1z0"),
    "pp4": (4, 4, "1f1b", [[0, 1], [1, 2], [2, 3], [3, 4]], "tp1-dp1z0"),
    "pp4_ac": (4, 4, "gpipe", [[0, 1], [1, 2], [2, 3], [3, 4]], "tp1-dp1z0-ac"),
    "pp2_dp2_z3": (4, 2, "1f1b", [[0, 2], [2, 4]], "tp1-dp2z3"),
    "pp2_tp2": (4, 2, "1f1b", [[0, 2], [2, 4]], "tp2-dp1z0-ac"),
    "pp2_ulysses2": (4, 2, "1f1b", [[0, 2], [2, 4]], "tp1-u2-dp1z0"),
    "pp2_ring2": (4, 2, "1f1b", [[0, 2], [2, 4]], "tp1-r2-dp1z0-ac"),
}
STEPS = 2


def make_plan(name: str):
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    world, pp, schedule, layers, strategy = LAYOUTS[name]
    s = LayerStrategy.parse(strategy)
    stages = tuple(StagePlan(a, b, (s,) * (b - a)) for a, b in layers)
    return Plan.uniform(model="test-tiny", cluster="cpu", world_size=world, pp=pp, pipeline_schedule=schedule,
                        virtual_stages=len(layers) // pp, num_microbatches=1, seq_len=256, global_batch=8,
                        stages=stages)


def sliced_steps(groups: int, cp: int = 1) -> list:
    """STEPS steps. Group 0: document 0 (80 tokens) in 4 slices and document 1 (50) in 2, their slices
    interleaved over micro-batches 0-3 beside short documents, then document 2 (45) in 3 slices; with
    two groups the second cuts document 3 in 2 (other units: the pipelines run one merged order); each
    group a context-parallel group of ``cp`` data ranks."""
    out = []
    for step in range(STEPS):
        rng = np.random.default_rng(31 + step)
        lens = (80, 50, 45, 36, 9, 17, 5, 12, 21)
        docs = [rng.integers(1, 256, n) for n in lens]
        d0 = [Piece(0, a, b) for a, b in ((0, 30), (30, 50), (50, 66), (66, 80))]
        d1 = [Piece(1, 0, 28), Piece(1, 28, 50)]
        d2 = [Piece(2, a, b) for a, b in ((0, 20), (20, 34), (34, 45))]
        short = [Piece(i, 0, lens[i]) for i in range(4, 9)]
        g0 = [[short[0], d0[0]], [d0[1], d1[0]], [d0[2]], [d0[3], d1[1], short[1]], [short[2], d2[0]], [d2[1]],
              [d2[2], short[3]]]
        layout = [(tuple(range(cp)), g0)]
        if groups == 1:
            g0[-1].append(Piece(3, 0, 36))
            g0.append([short[4]])
        else:
            layout.append((tuple(range(cp, 2 * cp)), [[Piece(3, 0, 20)], [short[4], Piece(3, 20, 36)]]))
        sched = StepSchedule(lens, tuple(Group(r, tuple(tuple(mb) for mb in mbs)) for r, mbs in layout), "test")
        sched.validate(groups * cp)
        out.append((docs, sched))
    return out


def worker(out: Path, names: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.state.weights import canonical_name
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=120)
    try:
        for name in names:
            trainer = Trainer(make_plan(name), tiny_spec(), train_config())
            steps = sliced_steps(trainer.layout.dp, trainer.layout.cp)
            losses, grads, cuts = [], {}, []
            for i, (docs, sched) in enumerate(steps):
                metrics = trainer.step(docs, sched)
                losses.append(metrics.loss)
                cuts.append(metrics.cut_documents)
                if i == 0:
                    for m in trainer.inner_models():
                        for k, p in m.named_parameters():
                            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                            grads[canonical_name(k)] = g.detach().cpu().clone()
            units = [k[2] for k in trainer._schedules if k[2] is not None]
            (out / name).mkdir(parents=True, exist_ok=True)
            torch.save(grads, out / name / f"grads{dist.get_rank()}.pt")
            if dist.get_rank() == 0:
                (out / name / "result.json").write_text(json.dumps(
                    {"losses": losses, "units": units, "carried_left": len(trainer.carry), "cuts": cuts}))
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()


@functools.cache  # a function of the group count alone: once for every layout of either world
def reference(groups: int) -> tuple[list[float], dict]:
    """One process over :func:`sliced_steps` of ``groups`` groups, documents whole: losses, first-step gradients."""
    losses, _, grads, _ = reference_training(sliced_steps(groups))
    return losses, grads


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
def test_sliced_pipelines_match_the_whole_documents(tmp_path, world):
    import torch

    names = [n for n, layout in LAYOUTS.items() if layout[0] == world]
    proc = launch(world, ["worker", str(tmp_path), *names], script=__file__, timeout=800)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for name in names:
        result = json.loads((tmp_path / name / "result.json").read_text())
        want_losses, want_grads = reference(2 if "dp2" in name else 1)
        for step, (got, want) in enumerate(zip(result["losses"], want_losses, strict=True)):
            assert abs(got - want) <= 1e-5 * want, f"{name} step {step}: loss {got} vs whole documents {want}"
        grads: dict = {}
        for f in sorted((tmp_path / name).glob("grads*.pt")):
            grads.update(torch.load(f))
        assert set(grads) == set(want_grads), name
        for k, want in want_grads.items():
            torch.testing.assert_close(grads[k], want, rtol=1e-5, atol=1e-6, msg=f"{name} gradient {k}")
        # the step ran the sliced order, units as the chains of every group of the pipeline
        first_units = [0, 1, 2, 3], [4, 5, 6]
        assert result["units"] and all(u[:2] == [list(x) for x in first_units] for u in
                                       [[list(x) for x in units] for units in result["units"]]), result["units"]
        assert result["carried_left"] == 0
        assert result["cuts"] == [4 if "dp2" in name else 3] * STEPS  # documents 0, 1, 2 (and 3 on group 1)


def test_units_merge_every_groups_chains():
    """Ranks that pair collectives per micro-batch run one order: units are unions of the groups' chains."""
    from flexmesh.layout.pipeline_order import chain_ends, units_from_ends

    (_, one), (_, two) = sliced_steps(1)[0], sliced_steps(2)[0]
    assert units_from_ends(chain_ends(list(one.groups), 8)) == [[0, 1, 2, 3], [4, 5, 6], [7]]
    assert units_from_ends(chain_ends(list(two.groups), 7)) == [[0, 1, 2, 3], [4, 5, 6]]


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    worker(Path(sys.argv[2]), sys.argv[3:])
