"""``flexmesh demo``: plan, simulate, profile, train with adaptive schedules, and write a report.

With no arguments, on this machine (see docs/cli-demo.md):

1. plan Llama 3 8B on one node of 8 H100s (sequences of 8192, 128 per step) and show the best layouts;
2. simulate the baselines and the ``hdp`` and ``milp`` policies on Llama 2 7B over 8x8 A100-40GB
   with batches drawn from the shipped Wikipedia lengths, and show the comparison;
3. profile this machine and the small model the demo trains, in one launch (``flexmesh profile model --quick
   --hardware-out``), the model for the training plan of step 4 (``--for-plan``);
4. train that model on ``--nproc`` local processes on the Python standard library's sources, first
   with the ``fixed`` policy, then with adaptive per-step schedules (``milp``, falling back to
   ``hdp`` when late) on the same batches, showing progress;
5. uneven devices: plan Llama 2 13B on a mixed cluster (one H100 node, two A100-40GB nodes)
   against its baselines (searched in a child process during steps 1 and 2; after them with
   ``--quick``), simulate that plan's fixed shares against each step's documents dispatched over its
   replica groups (``flexmesh simulate --plan``), then train twice on 2 processes
   with rank 1 emulated at half speed, static against re-planned per-step schedules; uneven experts:
   a mixture of experts on 2 processes, its experts over both ranks, static against load-following
   placement;
6. write ``<out>/report.md`` with PNG plots: a simulated step timeline, a measured one, per-rank
   balance and speed, the loss curves and predicted against measured step time.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from flexmesh.commands import plan as plan_command
from flexmesh.commands import simulate as simulate_command
from flexmesh.commands.args import folder, nonneg_int, old_names, positive_int, seq_len, sequences, steps
from flexmesh.errors import FlexmeshError
from flexmesh.files import make_folder
from flexmesh.runtime.parallel.device import DEVICES


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``flexmesh demo`` and its flags."""
    p = subparsers.add_parser("demo", help="plan, simulate, profile, train adaptively and write a report",
                              description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--out", default="flexmesh-demo", type=folder, help="output folder (default flexmesh-demo)")
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="local training processes, 2 to 4 (default: one per CPU core, 2 to 4)")
    p.add_argument("--steps", type=steps, default=4,
                   help="training steps per policy (default 4: the first, which pays one-off costs, and 3 compared)")
    p.add_argument("--global-batch", type=sequences, default=12, help="documents per training step (default 12)")
    p.add_argument("--seq-len", type=seq_len, default=2048,
                   help="the longest sequence, in tokens; longer documents are truncated to it (default 2048)")
    old_names(p, "--max-len", dest="seq_len", type=seq_len)
    p.add_argument("--sim-steps", type=steps, default=3, help="simulated steps per policy (default 3)")
    p.add_argument("--quick", action="store_true",
                   help="a shortened run for tests: 2 processes, 2 steps, small batches, a small corpus and simulation")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the data, the weights and the simulation")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="auto: the multi-process steps on GPUs when there is one per process, else on the CPU, and "
                        "with any GPU one more run on one GPU; cpu: all on the CPU (default auto)")
    p.set_defaults(func=run)
    return p


@dataclass(frozen=True)
class DemoSize:
    """How much the demo runs: the flags', or with ``--quick`` a shortened run for tests."""

    nproc: int
    steps: int
    global_batch: int
    seq_len: int
    sim_steps: int
    seed: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> DemoSize:
        if args.quick:
            return cls(nproc=2, steps=2, global_batch=6, seq_len=512, sim_steps=1, seed=args.seed)
        nproc = args.nproc if args.nproc is not None else default_nproc()
        return cls(nproc, args.steps, args.global_batch, args.seq_len, args.sim_steps, args.seed)


def quick_corpus() -> str:
    """The corpus of ``--quick``'s trainings: one package of the standard library (``email``, about 30 files),
    whose tokenizer trains and whose tokens encode in a second, where the whole library's take half a minute
    (once per cache: flexmesh.data.loader)."""
    from flexmesh.data.corpus import stdlib_corpus_dir

    return str(stdlib_corpus_dir() / "email")


