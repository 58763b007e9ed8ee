"""Documents cut into pieces train exactly as whole documents (flexmesh.runtime.model.carry).

- In one process: the model fed a document's pieces in 2 or 3 micro-batches, keys and values
  carried, gives the loss and gradients of the whole document (also with sliding windows and
  activation checkpointing); without the carry it does not.
- The rule of what the runtime can carry (flexmesh.layout.step.carries_pieces / check_cuts), and a
  property test that no policy cuts a sequence where the runtime cannot keep it exact.
- Under torchrun (gloo, CPU, fp32): the trainer on cut documents over micro-batches with dp 1 and
  dp 2 (ZeRO-2, and ZeRO-3 whose ranks run in lockstep), and on context-parallel groups of 2 (Ulysses,
  ring), gives the losses and gradients of a single process that never cuts (1e-5).
- `flexmesh train --policy chunked` runs and its first loss is the `fixed` policy's.

This file is also the torchrun worker (``python tests/test_cut_documents.py worker OUT LAYOUT...``).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import flexmesh_ranks, launch, reference_training, tiny_spec, train_config, write_inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if __name__ == "__main__":  # a torchrun worker: the repository is not installed on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flexmesh.errors import ScheduleError
from flexmesh.layout.step import Group, Piece, StepSchedule, carries_pieces

WINDOW_SPEC = dict(sliding_window=9, window_layers=(True, False, True, True))


# ---- one process ----------------------------------------------------------------------------------
def _docs(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, int(n)) for n in (60, 13, 40, 7, 22)]


CUTS = {  # micro-batches of one group: document 0 (60 tokens) in 2 or 3 pieces, document 2 in 2
    "two": ((Piece(1, 0, 13), Piece(0, 0, 31)), (Piece(0, 31, 60), Piece(2, 0, 40)), (Piece(3, 0, 7), Piece(4, 0, 22))),
    "three": ((Piece(1, 0, 13), Piece(0, 0, 20), Piece(2, 0, 17)), (Piece(0, 20, 35), Piece(3, 0, 7)),
              (Piece(2, 17, 40), Piece(0, 35, 60), Piece(4, 0, 22))),
    "same_row": ((Piece(0, 0, 20), Piece(1, 0, 13), Piece(0, 20, 45)), (Piece(0, 45, 60), Piece(2, 0, 40)),
                 (Piece(3, 0, 7), Piece(4, 0, 22))),
}


def _loss(model, batch, n):
    import torch.nn.functional as F

    return F.cross_entropy(model(batch.tokens, batch)[0], batch.labels[0], reduction="sum") / n


@pytest.mark.parametrize("detached", [False, True])
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("recompute", ["none", "block", "core"])
@pytest.mark.parametrize("cut", sorted(CUTS))
def test_carried_pieces_give_the_whole_documents_loss_and_gradients(cut, recompute, window, detached):
    """Attached store: one backward per chain. Detached store (pipelines): one backward per
    micro-batch, a chain's in reverse, the later pieces handing back their keys' gradients."""
    import torch

    from flexmesh.layout.pipeline_order import chain_plan
    from flexmesh.runtime.model.carry import KVCarry
    from flexmesh.runtime.model.packing import pack_microbatch
    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.parallel.parallelize import apply_ac

    spec = replace(tiny_spec(), **WINDOW_SPEC) if window else tiny_spec()
    docs = _docs()
    n = sum(len(d) - 1 for d in docs)
    ref = build_model(spec, "cpu")
    whole = _loss(ref, pack_microbatch(docs, tuple(Piece(i, 0, len(d)) for i, d in enumerate(docs))), n)
    whole.backward()

    group = Group((0,), CUTS[cut])
    StepSchedule(tuple(len(d) for d in docs), (group,), "test").validate(1)
    model = build_model(spec, "cpu")
    if recompute == "block":
        apply_ac(model, (True,) * spec.num_layers)
    elif recompute == "core":
        for layer in model.layers.values():
            layer.attention.recompute_core = True
    store, (keep, ends) = KVCarry(detached=detached), chain_plan(group)
    assert not ends[0]  # document 0 continues past the first micro-batch
    total, chain = 0.0, []
    for mb, kept, end in zip(group.microbatches, keep, ends, strict=True):
        b = pack_microbatch(docs, mb)
        chain.append(_loss(model, replace(b, carry=store.view(b.segments, kept)), n))
        if end:  # as the trainer: one backward per chain of micro-batches, or each in reverse
            for loss in ([sum(chain)] if not detached else reversed(chain)):
                loss.backward()
                total += loss.item()
            chain.clear()
            store.clear()
    assert abs(total - whole.item()) <= 1e-5 * whole.item()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    # the carry is what makes it exact: the pieces alone give other gradients
    alone = build_model(spec, "cpu")
    sum(_loss(alone, pack_microbatch(docs, mb), n) for mb in group.microbatches).backward()
    with pytest.raises(AssertionError):
        for p, q in zip(alone.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_detached_carry_refuses_backwards_in_forward_order():
    """Under a pipeline a cut document's backwards must run in reverse; in forward order the later
    piece's gradient would reach the earlier piece's keys too late, so it raises instead of losing it."""
    from flexmesh.layout.pipeline_order import chain_plan
    from flexmesh.runtime.model.carry import KVCarry
    from flexmesh.runtime.model.packing import pack_microbatch
    from flexmesh.runtime.model.transformer import build_model

    docs, group = _docs(), Group((0,), CUTS["two"])
    model, store = build_model(tiny_spec(), "cpu"), KVCarry(detached=True)
    losses = []
    for mb, kept in zip(group.microbatches[:2], chain_plan(group)[0]):
        b = pack_microbatch(docs, mb)
        losses.append(_loss(model, replace(b, carry=store.view(b.segments, kept)), 100))
    losses[0].backward()
    with pytest.raises(ScheduleError, match=r"document 0: piece \[0, 31\) ran its backward before a later piece's"):
        losses[1].backward()


def test_attention_charge_is_the_pairs_a_carried_slice_attends():
    """cost.work.attention_sq charges a slice [a, b) what its queries see: 2 x causal pairs - queries."""
    import torch

    from flexmesh.cost.training.work import attention_sq
    from flexmesh.runtime.model.attention import window_causal

    for a, b, w in ((0, 40, None), (25, 60, None), (45, 60, None), (25, 60, 9), (3, 7, 9), (0, 40, 9)):
        pairs = int(window_causal(torch.arange(a, b)[:, None], torch.arange(0, b)[None, :], w).sum())
        assert attention_sq(float(a), float(b), (w,)) == pytest.approx(2 * pairs - (b - a))


def test_check_cuts_names_the_sequence_the_runtime_cannot_carry():
    ok = StepSchedule((10, 5), (Group((0,), ((Piece(0, 0, 4), Piece(1, 0, 5)), (Piece(0, 4, 10),))),), "t")
    ok.check_cuts()  # with or without a pipeline
    with pytest.raises(ScheduleError, match=r"sequence 0 is cut over micro-batches \[0, 1\] .* dynamic RoPE"):
        ok.check_cuts(dynamic_rope=True)
    whole = StepSchedule((10, 5), (Group((0,), ((Piece(0, 0, 4), Piece(0, 4, 10)), (Piece(1, 0, 5),))),), "t")
    whole.check_cuts(dynamic_rope=True)  # adjacent pieces in one micro-batch form one segment: nothing to carry
    swapped = StepSchedule((10, 5), (Group((0,), ((Piece(0, 4, 10), Piece(1, 0, 5)), (Piece(0, 0, 4),))),), "t")
    with pytest.raises(ScheduleError, match=r"sequence 0: piece \[0, 4\) .* in order"):
        swapped.check_cuts()
    split = StepSchedule((10, 5), (Group((0,), ((Piece(0, 0, 4), Piece(1, 0, 5)),)),
                                   Group((1,), ((Piece(0, 4, 10),),))), "t")
    with pytest.raises(ScheduleError, match=r"sequence 0 is cut over the groups of data ranks \[0\] and \[1\]"):
        split.check_cuts()
    assert carries_pieces() and not carries_pieces(dynamic_rope=True)


@st.composite
def _policy_batches(draw):
    from flexmesh.schedule.registry import POLICIES
    from flexmesh.schedule.testing import tiny_context

    policy = str(draw(st.sampled_from(sorted(POLICIES))))
    pp = draw(st.sampled_from([1, 2]))
    base = tiny_context(draw(st.sampled_from([2, 4, 8])), pp=pp)
    ctx = replace(base, cut_documents=carries_pieces())  # as the runtime's scheduler builds it
    top = ctx.max_tokens(ctx.group_sizes[-1])
    short = draw(st.lists(st.integers(1, max(1, top // 64)), max_size=30))
    long = draw(st.lists(st.integers(1, top), min_size=1, max_size=3))
    return policy, pp, ctx, draw(st.permutations(short + long))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_policy_batches())
def test_no_policy_cuts_a_sequence_the_runtime_cannot_keep_exact(case):
    from flexmesh.schedule.registry import make_schedule

    policy, pp, ctx, lens = case
    s = make_schedule(policy, lens, ctx, **({"node_limit": 50} if policy == "milp" else {}))
    s.validate(ctx.num_ranks)
    s.check_cuts()  # one group per sequence, pieces in order
    if not ctx.cut_documents:
        assert all(p.start == 0 and p.end == s.lengths[p.seq_id] for g in s.groups for mb in g.microbatches for p in mb)


# ---- torchrun: the trainer ------------------------------------------------------------------------
LAYOUTS = {  # name -> (world, per-layer strategies)
    "dp1": (1, ["tp1-dp1z0", "tp1-dp1z0-ac", "tp1-dp1z0", "tp1-dp1z0"]),
    "dp2_z2": (2, ["tp1-dp2z2"] * 4),
    "dp2_z3": (2, ["tp1-dp2z3", "tp1-dp2z3-ac", "tp1-dp2z3", "tp1-dp2z3"]),
    "ulysses": (2, ["tp1-u2-dp1z3"] * 4),
    "ring": (2, ["tp1-r2-dp1z0", "tp1-r2-dp1z0-ac", "tp1-r2-dp1z0", "tp1-r2-dp1z0"]),
}
STEPS = 2


def make_plan(name: str):
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    world, strategies = LAYOUTS[name]
    st_ = StagePlan(0, 4, tuple(LayerStrategy.parse(s) for s in strategies))
    return Plan.uniform(model="test-tiny", cluster="cpu", world_size=world, pp=1, pipeline_schedule="1f1b",
                num_microbatches=1, seq_len=256, global_batch=8, stages=(st_,))


def cut_steps(groups: int, cp: int) -> list:
    """STEPS steps: document 0 (60 tokens) cut in 3 pieces, document 1 (40) in 2, over micro-batches
    of one group each; with two groups their chains differ (and so do their micro-batch counts)."""
    out = []
    for step in range(STEPS):
        rng = np.random.default_rng(11 + step)
        docs = [rng.integers(1, 256, n) for n in (60, 40, 9, 17, 30, 5, 12)]
        a, b = (Piece(0, 0, 25), Piece(0, 25, 45), Piece(0, 45, 60)), (Piece(1, 0, 22), Piece(1, 22, 40))
        s = [Piece(i, 0, len(docs[i])) for i in range(2, 7)]
        if groups == 1:
            mbs = [[s[0], a[0]], [a[1], b[0]], [a[2], s[1]], [b[1], s[2], s[3]], [s[4]]]
            layout = [(tuple(range(cp)), mbs)]
        else:
            layout = [((0,), [[s[0], a[0]], [a[1]], [s[1], a[2]], [s[2]]]),
                      ((1,), [[b[0], s[3]], [s[4]], [b[1]]])]
        sched = StepSchedule(tuple(len(d) for d in docs), tuple(
            Group(ranks, tuple(tuple(mb) for mb in mbs)) for ranks, mbs in layout), "test")
        sched.validate(groups * cp)
        out.append((docs, sched))
    return out


def steps_for(name: str) -> list:
    from flexmesh.layout.mesh import layout_from_plan

    lay = layout_from_plan(make_plan(name))
    return cut_steps(lay.dp, lay.cp)


def reference(steps: list) -> tuple[list[float], dict]:
    """One process, documents whole (flexmesh.runtime.train.reference): losses and step 1's clipped gradients."""
    losses, _, grads, _ = reference_training(steps)
    return losses, grads

