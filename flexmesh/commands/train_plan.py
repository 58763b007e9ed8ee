"""``flexmesh train`` without ``--plan``: the run plans for the devices it will train on.

The cluster is ``--cluster`` when given, else this machine as the run will use it: ``N`` processes
(``--nproc``, else one) on its GPUs when there is one per process (their device preset, the rule of
flexmesh.runtime.parallel.device), else on its CPU, priced by the machine's saved profile
(``NxLOCAL``, flexmesh.profile.use), measured once by ``flexmesh profile hardware --quick`` when
there is none yet. The search (flexmesh.search) picks the fastest layout that fits, as ``flexmesh
plan`` does, among the layouts the runtime runs (one mesh for every layer, the runtime's overlap),
within ``--tp``, ``--pp``, ``--cp`` and ``--zero`` where given.

The plan is written to ``OUT/plan.json`` and a resumed run takes that file again, so a run keeps
the layout it started with.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from flexmesh.commands.args import given_flags
from flexmesh.errors import PlanError
from flexmesh.layout.plan import Plan
from flexmesh.runtime.state.rundir import PLAN_FILE

DEFAULT_MODEL = "tiny"
DEFAULT_SEQ_LEN = 1024
SEQUENCES_PER_PROCESS = 4  # the default global batch: this many documents per process


@dataclass(frozen=True)
class Planned:
    """The plan a run chose and the line that says how."""

    plan: Plan
    how: str
    written: bool = False  # read back from OUT/plan.json (a resume): nothing to write


def planned_path(out: str) -> Path:
    return Path(out) / PLAN_FILE


def check_flags(args: argparse.Namespace) -> None:
    """Flags that constrain planning make no sense beside ``--plan`` (the plan fixes them): one line."""
    if args.plan is None:
        return
    given = given_flags({f"--{n}": getattr(args, n, None) is not None for n in ("tp", "pp", "zero", "cluster")})
    if given:
        raise PlanError(f"{given[0]} constrains the plan a run makes without --plan; with --plan the plan's layout "
                        "and cluster hold: drop it, or drop --plan")


def plan_run(args: argparse.Namespace) -> Planned:
    """The plan of a run started without ``--plan`` (module doc). PlanError says what to change when no
    layout fits."""
    from flexmesh.commands.train_args import run_dtype
    from flexmesh.spec.model import parse_model, with_dtype

    model = args.model or DEFAULT_MODEL
    spec = with_dtype(parse_model(model), run_dtype(args))  # priced in the dtype the run computes in
    world = args.nproc or 1
    seq = args.seq_len or DEFAULT_SEQ_LEN
    per_step = getattr(args, "tokens_per_step", None)
    batch = args.global_batch or (max(1, per_step // seq) if per_step else SEQUENCES_PER_PROCESS * world)
    cluster, where = _cluster(args, world)
    from flexmesh.layout.overlap import RUNTIME
    from flexmesh.profile.use import cost_model_for
    from flexmesh.search import SearchRequest, SearchSpace, best_plans
    from flexmesh.search.space import FULL_SPACE

    cost = cost_model_for(spec, cluster)
    space = SearchSpace(tp=(args.tp,) if args.tp else None, pp=(args.pp,) if args.pp else None,
                        max_cp=args.cp, zero_stages=(args.zero,) if args.zero is not None else FULL_SPACE.zero_stages,
                        same_mesh=True, overlaps=(RUNTIME,))
    result = best_plans(SearchRequest(spec, cost.cluster, seq, batch, space, cost, top=1))  # PlanError: none fits
    plan = result.best.plan
    if args.model:  # the plan names the model as given (a config.json path), so a resume reads the same one
        from dataclasses import replace

        plan = replace(plan, model=args.model)
    step = plan.predicted.get("step_time_s")
    return Planned(plan, f"planned for {where}: {plan.layout}"
                         + (f", {step:.3g} s a step predicted" if step else "")
                         + (f" ({per_step:,} tokens per step, documents up to {seq:,} tokens)" if per_step else
                            f" ({batch} documents of up to {seq:,} tokens per step)"))


def _cluster(args: argparse.Namespace, world: int) -> tuple[str | None, str]:
    """The cluster to plan on and the words for it; None: a CPU with no saved profile."""
    if getattr(args, "cluster", None):
        return args.cluster, args.cluster
    from flexmesh.runtime.parallel.device import visible_gpus

    gpus = 0 if args.device == "cpu" else visible_gpus()
    if gpus >= world and gpus:
        import torch

        from flexmesh.spec.devices import preset_of_gpu

        name = torch.cuda.get_device_name(0)
        preset = preset_of_gpu(name)
        if preset is None:
            raise PlanError(f"no device preset describes this machine's {name}; give --cluster (e.g. "
                            f"{world}xA100-80GB) or --plan")
        return f"{world}x{preset}", f"{world} x {name} ({preset})"
    from flexmesh.profile.use import local_profile

    cpus = f"{world} CPU process{'es' if world > 1 else ''}"
    if not local_profile("hardware").is_file():
        _profile_this_machine(world)
    return f"{world}xlocal", f"{cpus}, priced by this machine's profile ({local_profile('hardware')})"


def _profile_this_machine(world: int) -> None:
    """Save this machine's hardware profile once (``flexmesh profile hardware --quick``, about 10 s), so that
    the search has the CPU's measured speeds to rank layouts by; later runs and ``--cluster local`` reuse it."""
    import subprocess
    import tempfile

    from flexmesh.runtime.launch import child_env

    argv = ["profile", "hardware", "--quick", "--device", "cpu", "--no-progress"]
    argv += ["--nproc", str(world)] if world > 1 else []
    print(f"no profile of this machine yet: measuring it once to plan on (flexmesh {' '.join(argv)})",
          file=sys.stderr, flush=True)
    # the profile's --out copy is thrown away: planning reads the one it keeps as this machine's
    with tempfile.TemporaryDirectory(prefix="flexmesh-profile-") as scratch:
        proc = subprocess.run([sys.executable, "-m", "flexmesh", *argv, "--out", f"{scratch}/hardware.json"],
                              env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise PlanError(f"profiling this machine to plan on failed ({tail[0]}); give --plan, or --cluster to plan "
                        "for a preset")