def default_nproc(cores: int | None = None) -> int:
    """The demo's processes when ``--nproc`` is not given: one per CPU core (``os.cpu_count()``), 2 to 4.
    More processes than cores time the OS scheduler, not the layout (so stragglers go unjudged), and
    every extra process re-runs the profile's sweeps and imports torch.

    >>> default_nproc(2), default_nproc(1), default_nproc(16)
    (2, 2, 4)
    """
    return min(4, max(2, cores if cores is not None else os.cpu_count() or 2))


def _flexmesh(argv: list[str], what: str) -> None:
    """``flexmesh *argv`` in a child process (torchrun needs its own), printing as it goes."""
    from flexmesh.runtime.launch import run_flexmesh

    run_flexmesh(argv, f"demo step '{what}'", capture=False)


def _parse(command: ModuleType, argv: list[str]) -> argparse.Namespace:
    """``flexmesh *argv`` parsed by that command's own parser (the CLI module sits above the commands)."""
    parser = argparse.ArgumentParser(prog="flexmesh")
    command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def training_plan_file(out: Path, hardware_profile: Path, nproc: int, seq_len: int, global_batch: int) -> Path:
    """Write the demo's training plan to ``out/plan-train.json`` and return its path.

    Its cluster is a cluster file of the profiled device (``out/profiles/cluster.json``, the device
    as :func:`~flexmesh.profile.use.cluster_from_profile` describes it), so that ``flexmesh train
    --plan`` prices its step schedules with or without ``--hardware-profile``.
    """
    import json
    from dataclasses import replace

    from flexmesh.files import write_atomic
    from flexmesh.profile.format import load_profile
    from flexmesh.profile.use import cluster_from_profile
    from flexmesh.report.runs import training_plan

    cluster = cluster_from_profile(load_profile(hardware_profile, "hardware"), nproc)
    cluster_file = Path(hardware_profile).resolve().parent / "cluster.json"
    write_atomic(cluster_file, json.dumps(cluster.to_dict(), indent=2) + "\n")
    plan_path = out / "plan-train.json"
    replace(training_plan(nproc, seq_len, global_batch), cluster=str(cluster_file)).save(plan_path)
    return plan_path


