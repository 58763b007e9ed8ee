"""Starting ranks: the torchrun command line, the environment of a child that launches its own ranks,
and a loopback port for the rendezvous.

Everything that starts ranks goes through here: ``flexmesh train --nproc N`` and ``flexmesh profile
... --nproc N`` re-running themselves under torchrun (:func:`relaunch_flexmesh`), the demo and the
benchmarks running ``flexmesh`` in children (:func:`child_env`), and benchmarks and tests running a
worker script on several ranks (:func:`run_torchrun`).

No torch import here: a launcher only builds a command line, and the parent of a torchrun launch
should not pay for importing torch (seconds) when only its children train.

Restarts and several nodes (:class:`Rendezvous`): ``--max-restarts``, ``--nnodes``, ``--node-rank``,
``--rdzv-endpoint`` and ``--rdzv-id`` of ``flexmesh train --nproc`` become torchrun's c10d rendezvous
options; without them the launch is on one node, on loopback at a free port.

Signals (:func:`run_supervised`): Ctrl-C or SIGTERM on ``flexmesh ... --nproc N`` goes to every rank,
which stops at its next step boundary (Ctrl-C without starting a checkpoint, SIGTERM with one) and
exits quietly; the launcher waits for torchrun, kills whatever it left behind and exits with
128 + the signal. A second Ctrl-C kills at once. A launcher killed outright (SIGKILL, which it cannot
forward) takes its run along: on Linux torchrun and every rank die with their parent
(``PR_SET_PDEATHSIG``, :func:`die_with_launcher`), so no rank trains on without the folder's lock.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexmesh.errors import FlexmeshError, PlanError
from flexmesh.runtime.state.procs import parent_of
from flexmesh.runtime.state.rundir import HELD_ENV

# The variables torchrun sets in each rank; a child that starts its own ranks must not inherit them,
# or it would join (or rendezvous at the port of) the launch this process belongs to.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RESTART_COUNT")
SUPERVISED_ENV = "FLEXMESH_SUPERVISED"  # the pid of the launcher that stops the ranks itself (run_supervised)
RESUME_ENV = "FLEXMESH_RESUME_COMMAND"  # the command line that resumes the run, for the ranks' last word
STATUS_ENV = "FLEXMESH_EXIT_STATUS"  # a file where rank 0 leaves the exit code of a run its ranks end cleanly


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    """This process's environment for a child that launches its own ranks (torchrun, ``flexmesh train
    --nproc``): without the rank variables of a launch this process may be part of, and with one
    intra-op thread per process unless the caller chose otherwise."""
    env = {k: v for k, v in os.environ.items()
           if k not in (*LAUNCH_VARIABLES, SUPERVISED_ENV, RESUME_ENV, STATUS_ENV, HELD_ENV)}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_flexmesh(argv: Sequence[str], what: str, *, capture: bool = True,
                 timeout: float | None = None) -> subprocess.CompletedProcess:
    """``flexmesh *argv`` in a child process with :func:`child_env` (a command that launches ranks needs a
    process of its own): how the demo runs its parts. ``capture``: its output kept and returned, else
    printed here as it comes. A FlexmeshError says ``what`` failed, with the exit code, the command and
    the end of what it printed."""
    proc = subprocess.run([sys.executable, "-m", "flexmesh", *argv], env=child_env(), text=True,
                          capture_output=capture, timeout=timeout)
    return check_flexmesh(proc, argv, what)


def check_flexmesh(proc: subprocess.CompletedProcess, argv: Sequence[str], what: str) -> subprocess.CompletedProcess:
    """``proc``, a finished ``flexmesh *argv``; FlexmeshError naming ``what``, the exit code, the command
    and the end of what it printed when it failed."""
    if proc.returncode != 0:
        tail = ((proc.stdout or "") + (proc.stderr or ""))[-3000:]
        raise FlexmeshError(f"{what} failed (exit {proc.returncode}): flexmesh {' '.join(argv)}"
                            + (f"\n{tail}" if tail else ""))
    return proc


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


def launch_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables to add so this process can join its world: none under a complete launch
    (torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), a world of one when none of them is
    set; PlanError for a partial or malformed set (stray variables left from another launch).

    >>> launch_env({})["WORLD_SIZE"], launch_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h",
    ...                                          "MASTER_PORT": "29500"})
    ('1', {})
    """
    env = dict(os.environ) if env is None else env
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    given = [k for k in needed if k in env]
    if not given:
        return single_process_env()
    missing = [k for k in needed if k not in env]
    bad = [k for k in ("RANK", "WORLD_SIZE", "MASTER_PORT") if k in env and not env[k].strip().isdigit()]
    if missing or bad:
        what = f"sets {', '.join(given)} but not {', '.join(missing)}" if missing else \
            f"sets {bad[0]}={env[bad[0]]!r}, not a whole number"
        raise PlanError(f"the environment {what}: a process torchrun did not start, with variables left from "
                        f"another launch? Unset {', '.join(given)}, or start it with torchrun or --nproc")
    return {}


