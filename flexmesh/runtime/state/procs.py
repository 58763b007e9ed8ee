"""Who started whom: a process's parent and ancestors, read from Linux ``/proc`` (None elsewhere).

Torch-free: the launcher and the run-folder lock use it before any rank starts.
"""

from __future__ import annotations

from pathlib import Path


def parent_of(pid: int) -> int | None:
    """The parent pid of process ``pid``; None when it is gone or there is no ``/proc``.

    >>> import os
    >>> parent_of(os.getpid()) == os.getppid() or not Path("/proc/self").exists()
    True
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
    try:
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (ValueError, IndexError):
        return None


def ancestors(pid: int) -> set[int] | None:
    """The pids above process ``pid`` (its parent, grandparent, ...) up to but not including init;
    None where there is no ``/proc``."""
    if not Path("/proc/self/stat").is_file():
        return None
    found: set[int] = set()
    up = parent_of(pid)
    while up is not None and up > 1 and up not in found:
        found.add(up)
        up = parent_of(up)
    return found