def run(args: argparse.Namespace) -> int:
    """``flexmesh demo``: the six steps of the module doc, each announced by a rule."""
    from rich.rule import Rule

    from flexmesh.console import plain_console

    # Imported here, not at the top: the report draws with matplotlib, slow to import, and every
    # `flexmesh` invocation imports this module to build its parser.
    from flexmesh.report.demo import write_report
    from flexmesh.report.experts import MOE_MODEL, demo_experts
    from flexmesh.report.runs import TRAIN_MODEL, read_metrics, training_plan

    size = DemoSize.of(args)
    corpus = quick_corpus() if args.quick else "stdlib"
    if not 2 <= size.nproc <= 4:
        raise FlexmeshError(f"--nproc must be 2 to 4 local processes, got {size.nproc}")
    console = plain_console()
    out = make_folder(args.out).resolve()
    t_start = time.perf_counter()
    devices = demo_devices(args.device, size.nproc, console)

    # Step 5's mixed-cluster plan is a search on one core that measures nothing: it runs in a child process
    # while steps 1 and 2 run here (the machine has at least two cores), and is joined before the profile,
    # which must have the machine to itself.
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from flexmesh.report.plan_tables import demo_mixed_search

    if args.quick:  # the same work in this process: a child's start-up costs CPU time that a short run notices
        sim = _plan_and_simulate(args, size, out, console)
        mixed_found = demo_mixed_search()
    else:
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            searching = pool.submit(demo_mixed_search)
            sim = _plan_and_simulate(args, size, out, console)
            mixed_found = searching.result()

    # 3. profile
    console.print(Rule(f"3/6  profile this machine and the {TRAIN_MODEL} model with {size.nproc} processes"))
    prof = out / "profiles"
    hw, mp = prof / "hardware.json", prof / f"model-{TRAIN_MODEL}.json"
    on = ["--device", devices["multi"]]
    # --no-keep: the demo's quick profiles never replace the machine's own (those `--cluster local` prices by)
    quick = ["--quick", "--no-keep", "--nproc", str(size.nproc), *on]
    if args.quick:  # no layer timed under real process groups: the per-step Ulysses groups priced from the fits
        quick += ["--max-group", "1"]
    # one launch for both: the hardware, then the model, in the same processes; the model measured for the
    # training plan (its per-step Ulysses groups; no tp, ring or pipeline, which no run of the demo prices)
    plan_path = out / "plan-train.json"
    training_plan(size.nproc, size.seq_len, size.global_batch).save(plan_path)
    profile_load = os.getloadavg()[0]
    _flexmesh(["profile", "model", "--for-plan", str(plan_path), *quick, "--out", str(mp), "--hardware-out", str(hw)],
              "profile")

    # 4. train
    plan_path = training_plan_file(out, hw, size.nproc, size.seq_len, size.global_batch)
    runs = {"fixed": ["--policy", "fixed", "--cp", "1"], "adaptive": ["--policy", "milp", "--adaptive",
                                                                      "--fallback-policy", "hdp"]}
    metrics, loads = {}, {}
    for i, (label, policy) in enumerate(runs.items()):
        console.print(Rule(f"4/6  train {TRAIN_MODEL} on {size.nproc} processes, standard-library sources: "
                           f"{label} ({i + 1}/{len(runs)})"))
        run_dir = out / "runs" / label
        before = os.getloadavg()[0]
        _flexmesh(["train", "--plan", str(plan_path), "--corpus", corpus, "--max-steps", str(size.steps),
                   "--out", str(run_dir), "--nproc", str(size.nproc), "--overwrite", "--seed", str(size.seed),
                   "--hardware-profile", str(hw), "--model-profile", str(mp), *on, *policy], f"train {label}")
        metrics[label], loads[label] = read_metrics(run_dir / "metrics.jsonl"), before

    # uneven devices: a mixed-cluster plan against its baselines
    console.print(Rule("5/6  mixed cluster: plan Llama 2 13B on 1x8xH100+2x8xA100-40GB against its baselines"))
    from flexmesh.report.plan_tables import demo_mixed_plan

    mixed = demo_mixed_plan(console, mixed_found)
    mixed_path = out / "plan-mixed.json"
    mixed["plan"].save(mixed_path)
    console.print(Rule("5/6  mixed cluster: each step's Wikipedia documents dispatched over its replica groups, "
                       "simulated"))
    dispatch = simulate_command.simulate(_parse(simulate_command, [
        "simulate", "--plan", str(mixed_path), "--seq-len", "4096", "--lengths", "wikipedia",
        "--policies", "balanced,hdp", "--steps", str(size.sim_steps), "--seed", str(size.seed)]))
    dispatch.print(console)

    # uneven devices: a rank emulated at half speed, static against re-planned schedules
    console.print(Rule("5/6  a slow device: 2 processes, rank 1 emulated at half speed, static vs re-planned"))
    from flexmesh.report.stragglers import demo_comparison

    def say(line: str) -> None:  # a line as each run of the next two parts ends (they run silently)
        console.print(line, highlight=False)

    # 6 steps each, whatever --steps: the slowdown is re-planned once sustained (after step 3 on a 2-core
    # machine), which leaves three steps on the new schedules (one with --quick); the experts' table leaves
    # out step 1 (its one-off costs) and averages the four after it.
    stragglers = demo_comparison(out / "stragglers", hw, mp, steps=4 if args.quick else 6, global_batch=8,
                                 seq_len=128 if args.quick else 256, seed=size.seed, device=devices["pair"],
                                 corpus=corpus, say=say)

    console.print(Rule(f"5/6  uneven experts: {MOE_MODEL} on 2 processes, static against load-following placement"))
    experts = demo_experts(out / "experts", hw, steps=2 if args.quick else 5, global_batch=8,
                           seq_len=128 if args.quick else 256, seed=size.seed, device=devices["pair"],
                           profile=not args.quick, corpus=corpus, say=say)

    gpu = None
    if devices["gpu"]:
        console.print(Rule(f"5/6  one GPU: {devices['gpu']}, {TRAIN_MODEL} in bf16, {size.steps} steps"))
        gpu = gpu_run(out, size, devices["gpu"], console)

    # 5. report
    console.print(Rule("6/6  report"))
    path = write_report(out, sim, metrics, plan_path, time.perf_counter() - t_start, stragglers=stragglers,
                        devices=devices["text"], gpu=gpu, mixed=(mixed, dispatch), loads=loads, experts=experts,
                        profile_load=profile_load)
    from flexmesh.report.serving_demo import demo_serving

    demo_serving(out, path, console, quick=args.quick)
    console.print(f"report: {path}  ({time.perf_counter() - t_start:.0f} s in all)", highlight=False)
    console.print(disk_note(out), highlight=False)
    return 0


