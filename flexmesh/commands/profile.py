"""``flexmesh profile hardware|model|engine``: measure this machine, a model or a serving engine and write a
profile (docs/cli-profile.md; engines: docs/serving-engines.md).

Hardware and model profiles run in one process, under your own ``torchrun``, or with ``--nproc N`` under a torchrun they
launch themselves; with several processes every process runs the same sweep at the same time and
rank 0 writes the median of each measurement, so the contention of N training processes is in it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flexmesh.commands.args import new_file, nonempty, positive_int
from flexmesh.errors import OutputError, ProfileError
from flexmesh.files import check_file_target, make_folder
from flexmesh.profile.format import HardwareProfile, ModelProfile
from flexmesh.runtime.parallel.device import DEVICES
from flexmesh.units import GIB


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="measure the hardware or a model and write a profile",
                              description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    kinds = p.add_subparsers(dest="profile_kind", metavar="KIND")
    hw = kinds.add_parser("hardware",
                          help="collectives (alpha-beta per group size), matmul, memory bandwidth, attention",
                          description="Time collectives, matmuls, memory copies and attention; fit alpha-beta per "
                                      "collective and group size; write a hardware profile.")
    hw.set_defaults(func=run, profile_kind="hardware")
    mdl = kinds.add_parser("model", help="per-layer time fits, activation bytes per tp/cp degree, states",
                           description="Time the runtime's layers over packed rows, measure saved activations per "
                                       "tp/cp degree and recomputation, and write a model profile.")
    mdl.add_argument("--model", type=nonempty,
                     help="preset, gpt:L:H:A or a config.json (default: --for-plan's model, else tiny)")
    mdl.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                     help="dtype to measure in (default fp32, the dtype the runtime trains in)")
    mdl.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                     help="time compiled blocks, as `flexmesh train --compile` runs them (default: on GPUs)")
    mdl.add_argument("--max-group", type=positive_int, metavar="N",
                     help="with --nproc, time a layer under real process groups of tp x cp up to N processes "
                          "(default 8, 2 with --quick; 1: none, for plans without tp or cp)")
    mdl.add_argument("--for-plan", metavar="PLAN",
                     help="measure only what PLAN prices: saved activations and process groups of its layers' "
                          "(tp, cp), of tp = cp = 1 and of the cp groups per-step policies form of its data ranks "
                          "(up to --max-group), the pipeline stages only when it has pp > 1; not kept as this "
                          "machine's own")
    mdl.add_argument("--hardware-out", type=new_file, metavar="FILE",
                     help="profile the hardware first, in the same processes (one launch for both), and write that "
                          "profile to FILE")
    mdl.set_defaults(func=run, profile_kind="model")
    from flexmesh.commands.profile_engine import add_engine_parser

    add_engine_parser(kinds)  # its own flags and runner: one engine process, no torchrun
    for sp in (hw, mdl):
        sp.add_argument("--quick", action="store_true", help="a small sweep (well under a minute on a laptop)")
        sp.add_argument("--out", type=new_file,
                        help="profile file to write, atomically (default hardware.json / model-<name>.json)")
        sp.add_argument("--nproc", type=positive_int, help="launch torchrun with this many processes on this node")
        sp.add_argument("--no-progress", action="store_true", help="no progress bar")
        sp.add_argument("--no-keep", action="store_true",
                        help="write --out only: do not keep the profile as this machine's own (the one `--cluster "
                             "local` prices by, which a profile otherwise replaces)")
        sp.add_argument("--device", default="auto", choices=DEVICES,
                        help="measure the GPUs (one per process) or the CPU; auto: GPUs when there is one per "
                             "process (default auto)")
    hw.set_defaults(hardware_out=None)
    p.set_defaults(func=lambda a: (p.print_help(), 1)[1])
    return p


def _forwarded(args: argparse.Namespace, out: str) -> list[str]:
    argv = ["profile", args.profile_kind, "--out", out, "--device", args.device]
    argv += ["--no-keep"] if args.no_keep else []
    if args.profile_kind == "model":
        argv += ["--model", _model(args), "--dtype", args.dtype]
        if args.for_plan:
            argv += ["--for-plan", str(Path(args.for_plan).resolve())]
        if args.hardware_out:
            argv += ["--hardware-out", str(Path(args.hardware_out).resolve())]
        if args.compile is not None:
            argv.append("--compile" if args.compile else "--no-compile")
        if args.max_group is not None:
            argv += ["--max-group", str(args.max_group)]
    if args.quick:
        argv.append("--quick")
    if args.no_progress:
        argv.append("--no-progress")
    return argv


def _out_path(args: argparse.Namespace) -> str:
    if args.out:
        return args.out
    if args.profile_kind == "hardware":
        return "hardware.json"
    from flexmesh.spec.model import parse_model

    return f"model-{parse_model(_model(args)).name.replace('/', '_')}.json"


def _model(args: argparse.Namespace) -> str:
    """``--model``, else ``--for-plan``'s model, else ``tiny``."""
    if args.model:
        return args.model
    return _plan(args).model if args.for_plan else "tiny"


