"""The runtime's correctness matrix: every layout gives the single-process losses and parameters.

Each layout also loads a tiny model saved as Hugging Face safetensors and must give the loss (hence
the logits) that model gives in one process.

Each multi-process launch (torchrun, gloo, CPU, fp32) runs several layouts in one go to amortise
process start-up; this file is also the worker (``python tests/test_runtime_parallel.py worker``).
The reference is a plain PyTorch loop in the test process over the same documents: one model, no
distributed code, loss = summed token cross-entropy / global label-token count.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import (
    STEPS,
    assert_golden,
    golden_losses,
    launch,
    load_params,
    make_steps,
    reference_training,
    tiny_spec,
    train_config,
)

# name -> (world, plan fields). Strategies are per layer (4 layers); "layers" is the partition.
LAYOUTS: dict[str, dict] = {
    "dp": dict(world=2, strategies=["tp1-dp2z0"] * 4),
    "zero2": dict(world=2, strategies=["tp1-dp2z2"] * 4),
    "zero3": dict(world=2, strategies=["tp1-dp2z3", "tp1-dp2z3-ac", "tp1-dp2z2", "tp1-dp2z3-ac"]),
    "tp_sp": dict(world=2, strategies=["tp2-dp1z0", "tp2-dp1z0-ac", "tp2-dp1z0", "tp2-dp1z0"]),
    "pp_1f1b": dict(world=2, pp=2, schedule="1f1b", layers=[[0, 3], [3, 4]], strategies=["tp1-dp1z0"] * 4),
    "pp_gpipe": dict(world=2, pp=2, schedule="gpipe", layers=[[0, 1], [1, 4]], strategies=["tp1-dp1z0"] * 4),
    "pp_interleaved": dict(world=2, pp=2, schedule="interleaved", v=2, layers=[[0, 1], [1, 2], [2, 3], [3, 4]],
                           strategies=["tp1-dp1z0"] * 4),
    "ulysses": dict(world=2, strategies=["tp1-u2-dp1z3"] * 4),
    "ring": dict(world=2, strategies=["tp1-r2-dp1z3", "tp1-r2-dp1z3-ac", "tp1-r2-dp1z3", "tp1-r2-dp1z3"]),
    "dp_x_tp": dict(world=4, strategies=["tp2-dp2z3"] * 4),
    "pp_x_dp": dict(world=4, pp=2, schedule="1f1b", layers=[[0, 2], [2, 4]], strategies=["tp1-dp2z2"] * 4),
    "pp_x_tp": dict(world=4, pp=2, schedule="1f1b", layers=[[0, 3], [3, 4]], strategies=["tp2-dp1z0"] * 4),
    "cp_x_dp": dict(world=4, strategies=["tp1-u2-dp2z3"] * 4),
    "ring_x_dp": dict(world=4, strategies=["tp1-r2-dp2z0"] * 4),
    # A sliding window (shorter than most documents) on layers 0, 2 and 3: ring attention skips the
    # K/V blocks out of reach, and pipeline stages keep their layers' windows.
    "window_ring": dict(world=2, window=True, strategies=["tp1-r2-dp1z3"] * 4),
    "window_pp": dict(world=2, window=True, pp=2, schedule="1f1b", layers=[[0, 2], [2, 4]],
                      strategies=["tp1-dp1z0"] * 4),
}
WINDOW, WINDOW_LAYERS = 9, (True, False, True, True)
# Keys files that reuse these checks may give a layout: "steps" (default STEPS: this file's layouts have
# golden losses of STEPS steps) and "weights" (default True: the layout also loads the Hugging Face weights).


def spec_for(window: bool):
    """The tiny model, or the same with a sliding window on some layers."""
    from dataclasses import replace

    spec = tiny_spec()
    return replace(spec, sliding_window=WINDOW, window_layers=WINDOW_LAYERS) if window else spec


def layout_spec(name: str):
    return spec_for(LAYOUTS[name].get("window", False))


def make_plan(name: str):
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    cfg = LAYOUTS[name]
    strategies = [LayerStrategy.parse(s) for s in cfg["strategies"]]
    layers = cfg.get("layers", [[0, 4]])
    stages = tuple(StagePlan(a, b, tuple(strategies[a:b])) for a, b in layers)
    pp, v = cfg.get("pp", 1), cfg.get("v", 1)
    return Plan.uniform(model="test-tiny", cluster="cpu", world_size=cfg["world"], pp=pp,
                pipeline_schedule=cfg.get("schedule", "1f1b"), virtual_stages=v, num_microbatches=1, seq_len=256,
                global_batch=8, stages=stages)


# ---- reference ------------------------------------------------------------------------------------
def reference(steps: list, window: bool = False) -> tuple[list[float], dict]:
    """A plain single-process loop over the same documents; no flexmesh runtime code but the model."""
    import torch

    torch.manual_seed(0)
    losses, _, _, params = reference_training(steps, spec=spec_for(window))
    return losses, params

WEIGHTS_SEED = 99


def weights_model(window: bool = False):
    """The model whose Hugging Face safetensors every layout loads (seeded unlike the trained one)."""
    from flexmesh.runtime.model.transformer import build_model

    model = build_model(spec_for(window), device="cpu")
    model.init_weights(WEIGHTS_SEED)
    return model


def first_loss(model, docs, schedule) -> float:
    from flexmesh.runtime.train.reference import reference_loss

    return reference_loss(model, docs, schedule, backward=False)


def run_layouts(tmp: Path, world: int, names: list[str]) -> dict:
    from flexmesh.runtime.state.weights import save_hf_safetensors

    save_hf_safetensors(weights_model(), tmp / "weights.safetensors")
    proc = launch(world, ["worker", str(tmp), *names], script=__file__)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return {n: json.loads((tmp / n / "result.json").read_text()) for n in names}


# ---- worker ---------------------------------------------------------------------------------------
def worker(out: Path, names: list[str]) -> None:
    """Run each named layout for its steps (STEPS unless it says); write losses and the full parameters
    (per pp stage)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from flexmesh.layout.step import carries_pieces
    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.state.weights import canonical_name
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=60)
    try:
        for name in names:
            plan = make_plan(name)
            trainer = Trainer(plan, layout_spec(name), train_config())
            lay = trainer.layout
            cfg = LAYOUTS[name]
            steps = make_steps(lay.data_ranks, lay.cp, steps=cfg.get("steps", STEPS), cut=carries_pieces(),
                               even=cfg.get("even", False))
            losses = [trainer.step(docs, sched).loss for docs, sched in steps]
            params = {}
            for m in trainer.inner_models():
                sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
                params.update({canonical_name(k): v.detach().cpu().clone() for k, v in sd.items()})
            # Hugging Face weights (written by the test from a model seeded differently) load into
            # this layout: the first step's loss is the one that model gives on the same batch.
            weights_loss = None
            if cfg.get("weights", True):
                loaded = Trainer(plan, layout_spec(name), train_config(), weights=str(out / "weights.safetensors"))
                weights_loss = loaded.step(*steps[0]).loss
            c = trainer.place
            folder = out / name
            if c.dp == 0 and c.cp == 0 and c.tp == 0:
                folder.mkdir(parents=True, exist_ok=True)
                torch.save(params, folder / f"params_pp{c.pp}.pt")
            dist.barrier()
            if dist.get_rank() == 0:
                (folder / "result.json").write_text(json.dumps({"losses": losses, "layout": plan.layout,
                                                                 "weights_loss": weights_loss}))
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()


