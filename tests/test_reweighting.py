"""Loss-based sample reweighting (flexmesh.data.reweighting, flexmesh.runtime.train.reweight_training,
`flexmesh train --reweight`).

What it must keep: the weights are Sow et al.'s (the batch's losses onto [-delta, delta], a strategy, a
softmax), scaled to average 1 over the step's label tokens; they come from the step's whole batch, so one
process and two data ranks (a cut document included) step exactly as a plain single-process loop that
weighs each whole document's tokens by them; the loss reported is the plain one. This file is also the
worker.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    flexmesh_here,
    flexmesh_ranks,
    launch,
    make_steps,
    tiny_spec,
    train_config,
    write_inputs,
    zero2_plan,
)

from flexmesh.data.reweighting import doc_weights, strategy_scores
from flexmesh.errors import PlanError


# ---- the weights ------------------------------------------------------------------------------------------
def test_scores_are_the_papers_strategies_on_losses_mapped_onto_plus_minus_delta():
    losses = np.array([2.0, 3.0, 4.0, 6.0])  # onto [-2, 2] with delta 2: -2, -1, 0, 2
    assert strategy_scores(losses, "linupper", 2.0).tolist() == pytest.approx([0.0, 1.0, 2.0, 2.0])
    assert strategy_scores(losses, "quadratic", 2.0).tolist() == pytest.approx([0.0, 0.75, 1.0, 0.0])
    assert strategy_scores(losses, "extremes", 2.0).tolist() == pytest.approx([2.0, 1.0, 0.0, 2.0])
    assert strategy_scores(np.array([3.0, 3.0]), "linupper", 1.0).tolist() == [1.0, 1.0]  # all x = 0
    with pytest.raises(PlanError, match="linupper"):
        strategy_scores(losses, "median", 1.0)


def test_weights_are_a_softmax_averaging_one_per_label_token():
    losses, tokens = np.array([2.0, 3.0, 4.0, 6.0, 9.0]), np.array([10, 30, 20, 5, 0])  # the last: not in the step
    w = doc_weights(losses, tokens, "linupper", 2.0)
    assert w[4] == 0.0
    soft = np.exp([0.0, 1.0, 2.0, 2.0]) / np.exp([0.0, 1.0, 2.0, 2.0]).sum()  # the paper's weights, one per sample
    assert (w[:4] / w[:4].sum()).tolist() == pytest.approx(soft.tolist(), rel=1e-12)
    assert float((w * tokens).sum()) == pytest.approx(float(tokens.sum()), rel=1e-12)
    # on documents of one length the weighted token mean is the paper's sum of weights times sample losses
    even = np.array([7, 7, 7, 7])
    we = doc_weights(losses[:4], even, "linupper", 2.0)
    assert float((we * even * losses[:4]).sum() / even.sum()) == pytest.approx(float((soft * losses[:4]).sum()))
    assert doc_weights(np.array([1.5, 1.5]), np.array([3, 9]), "quadratic", 1.0).tolist() == [1.0, 1.0]


# ---- in the trainer ---------------------------------------------------------------------------------------
def _reference(steps: list, strategy: str) -> list[dict]:
    """Plain single-process AdamW steps weighing each whole document's tokens by doc_weights of the
    documents' losses before the step."""
    import torch
    import torch.nn.functional as F

    from flexmesh.layout.step import Piece
    from flexmesh.runtime.model.packing import IGNORE_INDEX, pack_microbatch
    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.train.config import lr_schedule_factor

    cfg = train_config()
    model = build_model(tiny_spec(), device="cpu")
    model.init_weights(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_schedule_factor(s, cfg.warmup_steps, cfg.max_steps,
                                                                               cfg.min_lr_ratio))
    rows = []
    for docs, schedule in steps:
        ids = sorted({p.seq_id for g in schedule.groups for mb in g.microbatches for p in mb})
        batches = {i: pack_microbatch(docs, [Piece(i, 0, len(docs[i]))]) for i in ids}

        def ce(i: int, batches: dict = batches) -> torch.Tensor:
            b = batches[i]
            logits = model(b.tokens, b)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b.labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")

        tokens = np.zeros(len(docs), dtype=np.int64)
        losses = np.zeros(len(docs))
        model.eval()
        with torch.no_grad():
            for i in ids:
                tokens[i] = len(docs[i]) - 1
                losses[i] = float(ce(i)) / tokens[i]
        model.train()
        w = doc_weights(losses, tokens, strategy, 1.0)
        n = int(tokens.sum())
        opt.zero_grad()
        plain = 0.0
        for i in ids:
            s = ce(i)
            (s * float(w[i]) / n).backward()
            plain += float(s) / n
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        opt.step()
        sched.step()
        live = w[w > 0]
        rows.append({"loss": plain, "norm": norm, "weight": [float(live.min()), float(live.max())]})
    return rows