def worker(out: Path, names: list[str]) -> None:
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
            trainer = Trainer(make_plan(name), tiny_spec(), train_config())
            steps = steps_for(name)
            result: dict = {"losses": []}
            if trainer.layout.dp == 2:  # one document over two groups: refused before any collective
                docs, sched = steps[0]
                g0, g1 = sched.groups
                moved = (Group(g0.ranks, g0.microbatches[:-2] + (g0.microbatches[-2][:1],)),
                         Group(g1.ranks, g1.microbatches + (g0.microbatches[-2][1:], g0.microbatches[-1])))
                try:
                    trainer.step(docs, replace(sched, groups=moved))
                except ScheduleError as e:
                    result["cross_group_error"] = str(e)
            for i, (docs, sched) in enumerate(steps):
                result["losses"].append(trainer.step(docs, sched).loss)
                if i == 0:
                    grads = {}
                    for k, p in trainer.inner_models()[0].named_parameters():
                        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                        grads[canonical_name(k)] = g.detach().cpu().clone()
            result["carried_left"] = len(trainer.carry)
            if dist.get_rank() == 0:
                (out / name).mkdir(parents=True, exist_ok=True)
                torch.save(grads, out / name / "grads.pt")
                (out / name / "result.json").write_text(json.dumps(result))
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [1, 2])
def test_trainer_on_cut_documents_matches_the_whole_documents(tmp_path, world):
    import torch

    names = [n for n, (w, _) in LAYOUTS.items() if w == world]
    proc = launch(world, ["worker", str(tmp_path), *names], script=__file__)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for name in names:
        result = json.loads((tmp_path / name / "result.json").read_text())
        want_losses, want_grads = reference(steps_for(name))
        for step, (got, want) in enumerate(zip(result["losses"], want_losses, strict=True)):
            assert abs(got - want) <= 1e-5 * want, f"{name} step {step}: loss {got} vs whole documents {want}"
        grads = torch.load(tmp_path / name / "grads.pt")
        assert set(grads) == set(want_grads)
        for k, want in want_grads.items():
            torch.testing.assert_close(grads[k], want, rtol=1e-5, atol=1e-6, msg=f"{name} gradient {k}")
        assert result["carried_left"] == 0  # the store is emptied at every chain's end
        if name.startswith("dp2"):
            assert "sequence 0 is cut over the groups of data ranks [0] and [1]" in result["cross_group_error"]


