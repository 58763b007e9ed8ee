"""Runs that survive: signals on the `flexmesh train --nproc` launcher, preemption, a stopped rank, one
run per output folder, starting over without losing history, a metrics file cut short.

Every run a test signals or stops is the real command (launcher, torchrun, two ranks of a 2-layer model
on CPU); the processes of such a run carry a marker in their environment, so the tests can find its
ranks and check that none outlives the launcher. Runs only read afterwards (a resume to the end, the
run never stopped) train in the command's ranks from the fork server (helpers.flexmesh_ranks).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import flexmesh_here, flexmesh_ranks, unlocked, write_inputs

MARK = "FLEXMESH_TEST_RUN"
# Straggler events would add console lines on a loaded machine; they have their own tests.
QUIET = ["--straggler-threshold", "0.99"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("failures")
    _, corpus, plan = write_inputs(tmp, world=2)
    return {"tmp": tmp, "common": ["train", "--plan", str(plan), "--corpus", str(corpus),
                                   "--cache-dir", str(tmp / "cache"), "--no-progress", "--lr", "1e-3"]}


class Run:
    """A `flexmesh train --nproc 2` started in the background, output to ``out.log``."""

    def __init__(self, inputs: dict, out: Path, *extra: str, max_steps: int = 100000) -> None:
        self.out, self.mark = out, uuid.uuid4().hex
        self.log = out.parent / f"{out.name}-{self.mark[:6]}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{MARK: self.mark})
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flexmesh", *inputs["common"], "--nproc", "2", "--out", str(out),
                 "--max-steps", str(max_steps), *extra], env=env, stdout=log, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return " ".join(self.log.read_text().split())  # rich wraps long lines

    def steps(self) -> list[int]:
        f = self.out / "metrics.jsonl"
        lines = f.read_text().splitlines() if f.is_file() else []
        return [json.loads(ln)["step"] for ln in lines if ln.endswith("}")]

    def wait_steps(self, n: int, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while len(self.steps()) < n:
            assert self.proc.poll() is None, f"run ended early (rc {self.proc.returncode}):\n{self.text()[-3000:]}"
            assert time.monotonic() < end, f"no {n} steps in {timeout} s:\n{self.text()[-3000:]}"
            time.sleep(0.05)  # a step can take 0.1 s: a late look lets the run go on further than the test meant

    def ranks(self) -> dict[int, int]:
        """rank -> pid of this run's live worker processes."""
        return {int(env["RANK"]): pid for pid, env in _marked(self.mark).items() if "RANK" in env}

    def wait(self, timeout: float = 90) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"launcher still running after {timeout} s:\n{self.text()[-3000:]}") from None

    def kill(self) -> None:
        for pid in [self.proc.pid, *_marked(self.mark)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def survivors(self) -> list[int]:
        end = time.monotonic() + 5  # the kernel may take a moment to take down killed processes
        while _marked(self.mark) and time.monotonic() < end:
            time.sleep(0.1)
        return sorted(_marked(self.mark))


def _marked(mark: str) -> dict[int, dict[str, str]]:
    """Live processes (not zombies) whose environment carries ``MARK=mark``: pid -> environment."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            raw = (d / "environ").read_bytes()
        except OSError:
            continue
        env = dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)
        if env.get(MARK) == mark:
            found[int(d.name)] = env
    return found


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ctrl_c_and_sigterm_at_random_moments_stop_every_rank_cleanly_and_the_resumed_losses_are_exact(inputs):
    """One run stopped three times on its launcher: Ctrl-C at a random moment of a run that checkpoints
    every step (so it may land during a checkpoint write), SIGTERM (preemption) once, and a rank that stops
    answering once (:func:`_stop_a_rank`); SIGHUP takes Ctrl-C's path in the launcher
    (test_sighup_on_the_launcher_is_taken_as_ctrl_c). After
    Ctrl-C the ranks stop at the next step boundary and the launcher ends with 128 + SIGINT within the
    minute the test waits (no tighter wall-clock bound: how long the ranks take to leave is the machine's
    load), at most 3 lines were printed, no checkpoint was started after the signal and none is left
    half-written; after SIGTERM the step that was running is checkpointed although none is due; each time
    no process is left behind and the folder is free. The run resumed after each stop (through the
    launcher: every attempt after the first) then to its end, past a metrics line a crash cut short, has
    the losses of a run never stopped (the last stretch and that run train in the command's ranks from
    the fork server). Starting over moves the whole run aside."""
    # 24 steps: a Ctrl-C attempt of at most ~8 steps (a first step, <= 1 s of 0.2-0.3 s steps, the stop),
    # a preempted one and a stopped rank's of a few steps each leave it unfinished when the last stop comes
    total, flags = 24, ["--checkpoint-every", "1", *QUIET]
    out = inputs["tmp"] / "interrupted"
    _stop_and_resume(inputs, out, total, flags)
    # The run never stopped: its own folder, not checkpointed either (saving must not change what it trains).
    whole = inputs["tmp"] / "never-stopped"
    ran = flexmesh_ranks(2, *inputs["common"], "--out", str(whole), "--max-steps", str(total), *QUIET,
                         timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    reference = [json.loads(ln)["loss"] for ln in (whole / "metrics.jsonl").read_text().splitlines()]
    assert len(reference) == total
    losses = [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses == reference  # exact: resumed: the same operations in the same order from the restored state
    _start_over(inputs, out, total)


def test_sighup_on_the_launcher_is_taken_as_ctrl_c(tmp_path):
    """A closed terminal's SIGHUP on the launcher reaches what it runs as SIGINT: from there it is the Ctrl-C of
    the test above (the same handler, :func:`flexmesh.runtime.launch.run_supervised`). In a process of its own:
    the launcher adopts and kills what is left of its children."""
    ready = tmp_path / "ready"
    child = ("import pathlib, signal, sys, time\n"
             "signal.signal(signal.SIGINT, lambda *a: sys.exit(42))\n"
             "signal.signal(signal.SIGHUP, lambda *a: sys.exit(43))\n"
             f"pathlib.Path({str(ready)!r}).touch()\n"
             "time.sleep(60)")
    launcher = ("import os, pathlib, signal, sys, threading, time\n"
                "from flexmesh.runtime.launch import run_supervised\n"
                "def hang_up():\n"
                f"    while not pathlib.Path({str(ready)!r}).exists(): time.sleep(0.02)\n"
                "    os.kill(os.getpid(), signal.SIGHUP)\n"
                "threading.Thread(target=hang_up, daemon=True).start()\n"
                f"sys.exit(run_supervised([sys.executable, '-c', {child!r}]))")
    done = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60)
    assert done.returncode == 42, (done.returncode, done.stderr[-3000:])  # the child's SIGINT handler, not SIGHUP's


def _stop_and_resume(inputs: dict, out: Path, total: int, flags: list[str]) -> None:
    """The three stops of the test above, then the run resumed to its end (checkpointing at its end only: the
    stops checked checkpoints written every step). The Ctrl-C comes to a resumed attempt: its at most 3 lines
    include "resuming from"."""
    rng = random.Random(0)
    for moment, sig in enumerate((signal.SIGSTOP, signal.SIGINT, signal.SIGTERM)):
        if sig == signal.SIGTERM:
            _preempt(inputs, out, total)
            continue
        if sig == signal.SIGSTOP:
            _stop_a_rank(inputs, out, total)
            continue
        run = Run(inputs, out, *flags, max_steps=total)
        try:
            run.wait_steps(len(run.steps()) + 1)  # this attempt's first step is in (resumed or fresh)
            assert len(run.ranks()) == 2
            time.sleep(rng.uniform(0.0, 1.0))  # a step and its checkpoint take about 0.3 s here
            run.proc.send_signal(sig)
            rows_after_signal = len(run.steps())
            rc = run.wait(timeout=60)  # a launcher still running then fails here
            survivors = run.survivors()  # before the clean-up below kills them
        finally:
            run.kill()
        said = run.log.read_text().splitlines()
        assert rc == 128 + signal.SIGINT, (moment, said)
        assert survivors == [], (moment, survivors)
        assert unlocked(out)
        assert len(said) <= 3, (moment, said)  # the device line, "resuming from", and how to resume
        (stopped,) = [int(w.rstrip(";")) for ln in said if ln.startswith("interrupted after step")
                      for w in ln.split()[3:4]]
        assert f"--nproc 2 --out {out}" in said[-1] and f"--max-steps {total}" in said[-1], said[-1]
        assert stopped <= rows_after_signal + 2  # it stopped at the next step boundary
        done = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
        assert done and done[-1] < stopped, (moment, stopped, done)  # none started after the signal
        assert not list((out / "checkpoints").glob(".tmp-*"))  # nor any left half-written
        assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{done[-1]:06d}"
        assert f"resume from {out / 'checkpoints' / f'step_{done[-1]:06d}'}" in said[-1]
    # A crash while appending leaves a partial line: resume drops it with a warning.
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": %d, "loss": 1.2' % (steps[-1] + 1))
    finished = flexmesh_ranks(2, *inputs["common"], "--out", str(out), "--max-steps", str(total), *QUIET,
                              timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "partial line" in " ".join(finished.stderr.split())
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, total + 1))


def _preempt(inputs: dict, out: Path, total: int) -> None:
    """SIGTERM on the launcher of the run resumed in ``out``, not checkpointing on its own (--checkpoint-every 0):
    the step that was running is checkpointed, every rank stops, the folder is free."""
    before = (out / "checkpoints" / "latest").read_text().strip()
    run = Run(inputs, out, "--checkpoint-every", "0", *QUIET, max_steps=total)
    try:
        run.wait_steps(len(run.steps()) + 1)
        run.proc.send_signal(signal.SIGTERM)  # preemption
        rc = run.wait()
        survivors = run.survivors()  # before the clean-up below kills them
    finally:
        run.kill()
    assert rc != 0
    assert survivors == []
    assert unlocked(out)
    assert "stopped by SIGTERM after step" in run.text()
    steps = run.steps()
    assert steps == list(range(1, len(steps) + 1))
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{steps[-1]:06d}" and latest > before  # written at the end of the step that was running
    assert not list((out / "checkpoints").glob(".tmp-*"))


def _start_over(inputs: dict, out: Path, total: int) -> None:
    """Starting over the finished run in ``out``: refused without --overwrite; with it the old run is moved
    aside, not deleted."""
    refused = flexmesh_here(*inputs["common"], "--nproc", "2", "--out", str(out), "--max-steps", "1", "--no-resume")
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "already holds a run" in said and "--overwrite" in said, said
    # the command's ranks from the fork server: rank 0 moves the old run aside (the launcher's own --overwrite:
    # tests/test_elastic.py's restarted run)
    fresh = flexmesh_ranks(2, *inputs["common"], "--out", str(out), "--max-steps", "1", "--no-resume", "--overwrite",
                           timeout=180)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    (previous,) = out.glob("previous-*")
    assert f"to{previous}" in "".join(fresh.stderr.split())  # rich folds a path longer than the line
    assert len((previous / "metrics.jsonl").read_text().splitlines()) == total
    assert (previous / "checkpoints" / f"step_{total:06d}").is_dir()
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001"]


def _stop_a_rank(inputs: dict, out: Path, total: int) -> None:
    """A rank of the run in ``out`` (checkpointing every 2 steps) that stops answering is named within
    --collective-timeout; once it is killed the run (without --max-restarts: no restart) ends, leaving no
    process, the folder free, the steps it logged and its last checkpoint. While the run holds the folder, a
    second launcher into it fails before starting a rank, naming the folder and the holder."""
    # imported before the run: the second launcher below then starts at once
    import torch.distributed  # noqa: F401

    import flexmesh.cli  # noqa: F401

    run = Run(inputs, out, "--collective-timeout", "4", "--checkpoint-every", "2", *QUIET, max_steps=total)
    try:
        before = len(run.steps())
        run.wait_steps(before + 3)  # one of this attempt's first two steps is even: its checkpoint is written
        ranks = run.ranks()
        os.kill(ranks[1], signal.SIGSTOP)  # no step ends from here on, so the run cannot reach its last one
        t0 = time.monotonic()
        # A second launcher into the same folder fails before starting a rank (in this process: one that went on
        # would start ranks, whose output does not reach what is captured), naming the folder and the holder.
        second = flexmesh_here(*inputs["common"], "--nproc", "2", "--out", str(out), "--max-steps", str(total))
        said = " ".join(second.stderr.split())
        assert second.returncode == 2 and f"{out} is in use by another run (pid {run.proc.pid})" in said, said
        while "rank 1 stopped answering" not in run.text():
            assert time.monotonic() - t0 < 40, run.text()[-3000:]
            time.sleep(0.2)
        took = time.monotonic() - t0
        os.kill(ranks[1], signal.SIGKILL)  # spare torchrun's 30 s grace for a process that cannot stop
        rc = run.wait()
        survivors = run.survivors()  # before the clean-up below kills them
    finally:
        run.kill()
    assert took < 4 + 15, took  # the timeout, three heartbeats, margin for a busy machine
    assert "--collective-timeout (now 4 s)" in run.text()
    assert rc != 0
    assert survivors == []
    assert unlocked(out)
    steps = run.steps()
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= before + 3
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{steps[-1] // 2 * 2:06d}" or latest == f"step_{steps[-1] // 2 * 2 - 2:06d}", (latest, steps)
    assert (out / "checkpoints" / latest / "manifest.json").is_file()


def test_the_run_folder_lock_names_its_holder(tmp_path):
    from flexmesh.errors import RunFolderError
    from flexmesh.runtime.state.rundir import hold_run_folder, release_run_folder

    out = tmp_path / "run"
    assert hold_run_folder(out)
    assert hold_run_folder(out)  # nested in one process: counted
    code = ("import sys; from flexmesh.runtime.state.rundir import hold_run_folder\n"
            f"try: hold_run_folder({str(out)!r})\nexcept Exception as e: print(e); sys.exit(3)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert other.returncode == 3 and f"{out} is in use by another run (pid {os.getpid()})" in other.stdout
    release_run_folder(out)
    assert not unlocked(out)
    release_run_folder(out)
    assert unlocked(out)
    with pytest.raises(RunFolderError, match="already holds a run"):
        from flexmesh.runtime.state.rundir import start_over

        (out / "metrics.jsonl").write_text("")
        start_over(out, overwrite=False)


def test_metrics_with_a_partial_last_line_are_trimmed_but_bad_lines_elsewhere_fail(tmp_path):
    from flexmesh.errors import RunFolderError
    from flexmesh.runtime.state.rundir import read_metrics

    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    with pytest.warns(UserWarning, match="partial line"):
        assert [s for s, _ in read_metrics(f)] == [1, 2]
    f.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(RunFolderError, match="line 2"):
        read_metrics(f)


def _start_up_worker(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from flexmesh.runtime.parallel.distributed import bound_collectives, init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    if rank == 1:
        time.sleep(3)  # still importing: longer than the collective timeout
    init_distributed(timeout_s=1, device="cpu", start_up_s=60)
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=group)  # start-up: nobody timed out
    bound_collectives()
    dist.barrier()
    if rank == 1:
        time.sleep(4)  # stopped after start-up: the others give up after the collective timeout
        return
    for g in (group, None):  # a group made at start-up and the world's
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1), group=g)
        assert time.monotonic() - start < 3, "the start-up bound outlived bound_collectives()"


def test_start_up_waits_for_slow_ranks_then_the_collective_timeout_holds():
    """A rank joining later than --collective-timeout is not taken for stopped; once the groups are made,
    a silent rank fails the others after the collective timeout, in every group made before."""
    from helpers import spawn

    from flexmesh.runtime.launch import free_port

    spawn(_start_up_worker, (free_port(),), 2)