def worker(out: Path, strategy: str) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=60)
    world = dist.get_world_size()
    try:
        plan = zero2_plan(world)
        steps = make_steps(world, 1, 3)
        weighted = Trainer(plan, tiny_spec(), dataclasses.replace(train_config(), reweight=strategy))
        plain = Trainer(plan, tiny_spec(), train_config())
        rows = []
        for d, s in steps:
            m, n = weighted.step(d, s), plain.step(d, s)
            rows.append({"loss": m.loss, "norm": m.grad_norm, "weight": list(m.doc_weight), "plain_loss": n.loss,
                         "plain_norm": n.grad_norm})
        if dist.get_rank() == 0:
            (out / "report.json").write_text(json.dumps({"rows": rows, "want": _reference(steps, strategy)}))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,strategy", [(1, "linupper"), (2, "quadratic")])
def test_weighted_steps_are_the_single_process_weighted_loop_under_any_layout(tmp_path, world, strategy):
    proc = launch(world, ["worker", str(tmp_path), strategy], script=__file__)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    for got, want in zip(report["rows"], report["want"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-5)
        assert got["weight"] == pytest.approx(want["weight"], rel=1e-4)
        assert got["weight"][0] < 1.0 < got["weight"][1]  # the documents' losses differ: so do their weights
    first = report["rows"][0]
    assert first["loss"] == pytest.approx(first["plain_loss"], rel=1e-6)  # the same weights, the plain loss reported
    assert not math.isclose(first["norm"], first["plain_norm"], rel_tol=1e-3)  # the weighted gradient


# ---- through `flexmesh train` -----------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_train_reweight_logs_the_weights_and_refuses_what_it_cannot_run(tmp_path):
    cfg, corpus, plan = write_inputs(tmp_path, 1)
    base = ["train", "--plan", str(plan), "--model", str(cfg), "--corpus", str(corpus), "--no-progress",
            "--cache-dir", str(tmp_path / "cache")]
    run = flexmesh_ranks(1, *base, "--max-steps", "3", "--out", str(tmp_path / "run"), "--reweight", "linupper",
                         "--reweight-delta", "2", "--tensorboard")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        low, high = r["doc_weight"]
        assert 0 < low < 1 < high <= low * math.exp(2.0) * (1 + 1e-4) and r["loss"] > 0  # linupper: e^delta at most
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert [e.value for e in events.Scalars("doc_weight/max")] == pytest.approx([r["doc_weight"][1] for r in rows])
    cases = [(["--reweight-delta", "2"], "give --reweight"),
             (["--reweight", "linupper", "--reweight-delta", "0"], "above 0"),
             (["--reweight", "median"], "invalid choice")]
    for extra, said in cases:
        proc = flexmesh_here(*base, "--max-steps", "1", "--out", str(tmp_path / "o"), *extra)
        assert proc.returncode != 0 and said in proc.stderr, (extra, proc.stderr[-2000:])
        assert len([ln for ln in proc.stderr.splitlines() if ln.startswith("error") or "error:" in ln]) == 1


def test_a_pipelined_plan_or_experts_are_refused_before_the_run(tmp_path):
    from flexmesh.commands.train_data import check_evaluation
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.spec.model import parse_model

    class Args:
        eval_corpus, domains, tasks, reweight = None, None, None, "linupper"

    s = LayerStrategy.parse("tp1-dp1z0")
    piped = Plan.uniform(model="test-tiny", cluster="cpu", world_size=2, pp=2, pipeline_schedule="1f1b",
                         num_microbatches=2, seq_len=256, global_batch=8,
                         stages=(StagePlan(0, 2, (s, s)), StagePlan(2, 4, (s, s))))
    with pytest.raises(PlanError, match="--reweight weighs documents by a forward of plans with pp 1.*pipelines"):
        check_evaluation(Args(), piped, tiny_spec())
    flat = Plan.uniform(model="test-tiny", cluster="cpu", world_size=1, pp=1, pipeline_schedule="1f1b",
                        num_microbatches=1, seq_len=256, global_batch=8, stages=(StagePlan(0, 4, (s,) * 4),))
    with pytest.raises(PlanError, match="experts; drop --reweight"):
        check_evaluation(Args(), flat, parse_model("tiny-moe"))
    check_evaluation(Args(), flat, tiny_spec())  # a plain model on pp 1: runs


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker(Path(sys.argv[2]), sys.argv[3])
