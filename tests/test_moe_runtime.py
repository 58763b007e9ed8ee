"""Experts sharded over data ranks train exactly as one process, whatever their placement.

The model: 4 layers, the first dense, the others 8 experts (top 2, not renormalised) beside a gated
shared expert. One expert is never chosen (its balancing bias is -1: routing picks by probability +
bias, so it gets zero tokens on every rank and its weights must still come back with a zero gradient).
Layouts (gloo, fp32): experts over 2 and 4 data ranks with the other weights replicated (ZeRO 0, one
MoE layer recomputed: its exchanges run again inside backward), sharded by FSDP2 (ZeRO 2, ZeRO 3),
under a pipeline, with tensor parallelism (experts over the tp ranks' sequence slices, with and
without FSDP2) and with Ulysses and ring context parallelism. Each must give the single-process
reference's losses, first-step gradients (within 1e-5 of the largest) and parameters, and count
every routed pair once; and 2 steps whose placement changes every step (experts moved, replicated,
some ranks given fewer), and 2 whose experts are placed in every layer of every micro-batch from its
own routing (``current``), must equal 2 steps of static placement within 1e-6.

This file is also the worker (``python tests/test_moe_runtime.py worker OUT LAYOUT...``).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
from helpers import launch, make_steps, reference_training, train_config

LAYOUTS: dict[str, dict] = {
    "ep2": dict(world=2, strategies=["tp1-dp2z0", "tp1-dp2z0", "tp1-dp2z0-ac", "tp1-dp2z0"]),  # layer 2 recomputed
    "ep2_fsdp": dict(world=2, strategies=["tp1-dp2z2"] * 4, placements=True),
    "ep4_zero3": dict(world=4, strategies=["tp1-dp4z3"] * 4, placements=True),
    "ep2_pp2": dict(world=4, pp=2, layers=[[0, 2], [2, 4]], strategies=["tp1-dp2z2"] * 4),
    # tensor parallelism: each tp rank routes its slice of the sequence, experts over dp x tp ranks
    "tp2": dict(world=2, strategies=["tp2-dp1z0"] * 4),
    "tp2_dp2": dict(world=4, strategies=["tp2-dp2z2"] * 4),
    # context parallelism: each rank routes its slice of the documents
    "ulysses": dict(world=2, strategies=["tp1-u2-dp1z3"] * 4),
    "ring_dp2": dict(world=4, strategies=["tp1-r2-dp2z2"] * 4),
}
# Steps of the comparison with one process: the second is placed from the first one's load (the load-following
# placement and the balancing loss's shares of a previous step) and has the other micro-batch count of
# make_steps (1 + s % 2 in the first group); a third repeated the first's.
STEPS = 2
# Steps of the placement comparison: one whole period of the changing placement (Shuffled: the replicated
# experts, half of them, alternate between two sets; the round robin's start moves a rank each step): every
# expert is replicated in some step (checked). 4 steps, a period of Shuffled replicating two experts a step,
# and before them 8 and 20, repeated the same kinds of moves.
LONG = 2
UNUSED = 7  # the expert no token reaches
AUX = 0.05  # the load-balancing loss's coefficient in the runs that train with one


def moe_spec():
    from flexmesh.spec.model import ModelSpec
    from flexmesh.spec.moe import MoESpec

    return ModelSpec(name="test-moe", num_layers=4, hidden=64, num_heads=4, num_kv_heads=2, ffn_hidden=128,
                     vocab=256, dtype="fp32", max_position=1024,
                     moe=MoESpec(8, 2, 48, shared_ffn=32, shared_gate=True, norm_topk=False, dense_layers=(0,)))


def starve(models) -> None:
    """Bias expert UNUSED out of every choice (probabilities are at most 1)."""
    from flexmesh.runtime.model.moe import MoEFeedForward

    for m in models:
        for mod in m.modules():
            if isinstance(mod, MoEFeedForward):
                mod.balance_bias[UNUSED] = -1.0


def make_plan(name: str):
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    cfg = LAYOUTS[name]
    strategies = [LayerStrategy.parse(s) for s in cfg["strategies"]]
    stages = tuple(StagePlan(a, b, tuple(strategies[a:b])) for a, b in cfg.get("layers", [[0, 4]]))
    return Plan.uniform(model="test-moe", cluster="cpu", world_size=cfg["world"], pp=cfg.get("pp", 1),
                        pipeline_schedule="1f1b", virtual_stages=1, num_microbatches=1, seq_len=256, global_batch=8,
                        stages=stages)


class Shuffled:
    """A placer whose placement changes every step: experts dealt round robin from a rotating start,
    hot and cold ones replicated on some ranks, some ranks given fewer experts than others."""

    policy = "shuffled"

    def __init__(self, layers, num_experts: int, ranks: int) -> None:
        self.layers, self.e, self.ranks, self.step = layers, num_experts, ranks, 0

    def place(self):
        from flexmesh.schedule.expert_placement import ExpertPlacement

        hosts: list[set[int]] = [set() for _ in range(self.ranks)]
        for i in range(self.e):
            hosts[(i + self.step) % self.ranks].add(i)
        if self.ranks > 1:  # a replica of half the experts (pairs 0-1, 4-5 or 2-3, 6-7: owners on different
            # ranks), each on the rank after its owner's; the two sets alternate
            for i in range(self.e):
                if (i // 2) % 2 == self.step % 2:
                    owner = next(r for r in range(self.ranks) if i in hosts[r])
                    hosts[(owner + 1) % self.ranks].add(i)
        p = ExpertPlacement(self.e, tuple(tuple(sorted(h)) for h in hosts))
        return {layer: p for layer in self.layers}

    def observe(self, load) -> None:
        self.step += 1


# ---- worker ---------------------------------------------------------------------------------------
def full_grads(models) -> dict:
    from torch.distributed.tensor import DTensor

    from flexmesh.runtime.state.weights import canonical_name

    out = {}
    for m in models:
        for k, p in m.named_parameters():
            g = p.grad
            g = g.full_tensor() if isinstance(g, DTensor) else g
            out[canonical_name(k)] = g.detach().cpu().clone()
    return out


def full_params(models) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from flexmesh.runtime.state.weights import canonical_name

    out = {}
    for m in models:
        sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
        out.update({canonical_name(k): v.detach().cpu().clone() for k, v in sd.items()})
    return out


def worker(out: Path, names: list[str]) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.expert_training import ExpertTraining
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=120)
    try:
        for name in names:
            plan = make_plan(name)
            result: dict = {}
            # every layout: load-following placement and the load-balancing loss; two of them also the
            # LONG-step comparison of placements (static, changed every step, placed per micro-batch)
            placements = ("static", "shuffled", "current") if LAYOUTS[name].get("placements") else ()
            for placement in ("laer", "aux", *placements):
                long = placement not in ("laer", "aux")
                policy = {"shuffled": "static", "aux": "laer"}.get(placement, placement)
                cfg = dataclasses.replace(train_config(), max_steps=LONG if long else STEPS, expert_placement=policy,
                                          aux_loss=AUX if placement == "aux" else 0.0)
                trainer = Trainer(plan, moe_spec(), cfg)
                starve(trainer.inner_models())
                if placement == "shuffled":
                    ex = trainer.part(ExpertTraining)
                    ex.placer = Shuffled(ex.moe_layers, ex.num_experts, ex.ranks)
                lay = trainer.layout
                steps = make_steps(lay.data_ranks, lay.cp, steps=LONG if long else STEPS, cut=False)
                losses, rows = [], []
                for i, (docs, sched) in enumerate(steps):
                    m = trainer.step(docs, sched)
                    losses.append(m.loss)
                    rows.append([r["placement"] if r["placement"] == "current" else r["placement"]["hosts"]
                                 for r in m.routing])
                    if i == 0 and not long:
                        grads = full_grads(trainer.inner_models())
                params = full_params(trainer.inner_models())
                place = trainer.place
                folder = out / name / placement
                if place.dp == 0 and place.cp == 0 and place.tp == 0:
                    folder.mkdir(parents=True, exist_ok=True)
                    torch.save(params, folder / f"params_pp{place.pp}.pt")
                    if not long:
                        torch.save(grads, folder / f"grads_pp{place.pp}.pt")
                result[placement] = {"losses": losses, "placements": rows, "imbalance": m.expert_imbalance,
                                     "routing": list(m.routing), "aux": m.aux_loss}
                dist.barrier()
            if dist.get_rank() == 0:
                (out / name / "result.json").write_text(json.dumps(result))
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()


def resume_worker(out: Path) -> None:
    """3 steps straight, and 2 + a resume + 1, with load-following placement and the load-balancing loss."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.loop import ListSource, fit
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=120)
    plan = make_plan("ep2_fsdp")
    steps = make_steps(2, 1, steps=3, seed=5, cut=False)
    cfg = dataclasses.replace(train_config(), max_steps=3, checkpoint_every=2, aux_loss=AUX, progress=False)
    try:
        straight = dataclasses.replace(cfg, out_dir=str(out / "straight"))
        fit(Trainer(plan, moe_spec(), straight), ListSource(steps), straight)
        resumed = dataclasses.replace(cfg, out_dir=str(out / "resumed"))
        fit(Trainer(plan, moe_spec(), resumed), ListSource(steps[:2]), resumed)  # stops after step 2's checkpoint
        fit(Trainer(plan, moe_spec(), resumed), ListSource(steps), resumed)
        dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()


