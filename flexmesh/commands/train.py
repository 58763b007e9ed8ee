"""``flexmesh train``: run a Plan on a corpus with torch.distributed (see docs/cli-train.md).

Three ways to start it:

- ``torchrun --nproc-per-node 4 -m flexmesh train --plan plan.json --corpus DIR --max-steps N --out DIR``
- ``flexmesh train --nproc 4 ...``: launches that torchrun command itself (one node, or one launcher per
  node with ``--nnodes/--node-rank/--rdzv-endpoint``; ``--max-restarts`` restarts a failed group);
- ``flexmesh train ...`` with neither: a single process (the plan must be for one rank).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from flexmesh.commands.args import given_flags
from flexmesh.commands.train_args import add_arguments, run_dtype
from flexmesh.commands.train_data import (
    check_evaluation,
    check_inputs,
    corpus_tokens_of,
    document_loader,
    first_lengths,
    held_out,
)
from flexmesh.commands.train_domains import check_domains
from flexmesh.commands.train_job import RECOMMEND_STEPS, choose_policy, estimated_peak, scheduler, train_job
from flexmesh.commands.train_plan import Planned, check_flags, plan_run, planned_path
from flexmesh.commands.train_tasks import run_tasks, task_table
from flexmesh.errors import PlanError
from flexmesh.layout.plan import Plan
from flexmesh.runtime.endpoint import RDZV_WAIT_S, check_endpoint
from flexmesh.runtime.launch import (
    RESUME_ENV,
    STATUS_ENV,
    SUPERVISED_ENV,
    Rendezvous,
    launch_env,
    parse_rendezvous,
    relaunch_flexmesh,
    without_flags,
)
from flexmesh.runtime.state.rundir import HELD_ENV, PEER, hold_run_folder, release_run_folder, restart_count, start_over
from flexmesh.runtime.train.config import TrainConfig
from flexmesh.spec.speeds import speeds_of


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a model with a plan's parallel layout",
                              description="Train a Llama-family model on a corpus with the layout of a Plan.")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.collective_timeout <= 0:
        raise PlanError(f"--collective-timeout must be positive, got {args.collective_timeout}")
    if not 0.0 < args.straggler_threshold < 1.0:
        raise PlanError(f"--straggler-threshold must be in (0, 1), got {args.straggler_threshold}")
    check_flags(args)
    check_domains(args)
    if args.tensorboard is not None:
        from flexmesh.runtime.train.scalars import check_tensorboard

        check_tensorboard()
    if args.nproc is not None and "LOCAL_RANK" not in os.environ:
        rendezvous = parse_rendezvous(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id,
                                      args.max_restarts or 0)
        check_endpoint(rendezvous.endpoint, wait_s=args.rdzv_wait or RDZV_WAIT_S)
        _launch_flags(args)
        check_inputs(args)  # the files the ranks read, before planning (which may profile this machine first)
        planned = _planned(args)
        _preflight(args, planned)
        # Re-run this very command line under torchrun; sys.argv starts with "train" under the
        # `flexmesh` entry point, otherwise (another launcher) the command name is put back.
        argv = sys.argv[1:] if sys.argv[1:2] == ["train"] else ["train", *sys.argv[1:]]
        return _launch(args, argv, rendezvous, planned)
    planned = _planned(args)
    launcher_only = {"--max-restarts": args.max_restarts, "--nnodes": args.nnodes, "--node-rank": args.node_rank,
                     "--rdzv-endpoint": args.rdzv_endpoint, "--rdzv-id": args.rdzv_id, "--rdzv-wait": args.rdzv_wait}
    given = given_flags({flag: value is not None for flag, value in launcher_only.items()})
    if given:
        raise PlanError(f"{given[0]} is a flag of the launcher: add --nproc N (under torchrun, use torchrun's own "
                        "--max-restarts, --nnodes and --rdzv-* flags)")
    # torchrun restarted this group: the same run, so it resumes whatever was asked
    fresh = (args.no_resume or args.overwrite) and restart_count() == 0
    os.environ.update(launch_env())  # a plain single process: a world of one; stray variables: one line
    try:
        # Rank 0 writes the folder; fit takes the lock again (counted). Under a launcher, fit checks
        # that the launcher does hold it (no flag to carry out: the launcher did), else takes it.
        if os.environ.get("RANK") != "0" or (HELD_ENV in os.environ and not fresh):
            return _train(args, fresh)
        with _run_folder(args.out, args.no_resume and fresh, args.overwrite and fresh):
            _write_planned(args, planned)
            return _train(args, fresh)
    except KeyboardInterrupt:  # Ctrl-C before the training loop took over signals (flexmesh.runtime.train.loop.fit)
        if os.environ.get("RANK") == "0":
            from flexmesh.console import plain_console

            plain_console(stderr=True, soft_wrap=True).print(
                f"interrupted before the first step; resume: {resume_command()}")
        return 0 if os.environ.get(SUPERVISED_ENV) else 130


def _planned(args: argparse.Namespace) -> Planned | None:
    """Without --plan: the plan this run makes (flexmesh.commands.train_plan), or the one it made before
    (``OUT/plan.json``, which a resume trains on again); None with --plan."""
    if args.plan is not None:
        return None
    if "LOCAL_RANK" in os.environ:
        raise PlanError("train without --plan plans in its own launcher: add --nproc N (rather than torchrun), or "
                        "write a plan with `flexmesh plan` and pass --plan")
    again = planned_path(args.out)
    if again.is_file() and not (args.overwrite or args.no_resume):
        from flexmesh.layout.plan import load_plan

        return Planned(load_plan(again), f"resuming on the plan this run chose: {again}", written=True)
    return plan_run(args)


def _write_planned(args: argparse.Namespace, planned: Planned | None) -> None:
    """Inside the run folder: the plan a run without --plan chose, written to ``OUT/plan.json`` (unless it was
    read from there) and said; ``args.plan`` names it from here on."""
    if planned is None:
        return
    path = planned_path(args.out)
    if not planned.written:
        planned.plan.save(path)
    args.plan = str(path)
    if os.environ.get("RANK", "0") == "0":
        print(f"{planned.how}; plan: {path}", file=sys.stderr, flush=True)


def _launch_flags(args: argparse.Namespace) -> None:
    """What the ``--nproc`` launcher refuses of its flags alone, in one line, before anything else: flags that
    do not go together, an emulated rank outside the run, more processes than GPUs, an unusable cache folder."""
    from flexmesh.data.cache import usable_cache
    from flexmesh.runtime.parallel.device import check_launch
    from flexmesh.runtime.train.stragglers import parse_emulation

    if args.nproc < 1:
        raise PlanError(f"--nproc must be at least 1, got {args.nproc}")
    if args.migrate and args.nnodes is not None and args.nnodes.strip() not in ("1", "1:1"):
        raise PlanError("--migrate runs on one node only (one launcher relaunches the run on the new plan); "
                        "drop --migrate or --nnodes")
    if args.nnodes is None:  # one node: the world is --nproc
        parse_emulation(args.emulate_speed, args.nproc)
    check_launch(args.device, args.nproc)
    usable_cache(args.cache_dir)


def _preflight(args: argparse.Namespace, planned: Planned | None = None) -> None:
    """What the ``--nproc`` launcher refuses of the plan, in one line, before torchrun starts anything: a plan
    file that cannot be read or run, a job file or held-out corpus that cannot, predicted memory this node does
    not have (nothing is written before: the ranks write the plan)."""
    from flexmesh.layout.plan import load_plan
    from flexmesh.layout.plan_model import plan_model
    from flexmesh.runtime.parallel.device import check_memory
    from flexmesh.runtime.train.groups import check_runnable

    plan = load_plan(args.plan) if planned is None else planned.plan
    if args.nnodes is None:  # one node: the world is --nproc (several: their launchers' elastic rendezvous)
        _check_size(args.plan, plan, args.nproc)
    spec = plan_model(plan, args.model, args.plan or args.model)  # a plan (or model) that cannot run fails here
    check_runnable(plan, spec)
    run_tasks(args.tasks, args.corpus or args.domains, spec)  # a bad job file, too
    check_evaluation(args, plan, spec)
    if args.nnodes is None:
        check_memory(estimated_peak(train_job(args, plan, spec)), args.device, args.nproc)


def _launch(args: argparse.Namespace, argv: list[str], rendezvous: Rendezvous, planned: Planned | None = None) -> int:
    """Run ``argv`` under torchrun as this node's part of the run.

    The launcher of node 0 holds ``--out`` for every rank of every node, across restarts, so a
    second run fails before starting any; it carries out ``--no-resume``/``--overwrite`` once, before
    any rank starts. The ranks are not given those flags: each attempt resumes from what ``--out``
    holds (nothing on the first, the last checkpoint after a restart). Launchers of other nodes
    leave ``--out`` to node 0's (it must be the same shared folder on every node).
    """
    import shlex

    argv = without_flags(argv, (), ("--no-resume", "--overwrite"))
    env = dict(os.environ, **{"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # torchrun's default, unsaid
                              RESUME_ENV: shlex.join(["flexmesh", *argv])})
    if rendezvous.node_rank != 0:  # node 0's ranks vouch for the lock (flexmesh.runtime.train.loop.fit)
        return relaunch_flexmesh(args.nproc, argv, env={**env, HELD_ENV: PEER}, rendezvous=rendezvous)
    with _run_folder(args.out, args.no_resume, args.overwrite) as secret:
        if planned is not None:  # the ranks train on the plan written now
            _write_planned(args, planned)
            argv = [*argv, "--plan", args.plan]
        env[HELD_ENV] = secret  # what the ranks prove the hold is their launcher's with (rundir.launcher_holds)
        code = relaunch_flexmesh(args.nproc, argv, env=env, rendezvous=rendezvous)
        while code == 0 and args.migrate:  # the run stopped to move to a new plan (flexmesh.commands.migrate)
            from flexmesh.commands.migrate import RESHARD_ENV, relaunch_argv, take_request

            request = take_request(args.out)
            if request is None:
                break
            print(f"migrating: relaunching on {request['plan']} from checkpoint {request['checkpoint']}",
                  file=sys.stderr, flush=True)
            argv = relaunch_argv(argv, request["plan"])
            code = relaunch_flexmesh(args.nproc, argv, rendezvous=rendezvous, env={
                **env, RESHARD_ENV: request["checkpoint"], RESUME_ENV: shlex.join(["flexmesh", *argv])})
        return code


@contextmanager
def _run_folder(out: str, no_resume: bool, overwrite: bool) -> Iterator[str]:
    """Hold ``--out`` for the run (yields the hold's secret) and, with ``--no-resume``/``--overwrite``,
    clear it first: refuse, or move the previous run aside and say where."""
    secret = hold_run_folder(out)
    try:
        if no_resume or overwrite:
            moved = start_over(out, overwrite=overwrite)
            if moved is not None:
                from flexmesh.console import plain_console

                plain_console(stderr=True).print(f"moved the previous run in {out} to {moved} (--overwrite)",
                                                 highlight=False)
        yield secret
    finally:
        release_run_folder(out)


def check_world(path: str, plan: Plan) -> None:
    """Refuse a launch of another size than plan ``path``'s, before joining (a wrong launch should not
    wait for peers)."""
    _check_size(path, plan, int(os.environ.get("WORLD_SIZE", "1")))


def _check_size(path: str, plan: Plan, world: int) -> None:
    if world != plan.world_size:
        raise PlanError(f"plan {path} is for {plan.world_size} ranks but {world} were launched; use "
                        f"--nproc {plan.world_size} (or torchrun --nproc-per-node {plan.world_size}), or re-plan")


def train_config(args: argparse.Namespace, emulate_speed: tuple = (), resume: bool | None = None) -> TrainConfig:
    """The TrainConfig the flags describe (``resume``: unless --no-resume or --overwrite, by default)."""
    from flexmesh.commands.migrate import RESHARD_ENV

    return TrainConfig(max_steps=args.max_steps, lr=args.lr, warmup_steps=args.warmup,
                       min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                       seed=args.seed, checkpoint_every=args.checkpoint_every, async_checkpoint=args.async_checkpoint,
                       out_dir=args.out,
                       resume=not (args.no_resume or args.overwrite) if resume is None else resume,
                       progress=not args.no_progress,
                       dtype=run_dtype(args), emulate_speed=emulate_speed, reshard_from=os.environ.get(RESHARD_ENV),
                       compile=args.compile, expert_placement=args.expert_placement, expert_slots=args.expert_slots,
                       balance_rate=args.balance_rate, aux_loss=args.aux_loss, expert_lsh=args.expert_lsh,
                       reweight=args.reweight, reweight_delta=args.reweight_delta,
                       tensorboard_dir=tensorboard_dir(args))


def tensorboard_dir(args: argparse.Namespace) -> str | None:
    """Where rank 0 writes TensorBoard scalars: ``--tensorboard DIR``, ``OUT/tensorboard`` for the flag alone,
    None without it."""
    flag = getattr(args, "tensorboard", None)
    if flag is None:
        return None
    from flexmesh.runtime.state.rundir import TENSORBOARD

    return flag or os.path.join(args.out, TENSORBOARD)


def fit_and_report(trainer, source, config, out: str, what: str = "", **fit_kwargs) -> int:
    """Train on every rank (flexmesh.runtime.train.loop.fit) and say on rank 0 how it ended: the last step
    (``what`` follows its tokens/s), a hand-over to a migration (exit 0), a preemption or a Ctrl-C
    or a loss that is not finite (one line: what was saved and how to resume; exit 128 + the signal, or 1;
    under flexmesh's own launcher the ranks exit 0, so torchrun neither restarts them nor reports a
    failure, and rank 0 leaves the code for the launcher to return)."""
    import signal
    import threading

    import torch.distributed as dist

    from flexmesh.console import plain_console
    from flexmesh.files import write_atomic
    from flexmesh.runtime.train.loop import Diverged, Interrupted, Migrating, Preempted, fit

    try:
        try:
            history = fit(trainer, source, config, **fit_kwargs)
        finally:  # training is over: a signal now would only turn the rank's clean exit into a failure
            if threading.current_thread() is threading.main_thread():
                for s in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(s, signal.SIG_IGN)
    except Migrating as e:
        if dist.get_rank() == 0:
            plain_console(stderr=True).print(f"migrating after step {e.step}: predicted gain "
                                       f"{e.event.get('predicted_gain')}, new plan {e.event.get('plan')}",
                                       highlight=False)
        dist.barrier()
        return 0
    except (Preempted, Interrupted, Diverged) as e:
        code = {Preempted: 128 + signal.SIGTERM, Interrupted: 128 + signal.SIGINT, Diverged: 1}[type(e)]
        if dist.get_rank() == 0:
            line = e.notice() if isinstance(e, Preempted) else e.notice(resume_command())
            plain_console(stderr=True, soft_wrap=True).print(line, highlight=False, markup=False)
            if os.environ.get(STATUS_ENV):
                write_atomic(os.environ[STATUS_ENV], f"{code}\n")  # the launcher's own temporary file
        dist.barrier()
        return 0 if os.environ.get(SUPERVISED_ENV) else code
    if fit_kwargs.get("wall") is not None:
        fit_kwargs["wall"].finished = True  # the wall-time line follows only a run that ran to its end
    if dist.get_rank() == 0 and history:
        last = history[-1]
        plain_console(soft_wrap=True).print(f"step {last.step}: loss {last.loss:.4f}, {last.tokens_per_s:,.0f} tokens/s"
                                      f"{what}; metrics in {os.path.join(out, 'metrics.jsonl')}", highlight=False)
        if last.tasks:
            task_table(history)
    dist.barrier()
    return 0


def resume_command() -> str:
    """The command line that resumes this run: the launcher's (with ``--nproc``), else this process's;
    without ``--no-resume``/``--overwrite``, which would start over."""
    import shlex

    if os.environ.get(RESUME_ENV):
        return os.environ[RESUME_ENV]
    argv = sys.argv[1:] if sys.argv[1:2] == ["train"] else ["train", *sys.argv[1:]]
    command = shlex.join(["flexmesh", *without_flags(argv, (), ("--no-resume", "--overwrite"))])
    return command if os.environ.get("WORLD_SIZE", "1") == "1" else f"under torchrun, {command}"


def _train(args: argparse.Namespace, fresh: bool) -> int:
    """One rank's run (``fresh``: it starts over, by --no-resume or --overwrite, and no restart since)."""
    import torch.distributed as dist

    from flexmesh.layout.plan import load_plan
    from flexmesh.layout.plan_model import plan_model
    from flexmesh.runtime.observe.walltime import WallTime
    from flexmesh.runtime.parallel.distributed import START_UP_TIMEOUT_S, bound_collectives, init_distributed
    from flexmesh.runtime.train.adaptive import AdaptiveSource
    from flexmesh.runtime.train.groups import check_emulation, check_runnable
    from flexmesh.runtime.train.trainer import Trainer
    from flexmesh.search.check import check_model

    plan = load_plan(args.plan)
    if args.migrate and HELD_ENV not in os.environ:
        raise PlanError("--migrate needs --nproc N: its launcher relaunches the run on the new plan")
    spec = plan_model(plan, args.model, args.plan)  # --model, else the plan's (its recorded config.json)
    check_model(plan, spec, by_name=False)  # a plan for another model of as many layers trains nothing right
    check_runnable(plan, spec)  # reject an unsupported per-layer mix before touching the corpus
    check_evaluation(args, plan, spec)
    job = train_job(args, plan, spec)
    assert job.plan is not None
    plan = job.plan  # its groups' shares scaled to the batch the run takes
    # Each step schedule's predicted_step_time is the step simulator's, reported beside the measured time.
    # Without --policy, a plan of several groups takes the simulator's choice on the run's first batches (below).
    schedule_fn = scheduler(job, args.policy, args.seed, args.cp) if args.policy else None
    fallback_fn = scheduler(job, args.fallback_policy, args.seed, args.cp) if args.adaptive else None
    check_world(args.plan, plan)
    if not os.environ.get(SUPERVISED_ENV):  # under flexmesh's launcher it checked, once, for the whole node
        from flexmesh.runtime.parallel.device import check_memory

        check_memory(estimated_peak(job), args.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    emulated = check_emulation(plan, args.emulate_speed)
    if os.environ.get("RANK", "0") == "0":
        from flexmesh.search.check import overlap_warnings

        for warning in overlap_warnings(plan):
            print(f"warning: {warning}", file=sys.stderr)
    announce_emulation(emulated)
    wall = WallTime()
    wall.add("start-up", time.perf_counter() - wall.start)  # the interpreter, imports, the plan and its checks
    records: list = []  # the run folder's records: written by fit once every resume check has passed
    with wall.phase("tokenizer and data"):
        tokens = corpus_tokens_of(args, job, records)
        loader = document_loader(args, job, tokens)
        evaluation = held_out(args, job, tokens.tokenizer, tokens.tokens.end_of_text)
    if schedule_fn is None:  # the default: the plan's own schedule, or for several groups the simulator's choice
        # the first batches' lengths are drawn only where the simulator compares policies on them
        batches = first_lengths(args, job, tokens, RECOMMEND_STEPS) if len(plan.groups) > 1 else []
        policy, why = choose_policy(job, batches, speeds_of(emulated, plan.world_size), args.seed)
        if why is not None and os.environ.get("RANK", "0") == "0":
            print(why, file=sys.stderr, flush=True)
        schedule_fn = scheduler(job, policy, args.seed, args.cp)
    fallback_fn = fallback_fn or schedule_fn
    config = train_config(args, emulate_speed=tuple(emulated.items()), resume=not fresh)
    with wall.phase("process group"):
        init_distributed(timeout_s=args.collective_timeout, device=args.device, start_up_s=START_UP_TIMEOUT_S)
    rank0 = dist.get_rank() == 0
    try:
        with wall.phase("model build"):
            trainer = Trainer(plan, spec, config, weights=args.weights, tasks=job.parts.tasks,
                              mixture=getattr(loader, "mixture", None))
        bound_collectives()  # every group is made: the collective timeout from here on
        if dist.get_rank() == 0:
            announce(trainer)
        # Rank 0 schedules step k+1 while step k trains and broadcasts it; with --adaptive a late
        # schedule is replaced by the fallback policy's instead of waited for.
        source = AdaptiveSource(loader, schedule_fn, fallback_fn, deadline_s=0.0 if args.adaptive else None)
        monitor = _straggler_monitor(args, trainer, schedule_fn, source, dist.get_rank() == 0)
        steps = _KillAfterStep(source, trainer, os.environ[KILL_ENV], dist.get_rank()) if os.environ.get(KILL_ENV) \
            else source
        migration = None
        if args.migrate and args.out:
            from flexmesh.commands.migrate import MigrationCheck

            planned = plan.with_global_batch(job.global_batch)  # the batch it runs
            migration = MigrationCheck(planned, spec, monitor, args.out, args.max_steps,
                                       emulate_speed=tuple(args.emulate_speed))
        groups = f" over {len(plan.groups)} replica groups" if len(plan.groups) > 1 else ""
        return fit_and_report(trainer, steps, config, args.out, what=groups, monitor=monitor, migration=migration,
                              records=records, wall=wall, evaluation=evaluation)
    finally:
        with wall.phase("teardown"):
            if sys.exc_info()[0] is None:  # every rank done: leave together (a rank that failed is not waited for)
                dist.barrier()
            dist.destroy_process_group()
        if rank0 and wall.finished:  # where the run's time went, the first step's compilation and checkpoints apart
            print(wall.line(), file=sys.stderr, flush=True)


def announce(trainer) -> None:
    """One line on stderr before the first step: the device, the attention kernels, the plan's micro-batch
    budget and whether blocks are compiled (metrics.jsonl records what each step ran)."""
    import torch.distributed as dist

    from flexmesh.console import plain_console
    from flexmesh.runtime.model.attention_kernels import model_kernels
    from flexmesh.runtime.parallel.device import device_name
    from flexmesh.runtime.parallel.distributed import compute_device_choice

    cfg, plan = trainer.config, trainer.plan
    budgets = "/".join(f"{g.microbatch_tokens(plan.seq_len):,}" for g in plan.groups)
    plain_console(stderr=True, soft_wrap=True).print(
        f"{dist.get_world_size()} x {device_name(compute_device_choice())}, {cfg.dtype}; attention "
        f"{'+'.join(model_kernels(trainer.spec, trainer.device.type, cfg.dtype))}; micro-batches of up to "
        f"{budgets} tokens "
        f"per data rank{' (per replica group)' if len(plan.groups) > 1 else ''}; "
        f"{'compiled' if cfg.compile else 'eager'} blocks; "
        f"{'chunked' if trainer.chunked_loss else 'whole-logit'} loss", highlight=False)


def _straggler_monitor(args: argparse.Namespace, trainer, schedule_fn, source, rank0: bool):
    """Every step: measured speeds into the metrics, straggler events, and (rank 0, unless
    --no-replan) the schedules re-planned for a sustained speed change (flexmesh.runtime.train.stragglers)."""
    from flexmesh.runtime.train.stragglers import StragglerConfig, StragglerMonitor
    from flexmesh.sim.predict import step_time_at_speed

    config = StragglerConfig(threshold=args.straggler_threshold, steps=args.straggler_steps,
                             replan=not args.no_replan, judge=not oversubscribed(trainer, rank0))
    priced = rank0 and schedule_fn.groups is not None
    return StragglerMonitor(trainer.data_of, config, scheduler=schedule_fn if priced else None,
                            price=step_time_at_speed(schedule_fn) if priced else None, apply=source.set_speed)


def oversubscribed(trainer, say: bool) -> bool:
    """Whether this node runs more CPU ranks than it has cores (then a waiting rank lends its core to a
    busy one, and measured speeds say nothing of stragglers); ``say``: tell the console once."""
    from flexmesh.runtime.model.params import node_cores

    cores = node_cores()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    over = trainer.device.type == "cpu" and ranks > cores
    if over and say:
        print(f"{ranks} processes on {cores} CPU cores: measured speeds are the OS scheduler's, so stragglers are "
              "not judged (speeds are still recorded)", file=sys.stderr)
    return over


# A testing hook, not a feature (tests/test_elastic.py): "RANK:STEP" makes rank RANK SIGKILL itself
# once step STEP is done (logged, and checkpointed when one is due), in the first attempt of a run
# that started from step 0 only, so the group torchrun restarts from a checkpoint trains on.
KILL_ENV = "FLEXMESH_TESTING_KILL_AFTER_STEP"


class _KillAfterStep:
    """A step source that kills its process before handing out the step after ``KILL_ENV``'s step."""

    def __init__(self, source, trainer, spec: str, rank: int) -> None:
        target, _, step = spec.partition(":")
        self.source, self.trainer, self.step = source, trainer, int(step)
        self.armed = int(target) == rank and restart_count() == 0
        self.rank, self.start = rank, None

    def __next__(self):
        import signal

        if self.start is None:
            self.start = self.trainer.step_index  # the step the run resumed from, 0 when it did not
        if self.armed and self.start == 0 and self.trainer.step_index == self.step:
            print(f"{KILL_ENV}: rank {self.rank} kills itself after step {self.step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return next(self.source)

    def state_dict(self) -> dict:
        return self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)

    def close(self) -> None:
        self.source.close()


def announce_emulation(emulated: dict[int, float]) -> None:
    """Say on rank 0 that ``--slow`` slows ranks down on purpose."""
    if emulated and os.environ.get("RANK", "0") == "0":
        print("EMULATION (--slow): " + ", ".join(f"rank {r} computes at {f:g}x" for r, f in emulated.items())
              + "; metrics.jsonl records it as emulated_speed", file=sys.stderr)
