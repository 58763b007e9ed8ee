"""``flexmesh train`` on a heterogeneous plan (version 3, flexmesh.layout.hetero.HeteroPlan).

Called by flexmesh.commands.train when the plan file is one; the launch (``--nproc``, torchrun), the
output folder, resume and metrics are the uniform run's. What differs: replica ``i`` takes its
``batch`` documents of each global batch (no per-step scheduling policy), and the runtime is
flexmesh.runtime.hetero.HeteroTrainer (docs/cli-train.md#heterogeneous-plans).
"""

from __future__ import annotations

import argparse

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

    from flexmesh.commands.train import check_world, document_loader, fit_and_report, train_config
    from flexmesh.plan.check import check_model
    from flexmesh.runtime.adaptive import AdaptiveSource
    from flexmesh.runtime.distributed import init_distributed
    from flexmesh.runtime.hetero import HeteroTrainer, check_runnable, hetero_schedule
    from flexmesh.spec.model import parse_model

    check_flags(args, plan)
    spec = parse_model(args.model or plan.model)
    check_model(plan, spec, by_name=False)  # type: ignore[arg-type]  # reads only plan.model
    check_runnable(plan, spec)
    check_world(args, plan)
    loader = document_loader(args, spec, plan)
    config = train_config(args)
    init_distributed(timeout_s=args.collective_timeout, device=args.device)
    try:
        trainer = HeteroTrainer(plan, spec, config, weights=args.weights)
        split = hetero_schedule(plan)
        source = AdaptiveSource(loader, split, split, deadline_s=None)
        return fit_and_report(trainer, source, config, args.out, what=f" over {len(plan.replicas)} replicas")
    finally:
        dist.destroy_process_group()
