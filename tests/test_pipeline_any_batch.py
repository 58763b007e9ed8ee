"""Pipelined plans train on any data: a pp 4 plan, 5 steps with every policy `flexmesh train` offers, on
a corpus of long documents, each cut to the sequence cap (batches of as many micro-batches as stages,
one with ``chunked``), and on a corpus of many tiny documents (whole batches that pack into fewer
micro-batches than the pipeline has stages). Every policy gives the same losses: the schedules differ,
the batches and the math do not.
(Four stages hold a first, middle and last stage; a pp 2 plan, once run beside it, exercised no other
path. Each corpus gives every step of a policy the same micro-batch count, which the test checks: more
steps, once 20, repeated the same shapes; five carry each step's update into the next losses. The long
documents were once the standard library's, whose tokeniser alone took half a minute of CPU: every
batch of it was eight cut documents too.)

Each launch runs the train command's own pieces (its scheduler, loader, config, Trainer, the
background AdaptiveSource and fit) in one process group, once per distinct run: every policy schedules
each corpus's five batches here, and a policy whose schedules are another's (the same documents in the
same groups and micro-batches: on these corpora most policies make fixed's) gets that run's losses, as
the ranks would step through it alike. This file is also the worker.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import launch

from flexmesh.schedule.registry import RUNTIME_POLICIES

POLICIES = tuple(str(p) for p in RUNTIME_POLICIES if p != "shares")  # shares needs several replica groups
STEPS = 5


def _inputs(tmp: Path, pp: int) -> tuple[Path, Path]:
    """A 4-layer Llama config, a plan of ``pp`` stages (world ``pp``, 4 micro-batches of a batch of 8), a
    corpus of 40 documents of 150 to 400 words (each longer than the 96-token cap) and one of 400
    documents of 1 to 6 words (a batch of 8 of them fits one 96-token micro-batch)."""
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    cfg = tmp / "config.json"
    cfg.write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 320, "torch_dtype": "float32",
        "max_position_embeddings": 512}))
    s = LayerStrategy.parse("tp1-dp1z0")
    per = 4 // pp
    stages = tuple(StagePlan(i * per, (i + 1) * per, (s,) * per) for i in range(pp))
    plan = Plan.uniform(model=str(cfg), cluster=f"{pp}xA100-80GB", world_size=pp, pp=pp, pipeline_schedule="1f1b",
                        num_microbatches=4, seq_len=96, global_batch=8, stages=stages)
    plan.save(tmp / "plan.json")
    rng = random.Random(0)
    long = tmp / "long"
    long.mkdir()
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly boxing pipeline "
             "stage gradient token document schedule").split()
    for i in range(40):
        (long / f"d{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(150, 400))))
    tiny = tmp / "tiny"
    tiny.mkdir()
    for i in range(400):
        words = [rng.choice(["a", "bc", "def", "g"]) for _ in range(rng.randint(1, 6))]
        (tiny / f"d{i:03d}.txt").write_text(" ".join(words))
    return tmp / "plan.json", tiny


class Counted:
    """A step scheduler that keeps each schedule it makes and its micro-batch count (rank 0 makes them)."""

    def __init__(self, fn) -> None:
        self.fn, self.counts, self.made = fn, [], []

    def __call__(self, lengths):
        schedule = self.fn(lengths)
        self.counts.append(max(len(g.microbatches) for g in schedule.groups))
        self.made.append(schedule)
        return schedule

    def __getattr__(self, name: str):
        return getattr(self.fn, name)


def _train_args(tmp: Path, corpus: str, policy: str) -> list[str]:
    return ["train", "--plan", str(tmp / "plan.json"), "--corpus", str(tmp / corpus), "--out",
            str(tmp / "runs" / f"{corpus}-{policy}"), "--max-steps", str(STEPS), "--policy", policy, "--no-progress"]


def schedules(tmp: Path, corpus: str, policy: str) -> list:
    """The ``STEPS`` schedules ``policy`` makes of ``corpus``'s batches, as the train command makes them:
    per step the documents' lengths and the groups (what the ranks run)."""
    from flexmesh.commands import train
    from flexmesh.commands.train_job import scheduler, train_job
    from flexmesh.layout.plan import load_plan
    from flexmesh.spec.model import parse_model

    parser = argparse.ArgumentParser()
    train.add_parser(parser.add_subparsers())
    args = parser.parse_args(_train_args(tmp, corpus, policy))
    plan = load_plan(args.plan)
    job = train_job(args, plan, parse_model(plan.model))
    fn = scheduler(job, policy, args.seed, args.cp)
    loader = train.document_loader(args, job)
    out = []
    for _ in range(STEPS):
        lengths = [len(d) for d in next(loader)]
        out.append((tuple(lengths), fn(lengths).groups))
    return out