# ---- tests ----------------------------------------------------------------------------------------
@functools.cache  # a function of the data ranks alone: computed once for the layouts that share them
def reference(data_ranks: int) -> tuple[list[float], dict, dict]:
    """Single-process losses, first-step (clipped) gradients and final weights, expert UNUSED starved."""
    import torch

    from flexmesh.runtime.model import transformer as model_module

    built = model_module.build_model

    def starved(*args, **kwargs):
        m = built(*args, **kwargs)
        starve([m])
        return m

    model_module.build_model = starved  # reference_training builds its model through this module
    try:
        torch.manual_seed(0)
        losses, _, grads, params = reference_training(make_steps(data_ranks, 1, steps=STEPS, cut=False),
                                                      spec=moe_spec())
    finally:
        model_module.build_model = built
    return losses, grads, params


@functools.cache
def aux_reference(data_ranks: int) -> tuple[list[float], dict]:
    """Single-process AdamW steps with the load-balancing loss written out as its formula: alpha E
    sum_i f_i P_i per MoE layer, f_i the previous step's share of routed pairs (even on the first),
    P_i the step's mean router probability; the CE losses and the final weights."""
    import torch
    import torch.nn.functional as F

    from flexmesh.layout.step import Piece
    from flexmesh.runtime.model.loss import summed_cross_entropy
    from flexmesh.runtime.model.moe import MoEFeedForward
    from flexmesh.runtime.model.packing import global_label_tokens, pack_microbatch
    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.train.config import lr_schedule_factor

    cfg = train_config()
    model = build_model(moe_spec(), device="cpu")
    model.init_weights(cfg.seed)
    starve([model])
    ffs = {int(k): b.feed_forward for k, b in model.layers.items() if isinstance(b.feed_forward, MoEFeedForward)}
    probs: dict[int, list] = {}
    hooks = [ff.router.register_forward_hook(lambda m, i, o, k=k: probs[k].append(F.softmax(o.float(), -1)))
             for k, ff in ffs.items()]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_schedule_factor(s, cfg.warmup_steps, cfg.max_steps,
                                                                               cfg.min_lr_ratio))
    e = moe_spec().moe.num_experts
    frac = {k: torch.full((e,), 1.0 / e) for k in ffs}
    losses = []
    for docs, schedule in make_steps(data_ranks, 1, steps=STEPS, cut=False):
        opt.zero_grad()
        n = global_label_tokens(docs, schedule)
        tokens = sum(len(d) for d in docs)
        probs.clear()
        probs.update({k: [] for k in ffs})
        ce = 0.0
        loss = torch.zeros(())
        for g in schedule.groups:
            for mb in g.microbatches:
                b = pack_microbatch(docs, [Piece(p.seq_id, 0, len(docs[p.seq_id])) for p in mb])
                part = summed_cross_entropy(model(b.tokens, b), b.labels) / n
                ce += part.item()
                loss = loss + part
        for k, ff in ffs.items():
            mean_p = torch.cat(probs[k]).sum(0) / tokens
            loss = loss + AUX * e * (frac[k] * mean_p).sum()
            frac[k] = ff.load.double() / ff.load.sum()
            ff.load.zero_()
        loss.backward()
        losses.append(ce)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
    for h in hooks:
        h.remove()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def load(folder: Path, prefix: str) -> dict:
    import torch

    out = {}
    for f in sorted(folder.glob(f"{prefix}_pp*.pt")):
        out.update(torch.load(f))
    return out