@dataclass(frozen=True)
class Rendezvous:
    """How the launchers of one run meet and recover: torchrun's elastic options.

    ``nnodes`` is torchrun's ``N`` or ``MIN:MAX``; ``node_rank`` tells the launchers apart (node 0's
    holds the output folder, see ``flexmesh train``); ``endpoint`` is the ``HOST:PORT`` of the c10d
    rendezvous, the same on every node; ``run_id`` names the run there; ``max_restarts`` is how many
    times torchrun restarts the whole worker group after a worker fails. Build it with
    :func:`parse_rendezvous`, which checks the values.
    """

    nnodes: str = "1"
    node_rank: int = 0
    endpoint: str | None = None
    run_id: str | None = None
    max_restarts: int = 0

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])

    @property
    def multi_node(self) -> bool:
        return self.max_nodes > 1

    @property
    def elastic(self) -> bool:
        """Whether the launch needs the c10d rendezvous: several nodes, restarts or an endpoint."""
        return self.multi_node or self.max_restarts > 0 or self.endpoint is not None

    def torchrun_flags(self, port: int | None = None) -> list[str]:
        """torchrun's rendezvous flags: c10d when :attr:`elastic`, else loopback at ``port`` (default:
        a free one). A single node without an endpoint meets at ``127.0.0.1:0`` (the store picks a free
        port) under a fresh id, as torchrun's ``--standalone`` does.

        >>> Rendezvous().torchrun_flags(port=29500)
        ['--master-addr', '127.0.0.1', '--master-port', '29500']
        >>> Rendezvous("2", 1, "node0:29400", "job7", 1).torchrun_flags()
        ['--nnodes', '2', '--max-restarts', '1', '--rdzv-backend', 'c10d', '--rdzv-endpoint', 'node0:29400', \
'--rdzv-id', 'job7']
        """
        if not self.elastic:
            return ["--master-addr", "127.0.0.1", "--master-port", str(port if port is not None else free_port())]
        endpoint = self.endpoint or f"127.0.0.1:{port if port is not None else 0}"
        # c10d assigns global ranks itself, so torchrun ignores (and warns about) --node-rank: not passed
        return ["--nnodes", self.nnodes, "--max-restarts", str(self.max_restarts), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", self.run_id or f"flexmesh-{uuid.uuid4().hex[:12]}"]


# torchrun's c10d agents share their store with the ranks by default; in torch 2.13 that store keeps
# the keys of the previous attempt, so the ranks of a restarted group read their peers' old addresses
# (gloo: "connectFullMesh failed ... Connection refused", seen on the first restart). With sharing
# off, rank 0 of each attempt serves a fresh store for its group.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
DEFAULT_RUN_ID = "flexmesh"  # the c10d run id of a multi-node launch without --rdzv-id (the same on every node)


def parse_rendezvous(nnodes: str | None = None, node_rank: int | None = None, endpoint: str | None = None,
                     run_id: str | None = None, max_restarts: int = 0) -> Rendezvous:
    """Check ``flexmesh train``'s ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-id`` and
    ``--max-restarts``; a PlanError of one line says what is wrong.

    >>> parse_rendezvous("1:2", 0, "127.0.0.1:29400").run_id
    'flexmesh'
    >>> parse_rendezvous(max_restarts=-1)
    Traceback (most recent call last):
    ...
    flexmesh.errors.PlanError: --max-restarts must be 0 or more, got -1
    """
    if max_restarts < 0:
        raise PlanError(f"--max-restarts must be 0 or more, got {max_restarts}")
    nnodes = "1" if nnodes is None else nnodes.strip()
    parts = nnodes.split(":")
    try:
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        low = high = 0
    if len(parts) > 2 or not 1 <= low <= high:
        raise PlanError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX (torchrun's form), got {nnodes!r}")
    if high > 1 and node_rank is None:
        raise PlanError(f"--nnodes {nnodes} needs --node-rank: 0 on the node whose launcher holds --out, 1 to "
                        f"{high - 1} on the others")
    if node_rank is not None and not 0 <= node_rank < high:
        raise PlanError(f"--node-rank must be from 0 to {high - 1} with --nnodes {nnodes}, got {node_rank}")
    if endpoint is not None:
        host, _, port = endpoint.rpartition(":")
        if not host.strip("[]") or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise PlanError(f"--rdzv-endpoint must be HOST:PORT with a port from 1 to 65535 (for example "
                            f"node0.cluster:29400), got {endpoint!r}")
    elif high > 1:
        raise PlanError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node: where the "
                        "launchers meet (a port free on that host)")
    if run_id is not None and (not run_id or any(c.isspace() for c in run_id)):
        raise PlanError(f"--rdzv-id must be a word without spaces, got {run_id!r}")
    if run_id is None and high > 1:
        run_id = DEFAULT_RUN_ID
    return Rendezvous(nnodes, node_rank or 0, endpoint, run_id, max_restarts)


def torchrun_command(nproc: int, target: Sequence[str], port: int | None = None,
                     rendezvous: Rendezvous | None = None) -> list[str]:
    """The command line that runs ``target`` as ``nproc`` ranks per node under torchrun.

    ``target`` is a script and its arguments (``["bench/runtime.py", "worker", ...]``) or a module
    (``["-m", "flexmesh", "train", ...]``). Without ``rendezvous`` (or with a single-node one without
    restarts or endpoint) the rendezvous is on loopback at ``port`` (default: a free one), so two
    launches on one machine never meet; otherwise see :meth:`Rendezvous.torchrun_flags`.

    >>> torchrun_command(2, ["-m", "flexmesh", "train"], port=29500)[1:]  # [0] is this Python
    ['-m', 'torch.distributed.run', '--nproc-per-node', '2', '--master-addr', '127.0.0.1', \
'--master-port', '29500', '-m', 'flexmesh', 'train']
    """
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            *(rendezvous or Rendezvous()).torchrun_flags(port), *target]


