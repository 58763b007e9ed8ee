"""bf16 training (``TrainConfig.dtype="bf16"``, ``flexmesh train --dtype bf16``) against the fp32
single-process reference, at bf16's tolerance (derived in docs/precision.md):

- every step's loss within ``LOSS_RTOL`` (2%) relative of the fp32 reference's (``LAYOUT_STEPS`` steps);
- the first step's gradients (after clipping, as the optimizer sees them): cosine similarity above
  ``GRAD_COS`` (0.99) and relative error norm ``|g - g_ref| / |g_ref|`` below ``GRAD_REL`` (5%) for
  every parameter, and the reported gradient norm within ``GRAD_REL`` of the reference's.

Each layout also shows that bf16 really ran (the linear layers' outputs are bf16 and the gradients
differ from fp32's by more than fp32 rounding) while the weights, the gradients and the AdamW states
stay fp32. Layouts reuse tests/test_runtime_parallel.py's plans and tests/helpers.py's steps; this
file is also the worker (``python tests/test_bf16.py worker OUT NAME...``).
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import STEPS, launch, make_steps, reference_training, spawn, train_config

# bf16 keeps 8 significant bits (7 stored + the implicit one): one rounding is off by at most 2**-8
# (0.4%) relative. Sums over the tiny model's 64-128 wide products and 4 layers average such
# errors rather than add them, so each tolerance below leaves a margin of 4x or more over what the
# layouts here measure (docs/precision.md lists the measured figures).
LOSS_RTOL = 0.02
GRAD_COS = 0.99
GRAD_REL = 0.05
# fp32 layouts match the reference's gradients to about 1e-6 relative (test_runtime_parallel.py); bf16
# ones differ by 0.8% to 1.2% in their worst parameter, so a worst error under 0.1% means fp32 ran.
BF16_SEEN = 1e-3
# Steps each layout trains in bf16 (of the fp32 schedule of STEPS steps, as the reference): the first
# step's gradients and loss, then a loss after the fp32 update cast back to bf16. A third step ran that
# same path again; tests/test_runtime_parallel.py trains every layout its STEPS steps in fp32.
LAYOUT_STEPS = 2


def bf16_layouts(world: int) -> list[str]:
    """Every layout of tests/test_runtime_parallel.py of ``world`` ranks; "single" is one process."""
    from test_runtime_parallel import LAYOUTS

    return ["single"] if world == 1 else [n for n, c in LAYOUTS.items() if c["world"] == world]


def make_plan(name: str):
    """The plan of layout ``name``: test_runtime_parallel's, or the one-process plan for "single"."""
    from test_runtime_parallel import make_plan as parallel_plan

    if name != "single":
        return parallel_plan(name)
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    stage = StagePlan(0, 4, tuple(LayerStrategy.parse("tp1-dp1z0") for _ in range(4)))
    return Plan.uniform(model="test-tiny", cluster="cpu", world_size=1, pp=1, pipeline_schedule="1f1b",
                        num_microbatches=1,
                        seq_len=256, global_batch=8, stages=(stage,))


def bf16_config():
    return replace(train_config(), dtype="bf16")


def steps_for(lay, steps: int = STEPS, even: bool = False) -> list:
    """The first ``steps`` steps layout ``lay`` trains on in test_runtime_parallel (a cut document unless
    pipelined; ``even``: make_steps' documents of one length)."""
    from flexmesh.layout.step import carries_pieces

    return make_steps(lay.data_ranks, lay.cp, steps=steps, cut=carries_pieces(), even=even)


def even_of(name: str) -> bool:
    """Whether layout ``name`` trains on documents of one length: the tensor-parallel ones (a few
    micro-batch shapes, each a DTensor sharding propagation); tests/test_runtime_parallel.py trains
    them on uneven lengths in fp32, the other layouts here in bf16."""
    from test_runtime_parallel import LAYOUTS

    return any(s.startswith("tp2") for s in LAYOUTS.get(name, {}).get("strategies", ()))


def window_of(name: str) -> bool:
    """Whether layout ``name`` trains the model with sliding windows (test_runtime_parallel.spec_for)."""
    from test_runtime_parallel import LAYOUTS

    return LAYOUTS.get(name, {}).get("window", False)


