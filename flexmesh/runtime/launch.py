"""Starting ranks: the torchrun command line, the environment of a child that launches its own ranks,
and a loopback port for the rendezvous.

Everything that starts ranks goes through here: ``flexmesh train --nproc N`` and ``flexmesh profile
... --nproc N`` re-running themselves under torchrun (:func:`relaunch_flexmesh`), the demo and the
benchmarks running ``flexmesh`` in children (:func:`child_env`), and benchmarks and tests running a
worker script on several ranks (:func:`run_torchrun`).

No torch import here: a launcher only builds a command line, and the parent of a torchrun launch
should not pay for importing torch (seconds) when only its children train.

Signals (:func:`run_supervised`): Ctrl-C or SIGTERM on ``flexmesh ... --nproc N`` is passed on to
torchrun, which passes it to every rank and waits for them (its shutdown timeout, 30 s by default,
then SIGKILL); the launcher waits for torchrun and kills whatever it left behind. Before, the
launcher died at once and took torchrun with it, leaving the ranks running unseen.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The variables torchrun sets in each rank; a child that starts its own ranks must not inherit them,
# or it would join (or rendezvous at the port of) the launch this process belongs to.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    """This process's environment for a child that launches its own ranks (torchrun, ``flexmesh train
    --nproc``): without the rank variables of a launch this process may be part of, and with one
    intra-op thread per process unless the caller chose otherwise."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def single_process_env(port: int | None = None) -> dict[str, str]:
    """The variables that make a plain process a world of one rank (rank 0 of 1 on loopback).

    ``port`` defaults to a free one. ``os.environ.update(single_process_env())`` before
    ``init_distributed()`` lets a process that torchrun did not start use the same code path.

    >>> env = single_process_env(port=29500)
    >>> env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]
    ('0', '1', '127.0.0.1', '29500')
    """
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port if port is not None else free_port())}


def torchrun_command(nproc: int, target: Sequence[str], port: int | None = None) -> list[str]:
    """The command line that runs ``target`` as ``nproc`` ranks on this node under torchrun.

    ``target`` is a script and its arguments (``["bench/runtime.py", "worker", ...]``) or a module
    (``["-m", "flexmesh", "train", ...]``). The rendezvous is on loopback at ``port`` (default: a
    free one), so two launches on one machine never meet.

    >>> torchrun_command(2, ["-m", "flexmesh", "train"], port=29500)[1:]  # [0] is this Python
    ['-m', 'torch.distributed.run', '--nproc-per-node', '2', '--master-addr', '127.0.0.1', \
'--master-port', '29500', '-m', 'flexmesh', 'train']
    """
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(port if port is not None else free_port()),
            *target]


def run_torchrun(nproc: int, target: Sequence[str], env: dict[str, str] | None = None,
                 **run_kwargs: Any) -> subprocess.CompletedProcess:
    """Run ``target`` as ``nproc`` ranks (:func:`torchrun_command`) and wait for it.

    ``env`` is the children's environment (default: this process's); ``run_kwargs`` go to
    ``subprocess.run`` (``capture_output``, ``text``, ``timeout``, ...).
    """
    return subprocess.run(torchrun_command(nproc, target), env=env, **run_kwargs)


def without_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` less its ``--nproc N`` / ``--nproc=N``: what the ranks of a relaunch are given.

    >>> without_nproc(["train", "--nproc", "4", "--plan", "p.json", "--nproc=2"])
    ['train', '--plan', 'p.json']
    """
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
    return forwarded


def relaunch_flexmesh(nproc: int, argv: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run ``flexmesh *argv`` (its ``--nproc`` removed) as ``nproc`` ranks under torchrun; its exit code.

    The children inherit this process's environment (or ``env``) and output, as if the user had
    typed the torchrun command; signals reach them (:func:`run_supervised`).
    """
    return run_supervised(torchrun_command(nproc, ["-m", "flexmesh", *without_nproc(argv)]), env=env)


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_supervised(command: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run ``command`` (a torchrun command line) to its end and return its exit code.

    SIGINT, SIGTERM and SIGHUP sent to this process are forwarded to the child instead of ending
    this process, so torchrun can stop its ranks; a second SIGINT kills it outright. The child runs
    in its own process group (a terminal's Ctrl-C reaches only this process, once). On Linux this
    process adopts orphaned descendants (a child subreaper), so ranks that outlive torchrun are
    killed before it returns.
    """
    adopts = _become_subreaper()
    proc = subprocess.Popen(list(command), env=env, start_new_session=True)
    seen: list[int] = []

    def forward(signum: int, frame: object) -> None:
        again = signum == signal.SIGINT and signal.SIGINT in seen
        seen.append(signum)
        try:
            os.kill(proc.pid, signal.SIGKILL if again else signum)
        except ProcessLookupError:
            pass

    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in FORWARDED} if main else {}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if proc.poll() is None:  # this process is being torn down by an exception: take the child along
            proc.kill()
            proc.wait()
        if adopts:
            _kill_adopted()


def _become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux prctl PR_SET_CHILD_SUBREAPER)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _kill_adopted() -> None:
    """SIGKILL and reap this process's remaining children: ranks orphaned by a dead torchrun."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                os.waitpid(int(entry.name), 0)
            except (ProcessLookupError, ChildProcessError):
                pass
