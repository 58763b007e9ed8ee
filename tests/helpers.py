"""What several test files share: the tiny model, its training settings and hand-built steps, the
launcher of worker scripts (ranks forked by a fork server), the inputs of a `flexmesh train` run
and three ways to run the command: a child process, forked ranks, or this process.

A plain module (no ``test_`` prefix, so pytest collects no tests from it); test files import it as
``helpers``: pytest puts this folder on ``sys.path`` (see conftest.py), and a test file run as a
worker script has its own folder there.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

STEPS = 3
SEED = 7
LR = 1e-3


def tiny_spec() -> Any:
    """The 4-layer model every multi-process runtime test trains (fp32, vocabulary of 256)."""
    from flexmesh.spec.model import ModelSpec

    return ModelSpec(name="test-tiny", num_layers=4, hidden=64, num_heads=4, num_kv_heads=2, ffn_hidden=128,
                     vocab=256, dtype="fp32", max_position=1024)


def flat_model_profile(**fields: Any) -> Any:
    """A model profile of the tiny model with every fit 1 ms + 1 us per token (``fields`` added or replaced)."""
    from flexmesh.profile import ModelProfile
    from flexmesh.profile.fit import LayerFit
    from flexmesh.spec import MODEL_PRESETS

    fit = LayerFit(1e-3, 1e-6, 0.0)
    base: dict[str, Any] = dict(
        model=MODEL_PRESETS["tiny"].to_dict(), dtype="fp32",
        layer={"forward": fit, "backward": fit, "backward_recompute": fit},
        embedding={"forward": fit, "backward": fit}, head={"forward": fit, "backward": fit},
        activations={"layers": [{"tp": 1, "cp": 1, "recompute": False, "bytes_per_token": 100.0}],
                     "attention_mask_bytes_per_sq_row_token": 0.0,
                     "embedding_bytes_per_token": 4.0, "head_bytes_per_token": 8.0},
        states={"weight_bytes_per_param": 4, "grad_bytes_per_param": 4,
                "optimizer_bytes_per_param": 8, "optimizer_step_s_per_param": 1e-9}, name="tiny.json")
    return ModelProfile(**{**base, **fields})


def train_config() -> Any:
    """AdamW settings for ``STEPS`` steps with warm-up and clipping, no progress bar."""
    from flexmesh.runtime.train.config import TrainConfig

    return TrainConfig(max_steps=STEPS, lr=LR, warmup_steps=1, weight_decay=0.1, grad_clip=1.0, seed=SEED,
                       progress=False)


def reference_training(steps: list, cfg: Any = None, spec: Any = None) -> tuple[list[float], list[float], dict, dict]:
    """Plain single-process AdamW steps over ``[(docs, StepSchedule)]`` (flexmesh.runtime.train.reference,
    documents whole) of ``spec`` (default the tiny model) under ``cfg`` (default train_config()):
    losses, gradient norms, step 1's clipped gradients and the weights after the last step -- what the
    distributed runs are compared against."""
    import torch

    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.train.config import lr_schedule_factor
    from flexmesh.runtime.train.reference import reference_loss

    cfg = cfg if cfg is not None else train_config()
    model = build_model(spec if spec is not None else tiny_spec(), device="cpu")
    model.init_weights(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_schedule_factor(s, cfg.warmup_steps, cfg.max_steps,
                                                                               cfg.min_lr_ratio))
    losses, norms, grads = [], [], {}
    for i, (docs, schedule) in enumerate(steps):
        opt.zero_grad()
        losses.append(reference_loss(model, docs, schedule))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
        if i == 0:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        sched.step()
    return losses, norms, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


EVEN = 16  # the length of every document but the cut one in make_steps(even=True)


def make_steps(data_ranks: int, cp: int, steps: int = STEPS, seed: int = SEED, cut: bool = True,
               even: bool = False) -> list:
    """Documents and hand-built StepSchedules: one group per dp replica, cp data ranks each.

    Groups get different numbers of micro-batches (exercising the empty padding micro-batches), and
    with ``cut`` one document is cut in two pieces that land in different micro-batches (else it
    stays whole where its first piece would be). The documents are 3 to 39 tokens long, or with
    ``even`` all ``EVEN`` but the 50-token one: the micro-batches then take a few lengths rather than
    one each, for layouts whose every new micro-batch shape costs (tensor parallelism's DTensors
    propagate the sharding of each shape once) where uneven lengths of the same layout are checked
    elsewhere.
    """
    from flexmesh.layout.step import Group, Piece, StepSchedule

    rng = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        lengths = rng.integers(3, 40, size=7)
        docs = [rng.integers(1, 256, size=EVEN if even else int(n)) for n in lengths]
        docs.append(rng.integers(1, 256, size=50))  # the document cut across micro-batches
        n_groups = data_ranks // cp
        per_group: list[list[list[Piece]]] = [[] for _ in range(n_groups)]
        for i in range(7):
            g = i % n_groups
            mbs = per_group[g]
            if not mbs or len(mbs[-1]) >= 2 or (g == 0 and len(mbs) < 1 + s % 2):
                mbs.append([])
            mbs[-1].append(Piece(i, 0, len(docs[i])))
        last = per_group[-1]
        last[-1].append(Piece(7, 0, 20 if cut else 50))
        if cut:
            last.append([Piece(7, 20, 50)])
        groups = tuple(Group(ranks=tuple(range(g * cp, (g + 1) * cp)), microbatches=tuple(tuple(mb) for mb in mbs))
                       for g, mbs in enumerate(per_group))
        sched = StepSchedule(lengths=tuple(len(d) for d in docs), groups=groups, policy="test")
        sched.validate(data_ranks)
        out.append((docs, sched))
    return out


def launch(nproc: int, args: list[str], *, script: str, timeout: float = 240, fresh: bool = False,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` (a test file that is also its worker: ``python script *args``; or ``-m MODULE``) as
    ``nproc`` ranks of one torch.distributed world and return what they printed, as torchrun's
    CompletedProcess would (returncode: the first failing rank's, else 0; stdout and stderr: every
    rank's, in rank order).

    The ranks are forked by :func:`rank_server`, where torch and flexmesh are imported already: a rank
    starts in milliseconds, where a fresh one imported torch for seconds (with torchrun's own start,
    most of a short multi-process test's time). Each gets torchrun's variables (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT at a free port, ...), ``env`` added to this process's
    variables, one intra-op thread, its output in files of its own, runs ``script`` as ``__main__``
    and leaves by ``os._exit``. A rank that fails takes the others down, as torchrun does; past
    ``timeout`` every rank is killed and subprocess.TimeoutExpired raised. ``fresh`` runs torchrun
    instead: for workers that use CUDA, as torchrun runs them on a GPU machine (torch.compile runs in a
    forked rank: tests/test_compile.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    if fresh:  # a fresh interpreter imports this checkout's flexmesh, installed or not (as on a GPU machine)
        from flexmesh.runtime.launch import run_torchrun

        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)

        return run_torchrun(nproc, [script, *args], env=env, capture_output=True, text=True, timeout=timeout)
    import shutil
    import tempfile
    import time
    from multiprocessing.connection import wait

    from flexmesh.runtime.launch import free_port

    logs = Path(tempfile.mkdtemp(prefix="flexmesh-ranks-"))
    port = free_port()
    procs = [rank_server().Process(target=_rank_main, args=(rank, nproc, port, script, args, env, logs))
             for rank in range(nproc)]
    for p in procs:
        p.start()
    end, failed, timed_out = time.monotonic() + timeout, 0, False
    try:
        while not failed:
            running = [p for p in procs if p.exitcode is None]
            failed = next((p.exitcode for p in procs if p.exitcode), 0)
            if not running or failed:
                break
            timed_out = time.monotonic() > end
            if timed_out:
                break
            wait([p.sentinel for p in running], timeout=0.5)
    finally:
        left = [p for p in procs if p.exitcode is None]
        _dump_stacks([p.pid for p in left if p.pid])  # ranks left after another failed, or after the timeout
        for p in left:
            p.kill()
            p.join()
    out, err = ("".join((logs / f"{r}.{kind}").read_text(errors="replace") for r in range(nproc)
                        if (logs / f"{r}.{kind}").exists())
                for kind in ("out", "err"))
    shutil.rmtree(logs, ignore_errors=True)
    cmd = ["launch", str(nproc), script, *args]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(cmd, failed, out, err)


# What the ranks import, once in the fork server rather than in every rank (seconds each).
_RANK_IMPORTS = ["torch", "torch.distributed.checkpoint.state_dict", "torch.distributed.pipelining",
                 "flexmesh.runtime.train.loop", "flexmesh.runtime.train.trainer", "flexmesh.cli",
                 "flexmesh.commands.train", "flexmesh.profile.runner", "helpers"]


def rank_server() -> Any:
    """multiprocessing's fork-server context that :func:`launch` and :func:`spawn` start ranks from.

    The server is a fresh interpreter that imported torch and the trainer once and never does more: a
    rank forked from it starts in milliseconds and inherits nothing of this test process (its threads,
    whatever earlier tests here left behind: a lock held at the moment of a fork hangs the child)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_IMPORTS)
    return ctx


