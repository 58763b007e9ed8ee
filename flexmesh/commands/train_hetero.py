"""``flexmesh train`` on a heterogeneous plan (version 3, flexmesh.layout.hetero.HeteroPlan).

Called by flexmesh.commands.train when the plan file is one; the launch (``--nproc``, torchrun), the
output folder, resume and metrics are the uniform run's. What differs: replica ``i`` takes its
``batch`` documents of each global batch (no per-step scheduling policy), and the runtime is
flexmesh.runtime.hetero.HeteroTrainer (docs/cli-train.md#heterogeneous-plans).
"""

from __future__ import annotations

import argparse
import os
import signal

from flexmesh.errors import PlanError
from flexmesh.layout.hetero import HeteroPlan

# Flags of the uniform run that choose per-step schedules or price them; a heterogeneous plan fixes
# each replica's share itself. (flag, attribute, the value that means "not given")
_NOT_FOR_HETERO = (("--policy", "policy", "fixed"), ("--adaptive", "adaptive", False), ("--cp", "cp", None),
                   ("--hardware-profile", "hardware_profile", None), ("--model-profile", "model_profile", None))


def check_flags(args: argparse.Namespace, plan: HeteroPlan) -> None:
    """Refuse flags a heterogeneous run cannot honour, naming the first."""
    for flag, attr, unset in _NOT_FOR_HETERO:
        if getattr(args, attr, unset) != unset:
            raise PlanError(f"{flag} does not apply to a heterogeneous plan: each replica takes its plan's share of "
                            "the global batch; drop the flag")
    if args.global_batch is not None and args.global_batch != plan.global_batch:
        raise PlanError(f"--global-batch {args.global_batch} differs from the plan's {plan.global_batch}, which its "
                        "replicas' batches add up to; drop the flag or re-plan")
    if getattr(args, "emulate_speed", None):
        raise PlanError("--emulate-speed is not supported with a heterogeneous plan yet; drop the flag")


def train_hetero(args: argparse.Namespace, plan: HeteroPlan) -> int:
    import torch.distributed as dist
    from rich.console import Console

    from flexmesh.commands.migrate import RESHARD_ENV
    from flexmesh.data.corpus import stdlib_corpus
    from flexmesh.data.loader import DocumentLoader, load_corpus_tokens
    from flexmesh.errors import DataError
    from flexmesh.plan.check import check_model
    from flexmesh.runtime.adaptive import AdaptiveSource
    from flexmesh.runtime.config import TrainConfig
    from flexmesh.runtime.distributed import init_distributed
    from flexmesh.runtime.hetero import HeteroTrainer, check_runnable, hetero_schedule
    from flexmesh.runtime.loop import Preempted, fit
    from flexmesh.spec.model import parse_model

    check_flags(args, plan)
    spec = parse_model(args.model or plan.model)
    check_model(plan, spec, by_name=False)  # type: ignore[arg-type]  # reads only plan.model
    check_runnable(plan, spec)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.world_size:  # before joining: a wrong launch should not wait for peers
        raise PlanError(f"plan {args.plan} is for {plan.world_size} ranks but {world} were launched; use "
                        f"--nproc {plan.world_size} (or torchrun --nproc-per-node {plan.world_size}), or re-plan")
    corpus = stdlib_corpus() if args.corpus == "stdlib" else args.corpus
    corpus_tokens, tok = load_corpus_tokens(corpus, args.tokenizer, vocab_size=spec.vocab, cache_dir=args.cache_dir)
    if tok.get_vocab_size() > spec.vocab:
        raise DataError(f"tokenizer has {tok.get_vocab_size()} tokens but model {spec.name!r} only {spec.vocab}; use a "
                        "tokenizer with at most that many tokens, or drop --tokenizer to train one")
    loader = DocumentLoader(corpus_tokens, global_batch=plan.global_batch, max_len=args.max_len or plan.seq_len,
                            seed=args.seed)
    config = TrainConfig(max_steps=args.max_steps, lr=args.lr, warmup_steps=args.warmup,
                         min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                         seed=args.seed, checkpoint_every=args.checkpoint_every, out_dir=args.out,
                         resume=not (args.no_resume or args.overwrite), progress=not args.no_progress,
                         dtype=args.dtype, reshard_from=os.environ.get(RESHARD_ENV))
    init_distributed(timeout_s=args.collective_timeout)
    try:
        trainer = HeteroTrainer(plan, spec, config, weights=args.weights)
        split = hetero_schedule(plan)
        source = AdaptiveSource(loader, split, split, deadline_s=None)
        try:
            history = fit(trainer, source, config)  # type: ignore[arg-type]  # the Trainer's interface
        except Preempted as e:
            if dist.get_rank() == 0:
                Console(stderr=True).print(e.notice(), highlight=False)
            dist.barrier()
            return 128 + signal.SIGTERM
        if dist.get_rank() == 0 and history:
            last = history[-1]
            Console().print(f"step {last.step}: loss {last.loss:.4f}, {last.tokens_per_s:,.0f} tokens/s over "
                            f"{len(plan.replicas)} replicas; metrics in {os.path.join(args.out, 'metrics.jsonl')}",
                            highlight=False)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