def rel(a, b) -> float:
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-12))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
def test_experts_over_data_ranks_match_one_process(tmp_path, world):
    names = [n for n, c in LAYOUTS.items() if c["world"] == world]
    proc = launch(world, ["worker", str(tmp_path), *names], script=__file__, timeout=800)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    for name in names:
        result = json.loads((tmp_path / name / "result.json").read_text())
        data_ranks = int(LAYOUTS[name]["strategies"][0].split("-dp")[1].split("z")[0])
        ref_losses, ref_grads, ref_params = reference(data_ranks)
        laer = result["laer"]
        for step, (got, want) in enumerate(zip(laer["losses"], ref_losses, strict=True)):
            assert abs(got - want) <= 1e-5 * abs(want), f"{name} step {step}: loss {got} vs {want}"
        grads = load(tmp_path / name / "laer", "grads")
        assert set(grads) == set(ref_grads)
        for k, want in ref_grads.items():
            assert rel(grads[k], want) <= 1e-5 or float((grads[k] - want).abs().max()) <= 1e-9, (name, k)
            if "experts.gate_up" in k or "experts.down" in k:
                assert float(grads[k][UNUSED].abs().max()) == 0.0, f"{name}: {k} of the starved expert"
        params = load(tmp_path / name / "laer", "params")
        for k, want in ref_params.items():
            if k.endswith(("balance_bias", "routed_share")):  # run state, not weights
                continue
            assert float((params[k] - want).abs().max()) <= 1e-5, f"{name}: {k}"
        # the starved expert: no tokens in any routing row; static placement lets the load-following one differ
        assert all(r["expert_tokens"][UNUSED] == 0 for r in laer["routing"])
        # every real token routed to its top 2 once (a recomputed layer counts nothing twice, padding
        # nothing), and every routed pair computed by exactly one rank
        tokens = sum(len(d) for d in make_steps(data_ranks, 1, steps=STEPS, cut=False)[-1][0])
        for r in laer["routing"]:
            assert sum(r["expert_tokens"]) == 2 * tokens == sum(r["rank_tokens"]), (name, r["layer"])
        # the load-balancing loss: its formula's single-process run, whatever the layout
        aux_losses, aux_params = aux_reference(data_ranks)
        for step, (got, want) in enumerate(zip(result["aux"]["losses"], aux_losses, strict=True)):
            assert abs(got - want) <= 1e-5 * abs(want), f"{name} aux step {step}: loss {got} vs {want}"
        got = load(tmp_path / name / "aux", "params")
        moved = 0.0
        for k, want in aux_params.items():
            if k.endswith(("balance_bias", "routed_share")):  # run state, not weights
                continue
            assert float((got[k] - want).abs().max()) <= 1e-5, f"{name}: aux {k}"
            moved = max(moved, float((got[k] - params[k]).abs().max()) if k in params else 0.0)
        assert moved > 1e-4, "the load-balancing loss changed nothing"
        assert result["aux"]["aux"] == pytest.approx(AUX * moe_spec().moe.num_experts * (moe_spec().num_layers - 1)
                                                     / moe_spec().moe.num_experts, rel=0.5)
        if not LAYOUTS[name].get("placements"):
            continue
        # placement changing every step gives the static placement's run
        static, moves = result["static"], result["shuffled"]["placements"]
        assert all(a != b for a, b in zip(moves, moves[1:])), "the placement did not change every step"
        replicated = {e for step in moves for hosts in step for h in hosts for e in h
                      if sum(e in other for other in hosts) > 1}
        assert replicated == set(range(moe_spec().moe.num_experts)), replicated
        p_static = load(tmp_path / name / "static", "params")
        for other in ("shuffled", "current"):  # placed every step from a rotation; every micro-batch from its load
            for step, (a, b) in enumerate(zip(result[other]["losses"], static["losses"], strict=True)):
                assert abs(a - b) <= 1e-6 * abs(b), f"{name} {other} step {step}: {a} vs {b}"
            # Another placement sums an expert's gradient in another order; AdamW carries the rounding
            # over the steps (1.2e-6 seen on some CPUs over 20), far below what one misplaced token would move
            # (~lr = 1e-3 a step): within 1e-5, as every other layout's weights.
            got = load(tmp_path / name / other, "params")
            for k, want in p_static.items():
                assert float((got[k] - want).abs().max()) <= 1e-5, f"{name}: {other} {k} after {LONG} steps"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resumed_run_places_and_balances_as_an_unbroken_one(tmp_path):
    """The last step's routed shares travel in the checkpoint: after a resume the next step's placement
    and load-balancing weights are the unbroken run's, so are the losses. (The step after the resume is the
    one that reads them: a fourth step, once in each run, added nothing.)"""
    proc = launch(2, ["resume", str(tmp_path)], script=__file__, timeout=500)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    rows = {name: [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("straight", "resumed")}
    assert [r["step"] for r in rows["resumed"]] == [1, 2, 3]
    for a, b in zip(rows["straight"], rows["resumed"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-6)
    routing = {name: [json.loads(x) for x in (tmp_path / name / "routing.jsonl").read_text().splitlines()]
               for name in ("straight", "resumed")}
    assert [r["placement"] for r in routing["straight"]] == [r["placement"] for r in routing["resumed"]]


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    worker(Path(sys.argv[2]), sys.argv[3:])
elif __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "resume":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    resume_worker(Path(sys.argv[2]))