def run_torchrun(nproc: int, target: Sequence[str], env: dict[str, str] | None = None,
                 **run_kwargs: Any) -> subprocess.CompletedProcess:
    """Run ``target`` as ``nproc`` ranks (:func:`torchrun_command`) and wait for it.

    ``env`` is the children's environment (default: this process's); ``run_kwargs`` go to
    ``subprocess.run`` (``capture_output``, ``text``, ``timeout``, ...).
    """
    return subprocess.run(torchrun_command(nproc, target), env=env, **run_kwargs)


LAUNCHER_FLAGS = ("--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--rdzv-wait", "--max-restarts")


def without_flags(argv: Sequence[str], valued: Sequence[str] = ("--nproc",), switches: Sequence[str] = ()) -> list[str]:
    """``argv`` less the flags in ``valued`` (``--flag V`` or ``--flag=V``) and ``switches`` (``--flag``):
    what the ranks of a relaunch are given.

    >>> argv = ["train", "--nproc", "4", "--plan", "p.json", "--nproc=2", "--overwrite"]
    >>> without_flags(argv, switches=["--overwrite"])
    ['train', '--plan', 'p.json']
    """
    forwarded, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in valued:
            skip = True
            continue
        if a in switches or a.split("=", 1)[0] in valued:
            continue
        forwarded.append(a)
    return forwarded