def _dump_stacks(pids: list[int]) -> None:
    """Ask ranks that are still running to print every thread's stack (faulthandler, on SIGUSR1) and
    give them a moment: a rank that hangs says where, in the output of the test that failed."""
    import signal
    import time

    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if pids:
        time.sleep(1.0)


def _to_files(logs: Path, rank: int) -> None:
    """This process's stdout and stderr into ``logs``/RANK.out and .err."""
    import faulthandler
    import io
    import signal

    for fd, name in ((1, f"{rank}.out"), (2, f"{rank}.err")):
        f = os.open(logs / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it hangs: see _dump_stacks


def _rank_main(rank: int, world: int, port: int, script: str, args: list[str], env: dict, logs: Path) -> None:
    """A rank of :func:`launch`: torchrun's variables, output to ``logs``, ``script`` (a file, or
    ``-m MODULE``) as ``__main__``."""
    import runpy
    import traceback

    code = 1
    try:
        _to_files(logs, rank)
        os.environ.clear()
        os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
                          TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none")
        import torch

        torch.set_num_threads(1)
        if script.startswith("-m "):  # python -m MODULE *args
            sys.argv = [script[3:], *args]
            runpy.run_module(script[3:], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def load_params(folder: Path) -> dict:
    """The full parameters a worker saved per pipeline stage (``params_pp*.pt``), merged."""
    import torch

    params: dict = {}
    for f in sorted(folder.glob("params_pp*.pt")):
        params.update(torch.load(f))
    return params


def zero2_plan(world: int) -> Any:
    """The tiny model's 4 layers data-parallel over ``world`` ranks with ZeRO-2, pp 1, 256-token sequences."""
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    st = StagePlan(0, 4, tuple(LayerStrategy.parse(f"tp1-dp{world}z2") for _ in range(4)))
    return Plan.uniform(model="test-tiny", cluster="cpu", world_size=world, pp=1, pipeline_schedule="1f1b",
                        num_microbatches=1, seq_len=256, global_batch=8, stages=(st,))


def write_inputs(tmp: Path, world: int) -> tuple[Path, Path, Path]:
    """A 2-layer Hugging Face config, a folder of 24 small documents and a plan for ``world`` ranks."""
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    cfg = tmp / "config.json"
    cfg.write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 320, "torch_dtype": "float32",
        "max_position_embeddings": 512}))
    corpus = tmp / "corpus"
    corpus.mkdir()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly boxing".split()
    for i in range(24):  # documents of very different lengths
        n = 5 + (i * 37) % 90
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(words[(i + j * 3) % len(words)] for j in range(n)))
    st = StagePlan(0, 2, (LayerStrategy.parse(f"tp1-dp{world}z3"), LayerStrategy.parse(f"tp1-dp{world}z2-ac")))
    plan = Plan.uniform(model=str(cfg), cluster=f"{world}xA100-80GB", world_size=world, pp=1, pipeline_schedule="1f1b",
                num_microbatches=1, seq_len=128, global_batch=4, stages=(st,))
    plan_path = tmp / "plan.json"
    plan.save(plan_path)
    return cfg, corpus, plan_path