# ---- worker ---------------------------------------------------------------------------------------
def worker(out: Path, names: list[str]) -> None:
    """Run each layout in bf16 for LAYOUT_STEPS steps; save the first step's full gradients per pipeline stage
    and write losses, gradient norms and the dtypes seen."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.state.weights import canonical_name
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=60)
    try:
        for name in names:
            trainer = Trainer(make_plan(name), spec_of(name), bf16_config())
            computed: set[str] = set()
            for m in trainer.inner_models():
                for mod in m.modules():
                    if isinstance(mod, torch.nn.Linear):
                        mod.register_forward_hook(lambda _m, _i, o, seen=computed: seen.add(str(o.dtype)))
            lay = trainer.layout
            metrics, grads = [], {}
            for i, (docs, sched) in enumerate(steps_for(lay, LAYOUT_STEPS, even_of(name))):
                metrics.append(trainer.step(docs, sched))
                if i == 0:  # gradients stay in place until the next step zeroes them
                    for m in trainer.inner_models():
                        for k, p in m.named_parameters():
                            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                            grads[canonical_name(k)] = g.detach().cpu().clone()
            states = list(trainer.optimizer.state.values())
            seen = {
                "compute": sorted(computed),
                "params": sorted({str(p.dtype) for p in trainer.params}),
                "grads": sorted({str(g.dtype) for g in grads.values()}),
                "optimizer": sorted({str(s[key].dtype) for s in states for key in ("exp_avg", "exp_avg_sq")}),
            }
            folder = out / name
            c = trainer.place
            if c.dp == 0 and c.cp == 0 and c.tp == 0:
                folder.mkdir(parents=True, exist_ok=True)
                torch.save(grads, folder / f"grads_pp{c.pp}.pt")
            seen_all: list = [None] * dist.get_world_size()
            dist.all_gather_object(seen_all, seen)
            dist.barrier()
            if dist.get_rank() == 0:
                (folder / "result.json").write_text(json.dumps({
                    "losses": [m.loss for m in metrics], "grad_norms": [m.grad_norm for m in metrics],
                    "metrics_dtype": sorted({m.dtype for m in metrics}), "seen": seen_all}))
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()


def resume_worker(out: Path) -> None:
    """One process: 2 steps in fp32 to a run folder, then the same run resumed in bf16 to step 4."""
    import torch
    import torch.distributed as dist

    from flexmesh.layout.mesh import layout_from_plan
    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.loop import ListSource, fit
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=60)
    try:
        plan = make_plan("single")
        steps = steps_for(layout_from_plan(plan)) + make_steps(1, 1, seed=8)[:1]
        for dtype, max_steps in (("fp32", 2), ("bf16", 4)):
            cfg = replace(train_config(), max_steps=max_steps, out_dir=str(out / "run"), dtype=dtype)
            fit(Trainer(plan, spec_of("single"), cfg), ListSource(steps), cfg)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spec_of(name: str):
    from test_runtime_parallel import spec_for

    return spec_for(window_of(name))


# ---- reference ------------------------------------------------------------------------------------
@functools.cache  # a function of the batch layout alone: computed once for the layouts that share it
def fp32_reference(data_ranks: int, cp: int, cut: bool, window: bool,
                   even: bool = False) -> tuple[list[float], float, dict]:
    """fp32, one process, on the first LAYOUT_STEPS steps of ``make_steps(data_ranks, cp, cut=cut)``: every
    step's loss, the first step's gradient norm before clipping and its clipped gradients."""
    from test_runtime_parallel import spec_for

    steps = make_steps(data_ranks, cp, steps=LAYOUT_STEPS, cut=cut, even=even)
    losses, norms, grads, _ = reference_training(steps, spec=spec_for(window))
    return losses, norms[0], grads


def compare_grads(got: dict, want: dict) -> dict[str, tuple[float, float]]:
    """Per parameter: (cosine similarity, relative error norm) of ``got`` against ``want``."""
    import torch

    out = {}
    for k, w in want.items():
        g = got[k].float().flatten()
        w = w.flatten()
        cos = float(torch.nn.functional.cosine_similarity(g, w, dim=0))
        out[k] = (cos, float((g - w).norm() / w.norm()))
    return out


def check_layout(name: str, result: dict, folder: Path) -> list[str]:
    """Everything layout ``name`` got wrong against the fp32 reference (empty: it passes)."""
    from flexmesh.layout.mesh import layout_from_plan
    from flexmesh.layout.step import carries_pieces

    lay = layout_from_plan(make_plan(name))
    ref_losses, ref_norm, ref_grads = fp32_reference(lay.data_ranks, lay.cp, carries_pieces(), window_of(name),
                                                     even_of(name))
    bad = []
    losses = result["losses"]
    if len(losses) != LAYOUT_STEPS:
        bad.append(f"{len(losses)} steps ran, not {LAYOUT_STEPS}")
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        if abs(got - want) > LOSS_RTOL * abs(want):
            bad.append(f"step {step + 1}: loss {got:.5f} vs fp32 {want:.5f}")
    if abs(result["grad_norms"][0] - ref_norm) > GRAD_REL * ref_norm:
        bad.append(f"gradient norm {result['grad_norms'][0]:.5f} vs fp32 {ref_norm:.5f}")
    grads: dict = {}
    for f in sorted(folder.glob("grads_pp*.pt")):
        import torch

        grads.update(torch.load(f))
    if set(grads) != set(ref_grads):
        return [*bad, f"gradient names differ: {sorted(set(grads) ^ set(ref_grads))}"]
    errors = compare_grads(grads, ref_grads)
    for k, (cos, rel) in errors.items():
        if cos <= GRAD_COS or rel >= GRAD_REL:
            bad.append(f"gradient of {k}: cosine {cos:.5f}, relative error {rel:.4f}")
    if max(rel for _, rel in errors.values()) < BF16_SEEN:
        bad.append("the gradients match fp32's to fp32 precision: bf16 did not run")
    for rank, seen in enumerate(result["seen"]):
        want = {"compute": ["torch.bfloat16"], "params": ["torch.float32"], "grads": ["torch.float32"],
                "optimizer": ["torch.float32"]}
        if seen != want:
            bad.append(f"rank {rank} saw dtypes {seen}, expected {want}")
    if result["metrics_dtype"] != ["bf16"]:
        bad.append(f"metrics record dtype {result['metrics_dtype']}")
    return bad


def run_bf16(tmp: Path, world: int) -> None:
    names = bf16_layouts(world)
    proc = launch(world, ["worker", str(tmp), *names], script=__file__)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    failures = {n: check_layout(n, json.loads((tmp / n / "result.json").read_text()), tmp / n) for n in names}
    failures = {n: f for n, f in failures.items() if f}
    assert not failures, json.dumps(failures, indent=1)


# ---- tests ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_bf16_layouts_match_fp32_reference(tmp_path, world):
    """One process (autocast); of two ranks replicated dp, ZeRO-2, ZeRO-3 (FSDP2), tp + sp, pipelines
    (1F1B, GPipe, interleaved), Ulysses, ring, and sliding windows under ring and a pipeline."""
    run_bf16(tmp_path, world)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_layouts_of_four_ranks_match_fp32_reference(tmp_path):
    """dp x tp (FSDP2 over DTensors), pipelines of FSDP2 and of tp stages, cp x dp, ring x dp."""
    run_bf16(tmp_path, 4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_in_another_dtype_is_allowed_and_recorded(tmp_path):
    """Checkpoints hold fp32 weights and AdamW states in both dtypes, so a run may resume in the
    other; the switch is said once and every metrics line names the dtype its step ran in."""
    proc = launch(1, ["resume", str(tmp_path)], script=__file__)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["dtype"]) for r in rows] == [(1, "fp32"), (2, "fp32"), (3, "bf16"), (4, "bf16")]
    assert "resuming after step 2 in bf16; the steps so far ran in fp32" in " ".join(proc.stderr.split())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_command_runs_bf16(tmp_path):
    """`flexmesh train --dtype bf16` on 2 ranks (ZeRO-3 and ZeRO-2 layers; the ranks from the fork server, as torchrun
    starts them): the metrics say bf16, and its first loss is within LOSS_RTOL of, but not equal to, the same
    run's in fp32."""
    from helpers import flexmesh_ranks, write_inputs

    _, corpus, plan = write_inputs(tmp_path, world=2)
    first = {}
    for dtype in ("fp32", "bf16"):
        out = tmp_path / dtype
        proc = flexmesh_ranks(2, "train", "--plan", str(plan), "--corpus", str(corpus), "--out", str(out),
                              "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--max-steps", "1",
                              "--dtype", dtype)
        assert proc.returncode == 0, proc.stderr[-4000:]
        row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        assert row["dtype"] == dtype
        first[dtype] = row["loss"]
    assert 0 < abs(first["bf16"] - first["fp32"]) <= LOSS_RTOL * first["fp32"], first


