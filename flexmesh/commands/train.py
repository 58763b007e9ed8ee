"""``flexmesh train``: run a Plan on a corpus with torch.distributed (see docs/cli-train.md).

Three ways to start it:

- ``torchrun --nproc-per-node 4 -m flexmesh train --plan plan.json --corpus DIR --max-steps N --out DIR``
- ``flexmesh train --nproc 4 ...``: launches that torchrun command itself (one node);
- ``flexmesh train ...`` with neither: a single process (the plan must be for one rank).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

from flexmesh.errors import PlanError


POLICY_CHOICES = ("fixed", "balanced", "hdp", "milp")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a model with a plan's parallel layout",
                              description="Train a Llama-family model on a corpus with the layout of a Plan.")
    p.add_argument("--plan", required=True, help="plan.json written by `flexmesh plan`")
    p.add_argument("--corpus", required=True, help="folder of text files, a .jsonl file with a text field, or "
                                                    "'stdlib' (this Python's standard-library sources)")
    p.add_argument("--max-steps", type=int, required=True, help="optimizer steps to run (in total, across resumes)")
    p.add_argument("--out", required=True, help="output folder: metrics.jsonl and checkpoints/")
    p.add_argument("--model", help="model preset or config.json (default: the plan's model)")
    p.add_argument("--tokenizer", help="a tokenizer.json; default: train a byte-level BPE of the model's vocab, cached")
    p.add_argument("--weights", help="Hugging Face safetensors file or *.safetensors.index.json to start from")
    p.add_argument("--nproc", type=int, help="launch torchrun with this many processes on this node")
    p.add_argument("--policy", default="fixed", choices=POLICY_CHOICES,
                   help="per-step scheduling policy (default: fixed)")
    p.add_argument("--adaptive", action="store_true",
                   help="never wait for a late schedule: run --fallback-policy's for that step instead")
    p.add_argument("--fallback-policy", default="hdp", choices=POLICY_CHOICES,
                   help="policy of a step whose --policy schedule is late, with --adaptive (default: hdp)")
    p.add_argument("--cp", type=int, help="static context-parallel group size for fixed and balanced "
                                          "(default: the plan's cp when above 1, else the smallest that fits)")
    p.add_argument("--hardware-profile", metavar="PATH",
                   help="price schedules with this `flexmesh profile hardware` file (default: the plan's cluster preset)")
    p.add_argument("--model-profile", metavar="PATH", help="price schedules with this `flexmesh profile model` file")
    p.add_argument("--global-batch", type=int, help="documents per step (default: the plan's global_batch)")
    p.add_argument("--max-len", type=int, help="truncate documents to this many tokens (default: the plan's seq_len)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    p.add_argument("--warmup", type=int, default=0, help="linear warmup steps (default 0)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr (default 0.1)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm; 0 disables (default 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out")
    p.add_argument("--cache-dir", help="where tokenizers and token stores are cached")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.set_defaults(func=run)
    return p


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    """This process's environment for a child that launches its own ranks (torchrun, ``flexmesh train
    --nproc``): without the rank variables of a launch this process may be part of, and with one
    intra-op thread per process unless the caller chose otherwise."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _launch_torchrun(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Re-run this command (or ``flexmesh *argv``) under torchrun with ``--nproc`` processes (the flag itself removed)."""
    if argv is None:
        argv = sys.argv[1:] if sys.argv[1:2] == ["train"] else ["train", *sys.argv[1:]]
    forwarded, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        forwarded.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "flexmesh", *forwarded]
    return subprocess.call(cmd)


def run(args: argparse.Namespace) -> int:
    if args.nproc is not None and "LOCAL_RANK" not in os.environ:
        if args.nproc < 1:
            raise PlanError(f"--nproc must be at least 1, got {args.nproc}")
        return _launch_torchrun(args)
    if "RANK" not in os.environ:  # a plain single process: make it a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    return _train(args)


