"""Selective recomputation, interleaving with three chunks per rank and chunks of the embedding or the
head alone run, and give the single-process losses and parameters (1e-5), as every layout of
tests/test_runtime_parallel.py does.

This file reuses that file's reference, worker and checks with layouts of its own, over 2 steps (the
first's loss, the second's after an update, the weights after it: these layouts have no golden losses of
3 steps); it is also the worker (``python tests/test_runtime_recompute.py worker``). The layouts with
selective recomputation do not load the Hugging Face weights: selective marks the attention core and
wraps nothing, so their weights load as those of tests/test_runtime_parallel.py's layouts on the same
meshes (tp_sp, ring, ulysses and zero2, pp_1f1b) do, checked there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_runtime_parallel as trp
from helpers import launch, tiny_spec
from test_runtime_parallel import reference_runs  # noqa: F401 - a pytest fixture used below

SIX = "six-layers"  # the "window" key of a layout on the six-layer model (interleaving 2 x 3 chunks)
LAYOUTS: dict[str, dict] = {
    # the attention core recomputed under tp + sequence parallelism, mixed with none and full; on
    # documents of one length (make_steps' even: a few micro-batch shapes, each a DTensor sharding
    # propagation), as tests/test_runtime_parallel.py's tp layouts take uneven ones
    "selective_tp": dict(world=2, strategies=["tp2-dp1z0-sac", "tp2-dp1z0", "tp2-dp1z0-sac", "tp2-dp1z0-ac"],
                         even=True, steps=2, weights=False),
    # with context parallelism the core holds its collectives, which run again in backward
    "selective_ring": dict(world=2, strategies=["tp1-r2-dp1z3-sac"] * 4, steps=2, weights=False),
    "selective_ulysses": dict(world=2, strategies=["tp1-u2-dp1z2-sac"] * 4, steps=2, weights=False),
    "selective_pp": dict(world=2, pp=2, schedule="1f1b", layers=[[0, 2], [2, 4]], strategies=["tp1-dp1z0-sac"] * 4,
                         steps=2, weights=False),
    # Llama 3's pipeline (2407.21783, section 3.3.2): the first chunk holds only the embedding, the last
    # only the norm, output projection and loss
    "end_chunks": dict(world=2, pp=2, schedule="interleaved", v=2, layers=[[0, 0], [0, 2], [2, 4], [4, 4]],
                       strategies=["tp1-dp1z0"] * 4, steps=2),
    # three chunks per pipeline rank: rank 0 runs layers 0, 2, 4 and rank 1 layers 1, 3, 5
    "interleaved_v3": dict(world=2, pp=2, schedule="interleaved", v=3, window=SIX,
                           layers=[[i, i + 1] for i in range(6)], strategies=["tp1-dp1z0"] * 6, steps=2),
}
_spec_for = trp.spec_for


def spec_for(window):  # noqa: ANN001, ANN201 - the runtime file's signature
    """The runtime file's models, and the same tiny model with six layers for :data:`SIX`."""
    from dataclasses import replace

    return replace(_spec_for(False), num_layers=6) if window == SIX else _spec_for(window)


def use_these_layouts(setattr_) -> None:  # noqa: ANN001 - monkeypatch.setattr, or plain setattr in the worker
    """Make the runtime file's worker, reference and checks know :data:`LAYOUTS` and the six-layer model."""
    setattr_(trp, "LAYOUTS", {**trp.LAYOUTS, **LAYOUTS})
    setattr_(trp, "spec_for", spec_for)