# ---- without processes -----------------------------------------------------------------------------
def test_local_attention_takes_bf16_on_cpu():
    """bf16 q, k, v (FSDP2's policy) and fp32 ones under autocast: bf16 out, and the output and the
    gradients within 2% relative error norm of fp64's (about five bf16 roundings; measured 0.1% to 0.4%)."""
    import torch

    from flexmesh.runtime.model.attention import attend

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 24, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 17, 24], dtype=torch.int32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attend(*leaves, cu)
    ref_grads = torch.autograd.grad(ref.sum(), leaves)
    for autocast in (False, True):
        dtype = torch.float32 if autocast else torch.bfloat16
        mine = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = attend(*mine, cu)
        assert out.dtype == torch.bfloat16
        grads = torch.autograd.grad(out.float().sum(), mine)
        for name, got, want in (("out", out, ref.detach()), *zip(("dq", "dk", "dv"), grads, ref_grads)):
            error = float((got.detach().double() - want).norm() / want.norm())
            assert 0 < error < 0.02, f"autocast {autocast}: {name} relative error {error}"
        assert [g.dtype for g in grads] == [dtype] * 3


def _ring_worker(rank: int, world: int, port: int) -> None:
    """Ring attention of bf16 inputs under autocast equals, bit for bit, the fp32 ring of the same
    values rounded to bf16: scores, log-sum-exp and merge ran in fp32 (autocast did not reach them)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from flexmesh.runtime.parallel.context import CPContext, context_attend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        gen = torch.Generator().manual_seed(3)
        q, k, v, dout = (torch.randn(1, h, 32, 16, generator=gen).to(torch.bfloat16) for h in (4, 2, 2, 4))
        cu = torch.tensor([0, 7, 23, 32], dtype=torch.int32)  # documents straddle the two slices
        sl = slice(rank * 16, (rank + 1) * 16)
        cp = CPContext("ring", dist.group.WORLD, rank, world)
        outs, grads = [], []
        for dtype, autocast in ((torch.bfloat16, True), (torch.float32, False)):
            mine = [x[:, :, sl].to(dtype).requires_grad_() for x in (q, k, v)]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = context_attend(*mine, cu, cp)
            grads.append(torch.autograd.grad(out, mine, dout[:, :, sl].to(dtype)))
            outs.append(out)
        assert outs[0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads[0])
        torch.testing.assert_close(outs[0], outs[1].to(torch.bfloat16), rtol=0, atol=0)
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=0, atol=0)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ring_attention_keeps_softmax_statistics_fp32_in_bf16():

    from flexmesh.runtime.launch import free_port

    spawn(_ring_worker, (2, free_port()), 2)


def test_precision_policy_per_layout():
    """FSDP2's policy where data ranks > 1, autocast where there is one data rank, nothing in fp32."""
    import torch

    from flexmesh.errors import PlanError
    from flexmesh.layout.mesh import layout_from_plan
    from flexmesh.runtime.parallel.parallelize import activation_dtypes, autocast_bf16, mixed_precision
    from flexmesh.runtime.parallel.precision import check_dtype

    single, zero3, pipe = (layout_from_plan(make_plan(n)) for n in ("single", "zero3", "pp_x_dp"))
    policy = mixed_precision("bf16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision("fp32").param_dtype is None
    assert isinstance(autocast_bf16(single, "bf16", "cpu"), torch.autocast)
    assert not isinstance(autocast_bf16(zero3, "bf16", "cpu"), torch.autocast)
    assert not isinstance(autocast_bf16(single, "fp32", "cpu"), torch.autocast)
    assert activation_dtypes(pipe, "bf16") == (torch.bfloat16, torch.bfloat16)
    assert activation_dtypes(layout_from_plan(make_plan("pp_1f1b")), "bf16") == (torch.float32, torch.bfloat16)
    with pytest.raises(PlanError, match="fp32 or bf16"):
        check_dtype("fp16")


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    worker(Path(sys.argv[2]), sys.argv[3:])
elif __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "resume":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    resume_worker(Path(sys.argv[2]))