def make_schedule_fn(plan, spec, policy: str, max_len: int, seed: int = 0, *, cost=None, cp: int | None = None):
    """``lengths -> StepSchedule`` for the named policy over the plan's data ranks.

    Groups may take any power-of-two size the policy picks (``hdp``, ``milp``); ``fixed`` and
    ``balanced`` use one static size: ``cp``, else the plan's cp when above 1, else the smallest group
    holding the longest sequence. Micro-batches hold at most ``max_len`` tokens per rank (the
    context the plan is for; a longer sequence on a larger group keeps its own). ``cost`` is the CostModel the policy consults (for instance one
    built from profiles); default: the plan's cluster preset. Each schedule's ``predicted_step_time``
    is the step simulator's (flexmesh.sim.simulate_step on the same context), which the runtime
    reports beside the measured time. The function carries ``.policy`` and ``.context`` (the
    ScheduleContext).

    >>> from flexmesh.layout.plan import Plan, StagePlan
    >>> from flexmesh.layout.strategy import LayerStrategy
    >>> from flexmesh.spec.model import parse_model
    >>> spec = parse_model("llama2-7b")
    >>> st = StagePlan(0, 32, (LayerStrategy.parse("tp1-dp8z3"),) * 32)
    >>> plan = Plan("llama2-7b", "8xA100-80GB", 8, 1, "1f1b", 1, 4096, 8, (st,))
    >>> fn = make_schedule_fn(plan, spec, "hdp", 16384)
    >>> [g.cp for g in fn([12000] + [400] * 6 + [2000] * 8).groups]  # 12000 tokens need 2+ ranks
    [4, 1, 1, 1, 1]
    """
    from dataclasses import replace

    from flexmesh.cost import CostModel
    from flexmesh.layout.mesh import context_kind, layout_from_plan
    from flexmesh.schedule.context import ScheduleContext
    from flexmesh.schedule.policies import make_schedule
    from flexmesh.sim.timeline import simulate_step
    from flexmesh.spec.cluster import parse_cluster

    layout = layout_from_plan(plan)
    strategy = replace(plan.layer_strategies()[0], cp=1, cp_kind="none", dp=1)
    ctx = ScheduleContext(cost=cost if cost is not None else CostModel(spec, parse_cluster(plan.cluster)),
                          base=strategy, num_ranks=layout.data_ranks, pp=plan.pp, pipeline_schedule=plan.pipeline_schedule,
                          cp_kind=context_kind(spec, layout), microbatch_tokens=max_len)
    options: dict = {}
    if policy in ("fixed", "balanced"):
        static = cp if cp is not None else (layout.cp if layout.cp > 1 else None)
        if static is not None:
            options["cp"] = static
    if policy == "fixed":
        options["context"] = max_len

    def schedule_fn(lengths):
        schedule = make_schedule(policy, lengths, ctx, seed=seed, **options)
        return replace(schedule, predicted_step_time=simulate_step(ctx, schedule, virtual_stages=plan.virtual_stages,
                                                                   ).step_time)

    schedule_fn.policy = policy
    schedule_fn.context = ctx
    return schedule_fn


def _train(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from rich.console import Console

    from flexmesh.data.corpus import stdlib_corpus
    from flexmesh.data.loader import DocumentLoader, load_corpus_tokens
    from flexmesh.errors import DataError
    from flexmesh.layout.plan import Plan
    from flexmesh.layout.mesh import layout_from_plan
    from flexmesh.runtime.adaptive import AdaptiveSource
    from flexmesh.runtime.train import TrainConfig, Trainer, fit, init_distributed
    from flexmesh.spec.model import parse_model

    plan = Plan.load(args.plan)
    spec = parse_model(args.model or plan.model)
    layout_from_plan(plan)  # reject an unsupported per-layer mix before touching the corpus
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.world_size:  # before joining: a wrong launch should not wait for peers
        raise PlanError(f"plan {args.plan} is for {plan.world_size} ranks but {world} were launched; use "
                        f"--nproc {plan.world_size} (or torchrun --nproc-per-node {plan.world_size}), or re-plan")
    corpus = stdlib_corpus() if args.corpus == "stdlib" else args.corpus
    corpus_tokens, tok = load_corpus_tokens(corpus, args.tokenizer, vocab_size=spec.vocab, cache_dir=args.cache_dir)
    if tok.get_vocab_size() > spec.vocab:
        raise DataError(f"tokenizer has {tok.get_vocab_size()} tokens but model {spec.name!r} only {spec.vocab}; use a "
                        "tokenizer with at most that many tokens, or drop --tokenizer to train one")
    max_len = args.max_len or plan.seq_len
    loader = DocumentLoader(corpus_tokens, global_batch=args.global_batch or plan.global_batch, max_len=max_len,
                            seed=args.seed)
    cost = None  # the plan's cluster preset prices schedules unless profiles are given
    if args.hardware_profile or args.model_profile:
        from flexmesh.profile.use import cost_model_from_profiles
        from flexmesh.spec.cluster import parse_cluster

        cost = cost_model_from_profiles(spec, hardware=args.hardware_profile, model=args.model_profile,
                                        world=plan.world_size,
                                        cluster=None if args.hardware_profile else parse_cluster(plan.cluster))
    schedule_fn = make_schedule_fn(plan, spec, args.policy, max_len, args.seed, cp=args.cp, cost=cost)
    fallback_fn = make_schedule_fn(plan, spec, args.fallback_policy, max_len, args.seed, cp=args.cp, cost=cost)

    config = TrainConfig(max_steps=args.max_steps, lr=args.lr, warmup_steps=args.warmup,
                         min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                         seed=args.seed, checkpoint_every=args.checkpoint_every, out_dir=args.out,
                         resume=not args.no_resume, progress=not args.no_progress)
    init_distributed()
    try:
        trainer = Trainer(plan, spec, config, weights=args.weights)
        # Rank 0 schedules step k+1 while step k trains and broadcasts it; with --adaptive a late
        # schedule is replaced by the fallback policy's instead of waited for.
        source = AdaptiveSource(loader, schedule_fn, fallback_fn, deadline_s=0.0 if args.adaptive else None)
        history = fit(trainer, source, config)
        if dist.get_rank() == 0 and history:
            last = history[-1]
            Console().print(f"step {last.step}: loss {last.loss:.4f}, {last.tokens_per_s:,.0f} tokens/s; "
                            f"metrics in {os.path.join(args.out, 'metrics.jsonl')}", highlight=False)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