# ---- the train command ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_train_policy_chunked_runs_and_starts_at_the_fixed_policys_loss(tmp_path):
    from flexmesh.data.loader import DocumentLoader, load_corpus_tokens
    from flexmesh.layout.plan import Plan
    from flexmesh.schedule.scheduler import Scheduler
    from flexmesh.spec.model import parse_model

    _, corpus, plan_path = write_inputs(tmp_path, world=2)
    cache = tmp_path / "cache"
    losses = {}
    for policy, steps in (("chunked", 3), ("fixed", 1)):
        out = tmp_path / policy
        proc = flexmesh_ranks(2, "train", "--plan", str(plan_path), "--corpus", str(corpus), "--out", str(out),
                              "--cache-dir", str(cache), "--no-progress", "--max-steps", str(steps), "--policy", policy,
                              timeout=400)  # the command's ranks, from the fork server
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["policy"] for r in rows] == [policy] * steps
        losses[policy] = [r["loss"] for r in rows]
    plan = Plan.load(plan_path)
    spec = parse_model(plan.model)
    assert all(0 < x < 2 * math.log(spec.vocab) for x in losses["chunked"]), losses  # finite, near ln(vocab)
    assert abs(losses["chunked"][0] - losses["fixed"][0]) <= 1e-5 * losses["fixed"][0], losses
    # the first step really cut documents: the same batch, scheduled as the command schedules it
    tokens, _ = load_corpus_tokens(str(corpus), None, vocab_size=spec.vocab, cache_dir=cache)
    docs = next(DocumentLoader(tokens, global_batch=plan.global_batch, max_len=plan.seq_len, seed=0))
    first = Scheduler(plan, spec, "chunked", plan.seq_len, 0)([len(d) for d in docs])
    assert any(p.start > 0 for g in first.groups for mb in g.microbatches for p in mb)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    worker(Path(sys.argv[2]), sys.argv[3:])