def relaunch_flexmesh(nproc: int, argv: Sequence[str], env: dict[str, str] | None = None,
                      rendezvous: Rendezvous | None = None) -> int:
    """Run ``flexmesh *argv`` as ``nproc`` ranks under torchrun; its exit code.

    The launcher's own flags (:data:`LAUNCHER_FLAGS`) are removed from ``argv``; ``rendezvous``
    (default: one node, loopback) gives torchrun's node count, restarts and rendezvous. The children
    inherit this process's environment (or ``env``) and output, as if the user had typed the
    torchrun command; signals reach them (:func:`run_supervised`).
    """
    target = ["-m", "flexmesh", *without_flags(argv, LAUNCHER_FLAGS)]
    if rendezvous is not None and rendezvous.elastic:
        env = {**(env if env is not None else os.environ), **ELASTIC_ENV}
    return run_supervised(torchrun_command(nproc, target, rendezvous=rendezvous), env=env)


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_supervised(command: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run ``command`` (a torchrun command line) to its end and return its exit code.

    SIGINT and SIGTERM sent to this process go straight to the ranks (torchrun's children that
    carry ``LOCAL_RANK``), which stop at their next step boundary (flexmesh.runtime.train.loop.fit) and
    exit 0, so torchrun neither restarts them nor prints its failure report; this process then
    returns the code rank 0 left in the file named by ``STATUS_ENV`` (a run that ended early:
    128 + the signal, or a loss that diverged), else 128 + the signal. SIGHUP (a closed terminal)
    is taken as SIGINT. A second SIGINT kills everything outright; a signal before the ranks exist
    goes to torchrun. The child
    runs in its own process group (a terminal's Ctrl-C reaches only this process, once). On Linux
    this process adopts orphaned descendants (a child subreaper), so ranks that outlive torchrun are
    killed before it returns; and should this process be killed outright, torchrun gets SIGKILL from
    the kernel (``PR_SET_PDEATHSIG``), as do the ranks when torchrun dies (:func:`die_with_launcher`).
    """
    adopts = _become_subreaper()
    status = Path(tempfile.mkdtemp(prefix="flexmesh-")) / "status"
    env = {**(env if env is not None else os.environ), SUPERVISED_ENV: str(os.getpid()), STATUS_ENV: str(status)}
    proc = subprocess.Popen(list(command), env=env, start_new_session=True, preexec_fn=_dies_with(os.getpid()))
    seen: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:  # the terminal closed: stop as Ctrl-C does, at the next step boundary
            signum = signal.SIGINT
        again = signum == signal.SIGINT and signal.SIGINT in seen
        seen.append(signum)
        ranks = [pid for pid in _children(proc.pid) if _is_rank(pid)]
        for pid in ranks if not again else []:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if again or not ranks:
            try:
                os.kill(proc.pid, signal.SIGKILL if again else signum)
            except ProcessLookupError:
                pass

    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in FORWARDED} if main else {}
    try:
        code = proc.wait()
        left = status.read_text().strip() if status.is_file() else ""
        if code == 0 and left.isdigit():  # the ranks ended the run cleanly, rank 0 said how
            return int(left)
        return 128 + seen[0] if seen and code == 0 else code
    finally:
        shutil.rmtree(status.parent, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if proc.poll() is None:  # this process is being torn down by an exception: take the child along
            proc.kill()
            proc.wait()
        if adopts:
            _kill_adopted()


def _children(parent: int) -> list[int]:
    """The live processes whose parent is ``parent`` (Linux /proc; empty elsewhere)."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == parent and state != "Z":
            found.append(int(entry.name))
    return found


def _is_rank(pid: int) -> bool:
    """Whether process ``pid`` is a torchrun worker (its environment names a LOCAL_RANK)."""
    try:
        return b"\0LOCAL_RANK=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # <linux/prctl.h>


def _prctl() -> Any:
    """libc's ``prctl`` (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux prctl PR_SET_CHILD_SUBREAPER)."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _dies_with(parent: int) -> Any:
    """A ``preexec_fn`` that makes the child get SIGKILL when ``parent`` (this process) dies, and exit at
    once if it already has (Linux); None elsewhere. ``prctl`` is looked up here, not in the child."""
    prctl = _prctl()
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above armed the signal
            os._exit(1)

    return preexec


def die_with_launcher() -> None:
    """In a rank that :func:`run_supervised` started (its launcher's pid in SUPERVISED_ENV): get SIGKILL
    when torchrun, the rank's parent, dies (Linux ``PR_SET_PDEATHSIG``), and exit now when torchrun
    or the launcher is already gone (the rank's grandparent is then not the launcher). A no-op
    elsewhere: plain torchrun, a single process, not Linux."""
    launcher = os.environ.get(SUPERVISED_ENV, "")
    prctl = _prctl() if "LOCAL_RANK" in os.environ and launcher.isdigit() else None
    if prctl is None or prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if parent_of(os.getppid()) != int(launcher):
        print("flexmesh: the launcher of this rank is gone; stopping", file=sys.stderr, flush=True)
        os._exit(1)


def _kill_adopted() -> None:
    """SIGKILL and reap this process's remaining children: ranks orphaned by a dead torchrun."""
    for pid in _children(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
