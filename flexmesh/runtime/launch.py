"""Starting ranks: the torchrun command line, the environment of a child that launches its own ranks,
and a loopback port for the rendezvous.

Everything that starts ranks goes through here: ``flexmesh train --nproc N`` and ``flexmesh profile
... --nproc N`` re-running themselves under torchrun (:func:`relaunch_flexmesh`), the demo and the
benchmarks running ``flexmesh`` in children (:func:`child_env`), and benchmarks and tests running a
worker script on several ranks (:func:`run_torchrun`).

No torch import here: a launcher only builds a command line, and the parent of a torchrun launch
should not pay for importing torch (seconds) when only its children train.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
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


def relaunch_flexmesh(nproc: int, argv: Sequence[str]) -> int:
    """Run ``flexmesh *argv`` (its ``--nproc`` removed) as ``nproc`` ranks under torchrun; its exit code.

    The children inherit this process's environment and output, as if the user had typed the
    torchrun command.
    """
    return run_torchrun(nproc, ["-m", "flexmesh", *without_nproc(argv)]).returncode