def run_layouts(tmp: Path, world: int, names: list[str]) -> dict:
    """Launch the worker on ``names`` (layouts of one model) after writing the weights they load."""
    from flexmesh.runtime.state.weights import save_hf_safetensors

    (window,) = {LAYOUTS[n].get("window", False) for n in names}
    save_hf_safetensors(trp.weights_model(window), tmp / "weights.safetensors")
    proc = launch(world, ["worker", str(tmp), *names], script=__file__)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return {n: json.loads((tmp / n / "result.json").read_text()) for n in names}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_selective_recomputation_matches_single_process(tmp_path, reference_runs, monkeypatch):  # noqa: F811
    use_these_layouts(monkeypatch.setattr)
    names = [n for n in LAYOUTS if LAYOUTS[n].get("window") != SIX]
    results = run_layouts(tmp_path, 2, names)
    for name in names:
        trp._check(name, results[name], tmp_path / name, reference_runs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_interleaving_with_three_chunks_matches_single_process(tmp_path, reference_runs, monkeypatch):  # noqa: F811
    use_these_layouts(monkeypatch.setattr)
    results = run_layouts(tmp_path, 2, ["interleaved_v3"])
    trp._check("interleaved_v3", results["interleaved_v3"], tmp_path / "interleaved_v3", reference_runs)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    use_these_layouts(setattr)
    trp.worker(Path(sys.argv[2]), sys.argv[3:])


def test_selective_checkpoints_the_attention_core_only():
    """apply_ac: selective marks the attention core, full wraps the block; the core then keeps less
    for backward and the gradients do not change."""
    import torch

    from flexmesh.layout.strategy import Recompute
    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.observe.memory import SavedActivationMeter
    from flexmesh.runtime.parallel.parallelize import apply_ac

    spec = tiny_spec()
    tokens = torch.randint(0, spec.vocab, (1, 96), generator=torch.Generator().manual_seed(0))
    # two packed documents of 40 and 56 tokens (the model reads only positions and cu_seqlens)
    batch = SimpleNamespace(positions=torch.cat([torch.arange(40), torch.arange(56)])[None],
                            cu_seqlens=torch.tensor([0, 40, 96], dtype=torch.int32))
    out = {}
    for kinds in ((Recompute.NONE,) * 4, (Recompute.SELECTIVE, Recompute.NONE, Recompute.FULL, Recompute.SELECTIVE)):
        model = build_model(spec, device="cpu")
        apply_ac(model, kinds)
        marked = [bool(getattr(b, "attention", None) and b.attention.recompute_core) for b in model.layers.values()]
        assert marked == [k is Recompute.SELECTIVE for k in kinds]
        with SavedActivationMeter() as meter:
            loss = model(tokens, batch).float().square().mean()
            saved = meter.live_bytes
        loss.backward()
        out[kinds[0]] = (saved, [p.grad.clone() for p in model.parameters()])
    assert out[Recompute.SELECTIVE][0] < out[Recompute.NONE][0]
    for a, b in zip(out[Recompute.NONE][1], out[Recompute.SELECTIVE][1], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_profiler_measures_what_selective_keeps():
    """The model profiler's saved-bytes meter: full keeps least, selective less than none (the CPU
    kernel's own output copy and softmax statistics go)."""
    import torch

    from flexmesh.profile.activations import _saved_bytes

    spec = tiny_spec()
    none, sel, full = (_saved_bytes(spec, 1, 1, r, 128, torch.float32, "cpu") for r in (False, "selective", True))
    assert full < sel < none


def test_a_profile_prices_selective_with_its_own_bytes_and_an_older_one_without():
    from flexmesh.cost import CostModel, Work
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.profile.fit import LayerFit
    from flexmesh.profile.format import ModelProfile
    from flexmesh.profile.timing import ProfiledTiming
    from flexmesh.spec import MODEL_PRESETS, parse_cluster

    fwd, bwd = LayerFit(1e-3, 1e-6, 2e-9, 0.0), LayerFit(2e-3, 2e-6, 4e-9, 0.0)
    entries = [{"tp": 1, "cp": 1, "recompute": False, "bytes_per_token": 100.0},
               {"tp": 1, "cp": 1, "recompute": True, "bytes_per_token": 10.0},
               {"tp": 1, "cp": 1, "recompute": "selective", "bytes_per_token": 80.0}]

    def cost(layers: list) -> CostModel:
        mp = ModelProfile(model=MODEL_PRESETS["tiny"].to_dict(), dtype="fp32",
                          layer={"forward": fwd, "backward": bwd, "backward_recompute": bwd},
                          embedding={"forward": fwd, "backward": fwd}, head={"forward": fwd, "backward": fwd},
                          activations={"layers": layers, "attention_mask_bytes_per_sq_row_token": 0.5,
                                       "embedding_bytes_per_token": 4.0, "head_bytes_per_token": 8.0},
                          states={"weight_bytes_per_param": 4, "grad_bytes_per_param": 4,
                                  "optimizer_bytes_per_param": 8, "optimizer_step_s_per_param": 1e-9}, name="p.json")
        return CostModel(MODEL_PRESETS["tiny"], parse_cluster("2xA100-80GB"), timing=ProfiledTiming(mp))

    w = Work(tokens=1000.0, sq_tokens=500_000.0)
    none, sel = (cost(entries).layer(LayerStrategy(recompute=r), w) for r in ("none", "selective"))
    assert none.act == pytest.approx(100.0 * 1000 + 0.5 * 1000**2)  # bytes per token + the mask term
    assert sel.act == pytest.approx(80.0 * 1000)  # its own entry, and the mask is made again in backward
    assert sel.bwd == pytest.approx(none.bwd + float(fwd.attention(1000.0, 500_000.0)))
    older = cost(entries[:2]).layer(LayerStrategy(recompute="selective"), w)  # made before selective existed
    assert older.act == pytest.approx(100.0 * 1000)
