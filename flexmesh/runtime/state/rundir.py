"""One run per output folder: its lock, starting over without losing history, a metrics file a
crash cut short.

- :func:`hold_run_folder` takes ``<out>/.flexmesh.lock`` with ``fcntl.flock`` (exclusive, never
  waiting), writes this pid and the digest of a fresh secret into it and keeps it until
  :func:`release_run_folder` or the process exits, so two runs never write one folder. The lock
  file is opened without following a symlink and must be a regular file (flexmesh.files).
- The ``flexmesh train --nproc`` launcher (with several nodes, node 0's) holds it for the ranks and
  hands them the secret in ``FLEXMESH_RUN_FOLDER_HELD``. A rank believes it only when
  :func:`launcher_holds` checks out: the lock is held right now, its file records the secret's
  digest, and the pid it records is an ancestor of the rank. Setting the variable by hand therefore
  bypasses nothing; with several nodes the ranks of node 0 vouch for the others (flexmesh.runtime.train.loop).
  Under ``--max-restarts`` the restarted ranks are the same run: the launcher still holds the lock,
  and a rank 0 that takes it itself (plain torchrun) gets it back, its predecessor being gone.
- :func:`restart_count`: how often torchrun restarted this worker group; a restart resumes.
- :func:`start_over` moves a previous run aside into ``previous-<time>/`` (``--overwrite``) or
  refuses; nothing is deleted, and a folder holding anything but a run (:func:`foreign_entries`)
  is never moved.
- :func:`read_metrics` drops a partial last line of ``metrics.jsonl`` (a crash or a full disk while
  appending) with a warning; a bad line elsewhere is an error.

Torch-free, so the launcher uses it before any rank starts.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import stat
import time
import warnings
from pathlib import Path

from flexmesh.data.hf_tokenizer import RUN_TOKENIZER
from flexmesh.errors import RunFolderError
from flexmesh.files import check_file_target, make_folder, open_file
from flexmesh.inputs import decode_text, parse_json, read_bytes
from flexmesh.runtime.state.procs import ancestors

LOCK = ".flexmesh.lock"
# The launcher's secret for the ranks it starts (launcher_holds); "peer" from the launchers of other nodes.
HELD_ENV = "FLEXMESH_RUN_FOLDER_HELD"
PEER = "peer"
PREVIOUS = "previous-"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun in every worker: 0, then 1, 2, ... per restart
# What a run writes in its folder besides the lock and previous-*/ (what --overwrite may move aside):
METRICS = "metrics.jsonl"
ROUTING = "routing.jsonl"  # a model with experts: one row per MoE layer and step (docs/metrics.md)
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"  # `train --tensorboard` without a folder: its event files (docs/metrics.md)
MIGRATION_FILE = "migration.json"  # the launcher's request to relaunch on a new plan (flexmesh.commands.migrate)
MIGRATED_PLAN = "plan-migrated-{step:06d}.json"  # a plan a migration moved the run to
PLAN_FILE = "plan.json"  # the plan a run without --plan chose (flexmesh.commands.train_plan)
_RUN_FILE = re.compile(r"metrics\.jsonl|routing\.jsonl|migration\.json|plan-migrated-\d{6}\.json|plan\.json"
                       r"|corpus\.json")
# What `flexmesh train` records for the attempt it starts before training begins (the tokenizer, the
# plan it chose): not a previous run's, once the command has started over (start_over's ``ours``).
ATTEMPT_RECORDS = (RUN_TOKENIZER, PLAN_FILE)

_held: dict[str, list] = {}  # resolved folder -> [fd, holds in this process, secret]


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:32]


def hold_run_folder(out: str | Path) -> str:
    """Lock output folder ``out`` for this process and return the hold's secret (what a launcher hands
    its ranks in HELD_ENV). ``out`` is created if needed; a symlink or a non-folder is refused, and so
    are the entries :func:`check_run_entries` checks. Nested calls in one process count; a second
    process gets a RunFolderError naming the folder and the holder's pid."""
    out = make_folder(out)
    check_run_entries(out)
    key = str(out.resolve())
    if key in _held:
        _held[key][1] += 1
        return _held[key][2]
    fd = open_file(out / LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        words = os.read(fd, 128).decode(errors="replace").split()
        os.close(fd)
        raise RunFolderError(f"output folder {out} is in use by another run (pid {words[0] if words else 'unknown'}); "
                             "wait for it or stop it, or choose another --out") from None
    secret = secrets.token_hex(16)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {_digest(secret)}\n".encode())
    _held[key] = [fd, 1, secret]
    return secret


def check_run_entries(out: Path) -> None:
    """Refuse (OutputError) a run folder whose ``metrics.jsonl`` or ``routing.jsonl`` (written and
    appended to) is anything but a regular file, or whose ``checkpoints`` (written into) is anything
    but a real folder."""
    check_file_target(out / METRICS)
    check_file_target(out / ROUTING)
    make_folder(out / CHECKPOINTS, create=False)


def release_run_folder(out: str | Path) -> None:
    """Undo one :func:`hold_run_folder` of this process; the last one unlocks the folder."""
    key = str(Path(out).resolve())
    if key not in _held:
        return
    _held[key][1] -= 1
    if _held[key][1] == 0:
        os.close(_held.pop(key)[0])  # closing the descriptor drops the flock


def launcher_holds(out: str | Path) -> bool:
    """Whether the launcher that started this process holds ``out`` for it: HELD_ENV carries a secret
    whose digest the lock file records, the lock is held right now, and the pid the file records is
    this process's parent, grandparent or further up (Linux /proc; elsewhere that last check is
    skipped). Anything else, a hand-set variable included, is False: the caller takes the lock itself."""
    secret = os.environ.get(HELD_ENV, "")
    if not secret or secret == PEER:
        return False
    try:
        fd = os.open(Path(out) / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        words = os.read(fd, 128).decode(errors="replace").split()
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False  # nobody holds it: the launcher is gone
        except BlockingIOError:
            pass
    finally:
        os.close(fd)
    if len(words) != 2 or not words[0].isdigit() or not secrets.compare_digest(words[1], _digest(secret)):
        return False
    above = ancestors(os.getpid())
    return above is None or int(words[0]) in above


def restart_count() -> int:
    """How many times torchrun has restarted this process's worker group (0: the first attempt, or not
    under torchrun). A restarted group continues its run, so it resumes even if told not to."""
    try:
        return int(os.environ.get(RESTART_ENV, "0"))
    except ValueError:
        return 0


def run_contents(out: str | Path) -> list[str]:
    """What a previous run left in ``out``: every entry but the lock and earlier ``previous-*`` folders."""
    out = Path(out)
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if p.name != LOCK and not p.name.startswith(PREVIOUS))


def foreign_entries(out: str | Path) -> list[str]:
    """The entries of ``out`` that no flexmesh run writes there: anything but regular files named as
    :data:`METRICS`, :data:`ROUTING`, :data:`MIGRATION_FILE`, :data:`MIGRATED_PLAN`, :data:`PLAN_FILE` or
    ``corpus.json`` (flexmesh.data.run_corpus), real ``checkpoints``, ``tokenizer`` and ``tensorboard``
    folders, the lock and ``previous-*`` folders (``.git``, sources, a symlink named
    ``checkpoints``, ...).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> (d / "checkpoints").mkdir(); (d / "metrics.jsonl").write_text(""); (d / ".git").mkdir()
    0
    >>> foreign_entries(d)
    ['.git']
    """
    out = Path(out)
    found = []
    for p in sorted(out.iterdir()) if out.is_dir() else ():
        mode = p.lstat().st_mode
        if p.name == LOCK and stat.S_ISREG(mode) or p.name.startswith(PREVIOUS) and stat.S_ISDIR(mode):
            continue
        folder = p.name in (CHECKPOINTS, RUN_TOKENIZER, TENSORBOARD) and stat.S_ISDIR(mode)
        if folder or _RUN_FILE.fullmatch(p.name) and stat.S_ISREG(mode):
            continue
        found.append(p.name)
    return found


def start_over(out: str | Path, overwrite: bool, ours: tuple[str, ...] = ()) -> Path | None:
    """Make ``out`` ready for a run that does not resume: refuse when it holds a previous run, or with
    ``overwrite`` move that run into ``out/previous-<time>/`` and return that folder (None: nothing
    to move). A folder holding anything a run does not write (:func:`foreign_entries`) is refused
    either way, naming what it found. ``ours``: entries this attempt wrote itself, after its command
    started over (:data:`ATTEMPT_RECORDS`), which are no previous run. Call it holding the folder's lock."""
    out = Path(out)
    old = [name for name in run_contents(out) if name not in ours]
    if not old:
        return None
    foreign = foreign_entries(out)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise RunFolderError(f"output folder {out} holds {foreign[0]!r}{more}, which no flexmesh run writes; it is not "
                             "a run folder, so nothing in it is moved (--no-resume/--overwrite start over only a run "
                             "folder: metrics.jsonl, checkpoints/); choose another --out")
    if not overwrite:
        raise RunFolderError(f"output folder {out} already holds a run ({', '.join(old[:4])}); resume it (drop "
                             "--no-resume), add --overwrite to move it aside into previous-<time>/, or choose "
                             "another --out")
    dest = out / f"{PREVIOUS}{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while dest.exists():  # two starts within one second
        n += 1
        dest = out / f"{PREVIOUS}{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    os.mkdir(dest)  # exclusive: never reuses nor follows what is there (out itself was checked above)
    for name in old:
        os.replace(out / name, dest / name)
    return dest


def read_metrics(path: str | Path) -> list[tuple[int, str]]:
    """(step, line) of every line of a metrics.jsonl; [] when there is none.

    A partial last line (no newline and not JSON: a crash or a full disk while appending) is dropped
    with a warning; a bad line elsewhere raises RunFolderError naming it.
    """
    path = Path(path)
    if not os.path.lexists(path):
        return []
    lines = decode_text(read_bytes(path, RunFolderError)).split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:  # a NaN loss is recorded as such: the run stopped at that step
            step = parse_json(line, RunFolderError, "it", finite=False)["step"]
            if not isinstance(step, int) or isinstance(step, bool):
                raise TypeError(f"step {step!r} is not a whole number")
            rows.append((step, line))
        except (RunFolderError, KeyError, TypeError) as e:
            if i == len(lines) - 1:  # the unterminated last line
                warnings.warn(f"{path} ends with a partial line ({len(line)} characters, a crash while writing?); "
                              "dropped it", stacklevel=2)
                continue
            why = str(e).removeprefix("it: ")
            raise RunFolderError(f"{path} line {i + 1} is not a metrics record ({why}); fix or delete that line, "
                                 "then resume") from e
    return rows