def _plan(args: argparse.Namespace):
    from flexmesh.layout.plan import Plan

    return Plan.load(args.for_plan)


Degrees = set[tuple[int, int]]  # (tp, cp)
Groups = set[tuple[int, str, int]]  # (tp, cp kind, cp)


def plan_parts(plan, spec, max_group: int | None = None) -> tuple[Degrees, Groups, bool]:
    """What a model profile of ``spec`` needs to price ``plan``: the (tp, cp) degrees of saved
    activations, the (tp, cp kind, cp) layouts to time under real process groups, and whether any
    replica group is a pipeline. Degrees: tp = cp = 1 (what unmeasured ones scale from), the plan's
    layers', and those of the context-parallel groups per-step policies form of a replica group's data
    ranks (cp up to its data ranks, or ``max_group`` processes; of the kind
    flexmesh.layout.mesh.context_kind gives, as the runtime forms them).

    >>> from flexmesh.layout.plan import Plan, StagePlan
    >>> from flexmesh.layout.strategy import LayerStrategy
    >>> from flexmesh.spec.model import parse_model
    >>> st = (LayerStrategy.parse("tp1-dp2z2"),) * 4
    >>> plan = Plan.uniform("tiny", "2xA100-80GB", 2, 1, "1f1b", 1, 2048, 8, (StagePlan(0, 4, st),))
    >>> plan_parts(plan, parse_model("tiny"))
    ({(1, 1), (1, 2)}, {(1, 'ulysses', 2)}, False)
    >>> plan_parts(plan, parse_model("tiny"), max_group=1)
    ({(1, 1)}, set(), False)
    """
    from flexmesh.layout.mesh import context_kind, group_layout

    degrees: Degrees = {(1, 1)}
    groups: Groups = set()
    for g in plan.groups:
        layout = group_layout(g)
        strategies = g.layer_strategies()
        layers = {(s.tp, str(s.cp_kind), s.cp) for s in strategies}
        tp, kind, cp = strategies[0].tp, str(context_kind(spec, layout)), 2
        while cp <= layout.data_ranks and tp * cp <= (max_group or tp * cp):
            layers.add((tp, kind, cp))
            cp *= 2
        degrees |= {(t, c) for t, _, c in layers}
        groups |= {(t, k, c) for t, k, c in layers if t * c > 1 and t * c <= (max_group or t * c)}
    return degrees, groups, any(g.pp > 1 for g in plan.groups)


def _plan_parts(args: argparse.Namespace) -> tuple[Degrees | None, Groups | None, bool]:
    """``--for-plan``'s :func:`plan_parts` (None, None, True without it); refused when it is another model's plan."""
    if args.profile_kind != "model" or not args.for_plan:
        return None, None, True
    from flexmesh.spec.model import parse_model

    plan = _plan(args)
    spec = parse_model(_model(args))
    if parse_model(plan.model).name != spec.name:
        raise ProfileError(f"--for-plan {args.for_plan} is a plan of {plan.model!r}, not {args.model!r}; "
                           f"drop --model or pass --model {plan.model}")
    return plan_parts(plan, spec, args.max_group)