# ---- tests ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_runs() -> dict:
    """Reference losses and parameters per distinct (data ranks, cp) batch layout, window and documents
    (make_steps' even: a layout's "even" key, set by files that reuse these checks) and number of steps."""
    cache: dict = {}

    def get(data_ranks: int, cp: int, window: bool = False, even: bool = False, steps: int = STEPS):
        key = (data_ranks, cp, window, even, steps)
        if key not in cache:
            cache[key] = reference(make_steps(data_ranks, cp, steps=steps, even=even), window)
        return cache[key]

    return get


def _check(name: str, result: dict, folder: Path, reference_runs) -> None:
    from flexmesh.layout.mesh import layout_from_plan

    lay = layout_from_plan(make_plan(name))
    cfg = LAYOUTS[name]
    window, even, steps = cfg.get("window", False), cfg.get("even", False), cfg.get("steps", STEPS)
    ref_losses, ref_params = reference_runs(lay.data_ranks, lay.cp, window, even, steps)
    losses = result["losses"]
    assert len(losses) == steps
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"{name} step {step}: loss {got} vs reference {want}"
    if name in golden_losses()["runtime_parallel"]:  # every layout of this file (test_goldens_cover_the_matrix)
        assert_golden("runtime_parallel", name, losses)
    if cfg.get("weights", True):
        want = first_loss(weights_model(window), *make_steps(lay.data_ranks, lay.cp, steps=1, even=even)[0])
        got = result["weights_loss"]
        assert abs(got - want) <= 1e-5 * want, f"{name}: loaded weights give {got}"
    params = load_params(folder)
    assert set(params) == set(ref_params), f"{name}: parameter names differ: {set(params) ^ set(ref_params)}"
    for k, want in ref_params.items():
        diff = (params[k] - want).abs().max().item()
        assert diff <= 1e-4, f"{name}: {k} differs from the reference by {diff}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_process(tmp_path, reference_runs, world):
    """Every layout of this world size, launched together under one torchrun to pay start-up once."""
    names = [n for n, c in LAYOUTS.items() if c["world"] == world]
    results = run_layouts(tmp_path, world, names)
    for name in names:
        _check(name, results[name], tmp_path / name, reference_runs)


def test_goldens_cover_the_matrix():
    """Every layout here ran before the plan types merged and has its losses recorded (the others that
    reuse this file's checks, tests/test_runtime_recompute.py's, are compared with the reference only)."""
    assert set(golden_losses()["runtime_parallel"]) == set(LAYOUTS)


def test_reference_is_layout_independent():
    """Sanity of the contract itself: the same documents packed for 1 or 2 groups give the same loss."""
    a, _ = reference(make_steps(1, 1, steps=1))
    b, _ = reference(make_steps(2, 1, steps=1))
    assert a == pytest.approx(b, rel=1e-6)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    worker(Path(sys.argv[2]), sys.argv[3:])