def disk_note(out: Path) -> str:
    """What the demo leaves on disk: the folder's size and the share of it in its runs' checkpoints
    (``step_NNNNNN`` folders, flexmesh.runtime.state.checkpoint), which no part of the report reads.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> (d / "runs" / "fixed" / "step_000005").mkdir(parents=True)
    >>> _ = (d / "runs" / "fixed" / "step_000005" / "model.safetensors").write_bytes(bytes(3 << 20))
    >>> _ = (d / "report.md").write_bytes(bytes(1 << 20))
    >>> print(disk_note(d)[:60])
    the demo left 4 MB here, 3 MB of it its runs' checkpoints (1
    >>> import shutil; shutil.rmtree(d)
    """
    total = ckpt = 0
    folders = 0
    for path in out.rglob("*"):
        if path.is_file() and not path.is_symlink():
            size = path.stat().st_size
            total += size
            if any(re.fullmatch(r"step_\d{6}", part) for part in path.relative_to(out).parts):
                ckpt += size
        elif path.is_dir() and re.fullmatch(r"step_\d{6}", path.name):
            folders += 1
    mb = lambda n: f"{n / 2**20:,.0f} MB"  # noqa: E731
    if not ckpt:
        return f"the demo left {mb(total)} here"
    return (f"the demo left {mb(total)} here, {mb(ckpt)} of it its runs' checkpoints ({folders} step_* folders, "
            f"which the report does not read): `find {out} -name 'step_*' -type d -prune -exec rm -r {{}} +` frees "
            "them")


def _plan_and_simulate(args: argparse.Namespace, size: DemoSize, out: Path, console):
    """Steps 1 and 2 of the module doc; the simulation's comparison."""
    from rich.rule import Rule

    from flexmesh.console import plain_console

    # 1. plan
    console.print(Rule("1/6  plan: Llama 3 8B on 8x H100, sequences of 8192, 128 per step"))
    try:
        failed = plan_command.run(_parse(plan_command, ["plan", "--out", str(out / "plan-llama3-8b.json")])) != 0
    except FlexmeshError as e:
        raise FlexmeshError(f"demo step 'plan' failed: {e}") from None
    if failed:
        raise FlexmeshError("demo step 'plan' failed")

    # 2. simulate
    console.print(Rule("2/6  simulate: per-step policies, Llama 2 7B on 8x8 A100-40GB, Wikipedia lengths"))
    sim_args = ["simulate", "--model", "llama2-7b", "--cluster", "8x8xA100-40GB", "--seq-len", "131072",
                "--global-batch", "128" if args.quick else "512", "--lengths", "wikipedia",
                # --quick: the adaptive hdp against the baselines; milp's solve is most of the simulation's time
                "--policies", "hdp" if args.quick else "hdp,milp",
                "--steps", str(size.sim_steps), "--seed", str(size.seed)]
    if args.quick:  # the pictures the report shows only (flexmesh.report.demo: the first policy's and the best's)
        sim = simulate_command.simulate(_parse(simulate_command, sim_args))
        _report_plots(sim, make_folder(out / "simulated"))
    else:
        sim = simulate_command.simulate(_parse(simulate_command, [*sim_args, "--plots", str(out / "simulated")]))
    simulate_command.print_table(sim, plain_console())
    return sim