def run(args: argparse.Namespace) -> int:
    out = _out_path(args)
    only, groups, pipeline = _plan_parts(args)  # a plan of another model: one line, before anything starts
    for target in (out, args.hardware_out):
        if target:
            check_file_target(target)  # a device, fifo or symlink there: refused now, not after minutes of profiling
    if args.nproc is not None and "LOCAL_RANK" not in os.environ:
        if args.nproc < 1:
            raise ProfileError(f"--nproc must be at least 1, got {args.nproc}")
        from flexmesh.runtime.launch import relaunch_flexmesh
        from flexmesh.runtime.parallel.device import check_launch

        check_launch(args.device, args.nproc)  # more processes than GPUs: one line, before anything starts
        return relaunch_flexmesh(args.nproc, _forwarded(args, str(Path(out).resolve())))
    from flexmesh.profile.runner import World

    world = World(args.device)
    prof: HardwareProfile | ModelProfile | None
    try:
        if args.profile_kind == "hardware" or args.hardware_out:
            from flexmesh.profile.hardware import profile_hardware

            prof = profile_hardware(quick=args.quick, show_progress=not args.no_progress, world=world)
            _written(prof, args.hardware_out or out, args, "hardware")
        if args.profile_kind == "model":
            from flexmesh.profile.model import profile_model
            from flexmesh.spec.model import parse_model

            prof = profile_model(parse_model(_model(args)), quick=args.quick, dtype=args.dtype,
                                 show_progress=not args.no_progress, world=world, compile=args.compile,
                                 max_group=args.max_group, degrees_only=only, groups_only=groups,
                                 pipeline=pipeline)
            _written(prof, out, args, "model")
    finally:
        world.close()
    return 0


def _written(prof: HardwareProfile | ModelProfile | None, out: str, args: argparse.Namespace, kind: str) -> None:
    """Rank 0's profile (None elsewhere) written to ``out``, summarised, and kept as this machine's own
    (not with ``--no-keep``, nor a model profile of one plan's parts, ``--for-plan``)."""
    if prof is None:
        return
    prof.save(out)
    _summary(prof, out)
    if not args.no_keep and not (kind == "model" and getattr(args, "for_plan", None)):
        _save_local(prof, args, kind)


def _save_local(prof, args: argparse.Namespace, kind: str) -> None:
    """Keep a copy as this machine's own profile, which ``--cluster local`` / ``NxLOCAL`` prices by
    (flexmesh.profile.use.local_cost_model); a later profile of the same kind replaces it."""
    from flexmesh.profile.use import local_profile
    from flexmesh.spec.model import parse_model

    spec = parse_model(_model(args)) if kind == "model" else None
    path = local_profile(kind, spec, prof.dtype)
    try:
        make_folder(path.parent)
        prof.save(path)
    except (OSError, OutputError) as e:  # the cache folder is not writable: the profile itself was written
        why = e.strerror if isinstance(e, OSError) else str(e)
        print(f"not kept as this machine's profile ({path}: {why}); --cluster local will not find it",
              file=sys.stderr)
        return
    print(f"kept as this machine's {kind} profile ({path}): plan, simulate and train price "
          "`--cluster local` or `NxLOCAL` by it", file=sys.stderr)