def flexmesh(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m flexmesh *args`` in a child process, one intra-op thread, output captured."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "flexmesh", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def flexmesh_ranks(nproc: int, *args: str, timeout: float = 240,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The ranks of ``torchrun --nproc-per-node nproc -m flexmesh *args`` forked from this process
    (:func:`launch`), without the ``--nproc`` launcher or torchrun: for runs a test needs the results of
    (checkpoints to export, metrics to compare) rather than the launcher's own behaviour, which the tests
    of `flexmesh train --nproc` check. Rank 0 holds the output folder itself, as under plain torchrun;
    ``nproc`` 1 is a single-process run; ``env``: variables added to this process's."""
    return launch(nproc, list(args), script="-m flexmesh", timeout=timeout, env=env)


def run_flexmesh_here(argv: Sequence[str], what: str, *, capture: bool = True,
                      timeout: float | None = None) -> subprocess.CompletedProcess:
    """What :func:`flexmesh.runtime.launch.run_flexmesh` does, without a child's start-up: ``--nproc N``
    as N ranks forked by the fork server (:func:`flexmesh_ranks`), any other command in this process
    (:func:`flexmesh_here`). Put in its place (monkeypatch) by tests of commands that run flexmesh in
    children, the demo's, to check what those children make; the launchers have tests of their own."""
    from flexmesh.runtime.launch import check_flexmesh, without_flags

    argv = list(argv)
    nproc = next((int(v) for k, v in zip(argv, argv[1:]) if k == "--nproc"), None)
    if nproc is None:
        proc = flexmesh_here(*argv)
    else:
        proc = flexmesh_ranks(nproc, *without_flags(argv), timeout=timeout or 600)
    if not capture:
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
    return check_flexmesh(proc, argv, what)


def flexmesh_here(*args: str) -> subprocess.CompletedProcess:
    """``flexmesh *args`` in this process (flexmesh.cli.main), returned as :func:`flexmesh` returns it,
    without a child's start-up (a Python with torch: seconds of CPU each). For commands that stop before
    anything trains or launches (refusals, one-line errors): what the command put in the environment
    and any process group it started are undone, so the next test starts from the same state. An
    exception main() lets through is a traceback on stderr and exit 1, as in a child process."""
    import contextlib
    import io
    import traceback

    from flexmesh.cli import main

    saved = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 1
            except Exception:
                err.write(traceback.format_exc())
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return subprocess.CompletedProcess(["flexmesh", *args], code, out.getvalue(), err.getvalue())


def cp_model_check(rank: int, world: int, spec: Any, plain: Any = None) -> None:
    """Inside a gloo worker: the whole model under Ulysses and under ring context parallelism gives
    the loss and gradients of one process on three packed documents (1e-5). With ``plain`` (a spec
    without the feature under test), first check that the feature changes the one-process loss."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from flexmesh.layout.step import Piece
    from flexmesh.runtime.model.packing import pack_microbatch, pad_to_multiple, shard_for_cp
    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.parallel.context import ContextParallelAttention, CPContext, apply_context_parallel

    def loss_of(model: Any, batch: Any, count: int) -> Any:
        return F.cross_entropy(model(batch.tokens, batch)[0], batch.labels[0], reduction="sum") / count

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, spec.vocab, n) for n in (13, 30, 4)]
    full = pad_to_multiple(pack_microbatch(docs, tuple(Piece(i, 0, len(d)) for i, d in enumerate(docs))), world)
    ref = build_model(spec, "cpu")
    ref_loss = loss_of(ref, full, full.num_label_tokens)
    ref_loss.backward()
    if plain is not None:
        assert abs(loss_of(build_model(plain, "cpu"), full, full.num_label_tokens).item() - ref_loss.item()) > 1e-6
    mine = shard_for_cp(full, rank, world)
    for kind in ("ulysses", "ring"):
        model = build_model(spec, "cpu")
        apply_context_parallel(model, ContextParallelAttention(CPContext(kind, dist.group.WORLD, rank, world)))
        loss = loss_of(model, mine, full.num_label_tokens)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-5, atol=0, msg=f"{kind} loss")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            dist.all_reduce(p.grad)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"{kind} grad {name}")


def unlocked(out: Path) -> bool:
    """Whether no run holds the output folder ``out`` (its lock file can be taken, and is let go)."""
    with open(out / ".flexmesh.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def check_simulated_against_bound(policy: str, ctx: Any, lens: Any, options: dict,
                                  exact_prediction: bool = True) -> None:
    """Schedule ``lens`` with ``policy`` and simulate it: the micro-batch phase is never below the
    scheduler's lower bound, the step never below bound + tail, and (``exact_prediction``) the
    scheduler's predicted time equals the simulated phase."""
    import pytest

    from flexmesh.schedule.registry import make_schedule
    from flexmesh.sim.timeline import simulate_step

    s = make_schedule(policy, lens, ctx, **options)
    slot = s.extra["context"] if policy == "padded" else None  # a padded slot computes its padding
    tl = simulate_step(ctx, s, slot_tokens=slot)
    phase = float(tl.work_end.max())
    assert phase >= s.lower_bound * (1 - 1e-9)
    assert tl.step_time >= s.lower_bound + tl.tail - 1e-12
    if exact_prediction:
        assert s.predicted_step_time == pytest.approx(phase, rel=1e-9)


def golden_losses() -> dict:
    """tests/golden/losses.json: per-step losses recorded before the plan types merged
    (tests/golden/record_losses.py says how)."""
    return json.loads((Path(__file__).with_name("golden") / "losses.json").read_text())


def assert_golden(section: str, name: str, losses: list[float], field: str = "loss") -> None:
    """``losses`` (per step) equal the ones recorded before the plan types merged (:func:`golden_losses`)
    within 1e-7, relative: the merge changed no layout's numbers. What they promise on every machine: torch's
    CPU kernels take the host's SIMD path (AVX2, AVX-512) and sum in its order, a few float32 ulps a step
    (1.2e-7 each) that training carries on; within 1e-7 of the loss, not bit for bit."""
    golden = golden_losses()
    table = golden[section] if field == "loss" else golden[field][section]
    want = table[name]
    assert len(losses) == len(want), f"{section} {name}: {len(losses)} steps, golden {len(want)}"
    for step, (got, ref) in enumerate(zip(losses, want)):
        assert abs(got - ref) <= 1e-7 * abs(ref), f"{section} {name} step {step + 1}: {field} {got} vs golden {ref}"


def spawn(fn: Any, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes (torch.multiprocessing, forked by :func:`rank_server`),
    each leaving by ``os._exit(0)`` once ``fn`` returns: at interpreter exit gloo's threads can abort a
    process whose run passed ("terminate called without an active exception"), which would be reported
    as a failure. ``fn`` is a module-level function of a test file. What the processes print is printed
    here afterwards; when one fails, the others print where they were before they are stopped."""
    import shutil
    import tempfile

    import torch.multiprocessing as mp

    rank_server()
    logs = Path(tempfile.mkdtemp(prefix="flexmesh-spawn-"))
    try:
        mp.start_processes(_exit_after, args=(logs, fn, *args), nprocs=nprocs, join=True, start_method="forkserver")
    finally:
        for r in range(nprocs):
            for kind, stream in (("out", sys.stdout), ("err", sys.stderr)):
                if (logs / f"{r}.{kind}").exists():
                    stream.write((logs / f"{r}.{kind}").read_text(errors="replace"))
        shutil.rmtree(logs, ignore_errors=True)


def _exit_after(rank: int, logs: Path, fn: Any, *args: Any) -> None:
    import faulthandler
    import signal

    _to_files(logs, rank)
    # torch.multiprocessing stops the other processes by SIGTERM when one fails: each prints where it was
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def randomise_hf(model: Any, seed: int) -> None:
    """Weights that make norm, bias and RoPE mistakes visible (transformers' init has unit norms, zero
    biases): norms 1 + 0.5 N(0, 1), biases 0.2 N(0, 1), embeddings 0.01 N(0, 1) (small first activations,
    so that rms_norm_eps shows), every other tensor N(0, 1) / sqrt(its last dimension)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.5 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.01 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def rel_diff(got: Any, want: Any) -> float:
    """Largest difference over the largest value of ``want``."""
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max())


def assert_below(diffs: dict[str, float], tol: float, what: str) -> None:
    """Every one of ``diffs`` (:func:`transformers_diffs`) below ``tol``; the largest printed (``-s``)."""
    worst = max(diffs, key=lambda k: diffs[k])
    print(f"\n{what}: max relative difference {diffs[worst]:.2e} ({worst})")
    assert diffs[worst] < tol, {k: v for k, v in diffs.items() if v >= tol}


def transformers_diffs(model: Any, hf: Any, docs: list) -> dict[str, float]:
    """How far flexmesh's ``model`` is from transformers' ``hf`` holding the same weights (fp32): the
    logits of the last document alone, of every document packed in one row (against a transformers
    pass per document, in order: dynamic RoPE keeps state), the next-token loss and every gradient
    (the rel_diff of each, by name). Both models' gradients are overwritten."""
    import torch
    import torch.nn.functional as F

    from flexmesh.layout.step import Piece
    from flexmesh.runtime.model.packing import pack_microbatch
    from flexmesh.runtime.state.weights import hf_name

    hf.zero_grad()
    n = sum(len(d) - 1 for d in docs)
    want_logits, want_loss = [], torch.zeros(())
    for d in docs:
        out = hf(torch.as_tensor(d)[None]).logits[0]
        want_loss = want_loss + F.cross_entropy(out[:-1], torch.as_tensor(d[1:]), reduction="sum") / n
        want_logits.append(out.detach())
    want_loss.backward()
    diffs = {}
    single = pack_microbatch(docs[-1:], (Piece(0, 0, len(docs[-1])),))
    with torch.no_grad():
        diffs["one sequence"] = rel_diff(model(single.tokens, single)[0], want_logits[-1])
    packed = pack_microbatch(docs, tuple(Piece(i, 0, len(d)) for i, d in enumerate(docs)))
    logits = model(packed.tokens, packed)
    diffs["packed row"] = rel_diff(logits[0], torch.cat(want_logits))
    loss = F.cross_entropy(logits[0], packed.labels[0], ignore_index=-100, reduction="sum") / packed.num_label_tokens
    loss.backward()
    diffs["loss"] = rel_diff(loss.detach(), want_loss.detach())
    hf_params = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        key = hf_name(name)
        diffs[f"grad {key}"] = rel_diff(p.grad, hf_params[key].grad)
    return diffs


# Relative tolerance of a golden's float: a sum of up to thousands of terms, reordered by another host's SIMD path,
# moves by at most its terms' count x 2^-53 relative (4,096 terms: 4.5e-13).
REL = 1e-12
# Absolute tolerance beside it: a difference of two near-equal values (a solver's relative gap) keeps their absolute
# error (a few 2^-53), not a relative one of its own.
ABS = 1e-14


def assert_matches(got, want, where: str) -> None:
    """``got`` is ``want``: the same structure, keys, integers, names and flags, floats within :data:`REL` (or
    :data:`ABS`)."""
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        assert math.isclose(got, want, rel_tol=REL, abs_tol=ABS), f"{where}: {got!r}, recorded {want!r}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_matches(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {len(got)} entries, recorded {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_matches(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r}, recorded {want!r}"