def _report_plots(sim, folder: Path) -> None:
    """The Gantt and load PNGs of the first step of the runs the report shows (the first and the fastest), as
    ``flexmesh simulate --plots`` draws them for every run, into ``sim.plots``."""
    from flexmesh.sim.plots import gantt_png, load_png

    best = max(sim.runs, key=lambda r: r.tokens_per_s)
    for r in [sim.runs[0]] + ([best] if best is not sim.runs[0] else []):
        if r.first_timeline is not None:
            title = f"{r.label}, step 0"
            sim.plots[r.label] = [str(gantt_png(r.first_timeline, folder / f"{r.policy}_gantt.png", title)),
                                  str(load_png(r.first_timeline, folder / f"{r.policy}_load.png", title))]


def demo_devices(requested: str, nproc: int, console) -> dict:
    """Where each part of the demo runs (flexmesh.runtime.parallel.device's rule, one process per GPU): the
    ``nproc``-process steps on GPUs when there are that many, else on the CPU; the straggler pair
    likewise with 2; with any GPU, one more run on one GPU (``gpu``: its name). ``text`` says it."""
    from flexmesh.runtime.parallel.device import visible_gpus

    gpus = 0 if requested == "cpu" else visible_gpus()
    if requested == "cuda" and gpus == 0:
        raise FlexmeshError("--device cuda but no GPU is visible; use --device auto or cpu")
    gpu_name = None
    if gpus:
        import torch

        gpu_name = torch.cuda.get_device_name(0)
    multi = "cuda" if gpus >= nproc else "cpu"
    cpu_name = f"the CPU ({os.cpu_count()} cores)"
    text = (f"{nproc}-process steps on {f'{nproc} x {gpu_name}' if multi == 'cuda' else cpu_name}"
            + (f"; {gpus} x {gpu_name} visible, one of them trains alone at the end" if gpus else "; no GPU visible"))
    if 0 < gpus < nproc:
        console.print(f"{gpus} GPU{'s' if gpus > 1 else ''} for {nproc} processes (one process per GPU): the "
                      f"{nproc}-process steps run on the CPU, then one GPU trains alone", highlight=False)
    return {"multi": multi, "pair": "cuda" if gpus >= 2 else "cpu", "gpu": gpu_name, "text": text}


def gpu_run(out: Path, size: DemoSize, gpu_name: str, console) -> dict:
    """The demo's model trained by one process on one GPU in bf16 (compiled blocks, the GPU's attention
    kernel), priced by the GPU's device preset (A100-80GB's where it has none); its metrics rows."""
    from dataclasses import replace

    from flexmesh.report.runs import read_metrics, training_plan
    from flexmesh.spec.cluster import preset_of_gpu

    preset = preset_of_gpu(gpu_name)
    plan_path = out / "plan-gpu.json"
    replace(training_plan(1, size.seq_len, size.global_batch), cluster=f"1x{preset or 'A100-80GB'}",
            cost_source="preset").save(plan_path)
    run_dir = out / "runs" / "gpu"
    _flexmesh(["train", "--plan", str(plan_path), "--corpus", "stdlib", "--max-steps", str(size.steps), "--out",
               str(run_dir), "--overwrite", "--seed", str(size.seed), "--device", "cuda", "--dtype", "bf16",
               "--policy", "fixed"], "train on one GPU")
    return {"name": gpu_name, "preset": preset, "rows": read_metrics(run_dir / "metrics.jsonl")}