def worker(tmp: Path, runs: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from flexmesh.commands import train
    from flexmesh.commands.train_job import scheduler, train_job
    from flexmesh.layout.plan import load_plan
    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.adaptive import AdaptiveSource
    from flexmesh.runtime.train.loop import fit
    from flexmesh.runtime.train.trainer import Trainer
    from flexmesh.spec.model import parse_model

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    train.add_parser(parser.add_subparsers())
    init_distributed(timeout_s=300)
    losses: dict = {}
    try:
        for run in runs:
            corpus, policy = run.split("-")
            args = parser.parse_args(_train_args(tmp, corpus, policy))
            plan = load_plan(args.plan)
            spec = parse_model(plan.model)
            job = train_job(args, plan, spec)
            schedule_fn = Counted(scheduler(job, policy, args.seed, args.cp))
            # without a run folder: the losses are what is compared, and the final checkpoint of each run
            # was a tenth of this file's CPU (pipeline checkpoints: tests/test_resume_layouts.py)
            config = replace(train.train_config(args), out_dir=None)
            trainer = Trainer(plan, spec, config)
            source = AdaptiveSource(train.document_loader(args, job), schedule_fn, schedule_fn)
            history = fit(trainer, source, config)
            losses[run] = {"loss": [m.loss for m in history], "microbatches": schedule_fn.counts,
                           "groups": [repr(s.groups) for s in schedule_fn.made[:STEPS]]}
        if dist.get_rank() == 0:
            (tmp / "losses.json").write_text(json.dumps(losses))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("pp", [4])
def test_pipelines_train_any_batch_with_every_policy(tmp_path, pp):
    _inputs(tmp_path, pp)
    made = {f"{corpus}-{policy}": schedules(tmp_path, corpus, policy) for corpus in ("long", "tiny")
            for policy in POLICIES}
    first: dict = {}
    ran_as = {name: first.setdefault(tuple(steps), name) for name, steps in made.items()}
    assert ran_as["long-chunked"] == "long-chunked"  # one run whose schedules differ from fixed's
    distinct = sorted(set(ran_as.values()))
    proc = launch(pp, ["worker", str(tmp_path), *distinct], script=__file__, timeout=1400)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    runs = json.loads((tmp_path / "losses.json").read_text())
    for name in distinct:  # the ranks' schedulers made the schedules these runs stand for
        assert runs[name]["groups"] == [repr(groups) for _, groups in made[name]], name
    counts = {name: [max(len(g.microbatches) for g in groups) for _, groups in steps] for name, steps in made.items()}
    for corpus in ("long", "tiny"):
        reference = runs[ran_as[f"{corpus}-fixed"]]["loss"]
        assert len(reference) == STEPS
        for policy in POLICIES:  # every policy, every step: the same batch, the same loss
            run = runs[ran_as[f"{corpus}-{policy}"]]
            assert run["loss"] == pytest.approx(reference, rel=1e-4), (corpus, policy)
    # what the two corpora are for: schedules of as many micro-batches as stages, and of fewer
    assert set(counts["long-fixed"]) == {pp} == set(runs["long-fixed"]["microbatches"])
    assert all(0 < n < pp for policy in POLICIES for n in counts[f"tiny-{policy}"])


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    worker(Path(sys.argv[2]), sys.argv[3:])
