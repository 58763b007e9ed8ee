"""One run per output folder: its lock, starting over without losing history, a metrics file a
crash cut short.

- :func:`hold_run_folder` takes ``<out>/.flexmesh.lock`` with ``fcntl.flock`` (exclusive, never
  waiting), writes this pid into it and keeps it until :func:`release_run_folder` or the process
  exits, so two runs never write one folder. The ``flexmesh train --nproc`` launcher (with several
  nodes, node 0's) holds it for the ranks and says so in ``FLEXMESH_RUN_FOLDER_HELD``.
  Under ``--max-restarts`` the restarted ranks are the same run: the launcher still holds the lock,
  and a rank 0 that takes it itself (plain torchrun) gets it back, its predecessor being gone.
- :func:`restart_count`: how often torchrun restarted this worker group; a restart resumes.
- :func:`start_over` moves a previous run aside into ``previous-<time>/`` (``--overwrite``) or
  refuses; nothing is deleted.
- :func:`read_metrics` drops a partial last line of ``metrics.jsonl`` (a crash or a full disk while
  appending) with a warning; a bad line elsewhere is an error.

Torch-free, so the launcher uses it before any rank starts.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import warnings
from pathlib import Path

from flexmesh.errors import RunFolderError

LOCK = ".flexmesh.lock"
# the launcher holds the lock of this (resolved) folder, for every node with several nodes (node 0's does)
HELD_ENV = "FLEXMESH_RUN_FOLDER_HELD"
PREVIOUS = "previous-"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun in every worker: 0, then 1, 2, ... per restart

_held: dict[str, list[int]] = {}  # resolved folder -> [fd, holders in this process]


def hold_run_folder(out: str | Path) -> bool:
    """Lock output folder ``out`` (created if needed) for this process; False when the launcher that
    started this process holds it already. Nested calls in one process count; a second process
    gets a RunFolderError naming the folder and the holder's pid."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    key = str(out.resolve())
    if os.environ.get(HELD_ENV) == key:
        return False
    if key in _held:
        _held[key][1] += 1
        return True
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunFolderError(f"output folder {out} is in use by another run (pid {holder}); wait for it or stop it, "
                             "or choose another --out") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[key] = [fd, 1]
    return True


def release_run_folder(out: str | Path) -> None:
    """Undo one :func:`hold_run_folder` of this process; the last one unlocks the folder."""
    key = str(Path(out).resolve())
    if key not in _held:
        return
    _held[key][1] -= 1
    if _held[key][1] == 0:
        os.close(_held.pop(key)[0])  # closing the descriptor drops the flock


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


def start_over(out: str | Path, overwrite: bool) -> Path | None:
    """Make ``out`` ready for a run that does not resume: refuse when it holds a previous run, or with
    ``overwrite`` move that run into ``out/previous-<time>/`` and return that folder (None: nothing
    to move). Call it holding the folder's lock."""
    out = Path(out)
    old = run_contents(out)
    if not old:
        return None
    if not overwrite:
        raise RunFolderError(f"output folder {out} already holds a run ({', '.join(old[:4])}); resume it (drop "
                             "--no-resume), add --overwrite to move it aside into previous-<time>/, or choose "
                             "another --out")
    dest = out / f"{PREVIOUS}{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while dest.exists():  # two starts within one second
        n += 1
        dest = out / f"{PREVIOUS}{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    dest.mkdir()
    for name in old:
        os.replace(out / name, dest / name)
    return dest


def read_metrics(path: str | Path) -> list[tuple[int, str]]:
    """(step, line) of every line of a metrics.jsonl; [] when there is none.

    A partial last line (no newline and not JSON: a crash or a full disk while appending) is dropped
    with a warning; a bad line elsewhere raises RunFolderError naming it.
    """
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append((int(json.loads(line)["step"]), line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if i == len(lines) - 1:  # the unterminated last line
                warnings.warn(f"{path} ends with a partial line ({len(line)} characters, a crash while writing?); "
                              "dropped it", stacklevel=2)
                continue
            raise RunFolderError(f"{path} line {i + 1} is not a metrics record ({e}); fix or delete that line, "
                                 "then resume") from e
    return rows