def _summary(prof, out: str) -> None:
    from rich.table import Table

    from flexmesh.console import plain_console
    from flexmesh.profile.format import recompute_name

    con = plain_console()
    if prof.kind == "hardware":
        t = Table(title=f"hardware profile ({prof.device['name']}, {prof.produced_by['processes']} processes)")
        for col in ("collective", "group", "scope", "alpha (us)", "bandwidth (GB/s)"):
            t.add_column(col, justify="left" if col in ("collective", "scope") else "right")
        for c in prof.collectives:
            bw = f"{1e-9 / c.beta_s_per_byte:,.2f}" if c.beta_s_per_byte > 0 else "-"
            t.add_row(c.collective, str(c.group_size), c.scope, f"{c.alpha_s * 1e6:,.1f}", bw)
        con.print(t)
        for dt, f in prof.matmul_flops_per_s.items():
            con.print(f"matmul {dt}: {f / 1e9:,.1f} GFLOP/s; attention {dt}: "
                      f"{prof.attention[dt]['flops_per_s'] / 1e9:,.1f} GFLOP/s (causal FLOPs)", highlight=False)
        con.print(f"memory copy: {prof.memory_bytes_per_s / 1e9:,.1f} GB/s; memory per process "
                  f"{prof.device['memory_bytes'] / GIB:,.1f} GiB", highlight=False)
        if prof.overlap:
            con.print(f"overlap: {prof.overlap['hidden_fraction']:.0%} of an all-gather overlapping compute is hidden",
                      highlight=False)
    else:
        t = Table(title=f"model profile of {prof.model['name']} ({prof.dtype}, "
                        f"{prof.produced_by['processes']} processes)")
        for col in ("pass", "c0 (ms)", "per token (us)", "per sum len^2 (ns)", "per row^2 (ns)"):
            t.add_column(col, justify="left" if col == "pass" else "right")
        for part, fits in (("layer", prof.layer), ("embedding", prof.embedding), ("head", prof.head)):
            for name, f in fits.items():
                t.add_row(f"{part} {name}", f"{f.c0_s * 1e3:.3f}", f"{f.c1_s_per_token * 1e6:.3f}",
                          f"{f.c2_s_per_sq_token * 1e9:.4f}", f"{f.c3_s_per_sq_row_token * 1e9:.4f}")
        con.print(t)
        a = Table(title="saved activation bytes per token, one layer, each device")
        for col in ("tp", "cp", "no recompute", "selective recompute", "full recompute"):
            a.add_column(col, justify="right")
        entries = {(e["tp"], e["cp"], recompute_name(e["recompute"])): e["bytes_per_token"]
                   for e in prof.activations["layers"]}
        for tp, cp in sorted({(k[0], k[1]) for k in entries}):
            # "-": not measured (an older profile; selective layers are then priced with the none bytes)
            a.add_row(str(tp), str(cp), *(f"{entries[(tp, cp, kind)]:,.0f}" if (tp, cp, kind) in entries else "-"
                                          for kind in ("none", "selective", "full")))
        con.print(a)
        if prof.whole_model:
            con.print(f"whole model ({prof.whole_model['layers']} layers, as the trainer runs a micro-batch) over "
                      f"the sum of its parts: forward {prof.whole_factor('forward'):.2f}x + "
                      f"{prof.whole_fixed('forward') * 1e3:.2f} ms, backward {prof.whole_factor('backward'):.2f}x + "
                      f"{prof.whole_fixed('backward') * 1e3:.2f} ms per micro-batch (every pass is priced with these)",
                      highlight=False)
        if prof.pipeline:
            con.print(f"pipeline stages: {prof.stage_fixed() * 1e3:.2f} ms per chunk per micro-batch, forward and "
                      f"backward (the runtime's schedule over {prof.pipeline['microbatches']} micro-batches with the "
                      f"model cut into {', '.join(map(str, prof.pipeline['stages']))} stages)", highlight=False)
        if prof.parallel.get("layers"):
            _parallel_summary(con, prof, Table)
    con.print(f"wrote {out}", highlight=False)


def _parallel_summary(con, prof, Table) -> None:
    """One layer's forward + backward under real groups against the one-process time split tp x cp ways."""
    rows = [r["lengths"] for r in prof.samples.get("layer_rows", [])]
    lengths = max(rows, key=sum) if rows else [2048]
    tokens, sq = float(sum(lengths)), float(sum(x * x for x in lengths))
    t = Table(title=f"one layer under real process groups of {prof.parallel['world_size']}, "
                    f"forward + backward of {int(tokens)} tokens")
    for col in ("tp", "cp", "kind", "measured (ms)", "one process / (tp x cp) (ms)", "ratio"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    for e in prof.parallel["layers"]:
        split = e["tp"] * e["cp"]
        got = float(e["forward"].time(tokens, sq) + e["backward"].time(tokens, sq))
        one = float(prof.layer["forward"].time(tokens, sq, split) + prof.layer["backward"].time(tokens, sq, split))
        t.add_row(str(e["tp"]), str(e["cp"]), e["cp_kind"], f"{got * 1e3:.2f}", f"{one * 1e3:.2f}", f"{got / one:.2f}x")
    con.print(t)
