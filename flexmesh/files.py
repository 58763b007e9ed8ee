"""Writing files safely: a crash or a full disk never leaves a half-written file behind, and nothing
flexmesh writes goes through a symlink or replaces what is not a regular file.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "sub" / "x.json"
>>> write_atomic(p, '{"ok": true}\\n')
>>> p.read_text()
'{"ok": true}\\n'

The path a user names may lead through symlinked folders (its parents are the user's choice), but
the file or folder flexmesh writes at its end, and everything it writes inside such a folder, is
checked with ``lstat``: a symlink, device, fifo, socket, or a folder where a file goes (or a file
where a folder goes) is refused with an OutputError naming it, never replaced or written through.

>>> write_atomic("/dev/null", "x")
Traceback (most recent call last):
flexmesh.errors.OutputError: /dev/null is a device, not a file flexmesh writes; remove it or choose another path
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flexmesh.errors import OutputError
from flexmesh.inputs import load_json

_KINDS = ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    return next((word for test, word in _KINDS if test(mode)), "not a regular file")


def _why(e: OSError) -> str:
    """What an OSError says of a folder, as words: ``is read-only``, ``does not exist``, ..."""
    words = {errno.EROFS: "is on a read-only file system", errno.EACCES: "is not writable for you",
             errno.EPERM: "is not writable for you", errno.ENOENT: "cannot hold new files",
             errno.ENOSPC: "is on a full disk", errno.ENOTDIR: "is not a folder"}
    return words.get(e.errno or 0, f"cannot hold files ({e.strerror or e})")


def check_file_target(path: str | Path) -> None:
    """Refuse (OutputError) to write the file ``path`` when something other than a regular file is
    there: a symlink (even one to a regular file), a device, a fifo, a socket or a folder."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise OutputError(f"cannot write {path}: a part of its folder is a file, not a folder; choose another "
                          "path") from None
    if not stat.S_ISREG(mode):
        raise OutputError(f"{path} is {_kind(mode)}, not a file flexmesh writes; remove it or choose another path")


def make_folder(path: str | Path, create: bool = True) -> Path:
    """Create the folder ``path`` (parents too) unless it is there (or ``create`` is False); an
    OutputError when ``path`` is a symlink or anything but a folder. Returns ``path``."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        if not create:
            return path
        path.mkdir(parents=True, exist_ok=True)
        mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise OutputError(f"{path} is a symlink; flexmesh writes only into a real folder: give the folder it points "
                          f"to ({os.path.realpath(path)}) or another path")
    if not stat.S_ISDIR(mode):
        raise OutputError(f"{path} is {_kind(mode) if not stat.S_ISREG(mode) else 'a file'}, not a folder flexmesh "
                          "writes in; remove it or choose another path")
    return path


def open_file(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags, mode)`` for a regular file only: a symlink at the end of ``path`` is not
    followed and, like a device, fifo, socket or folder there, refused with an OutputError (checked
    before opening, as opening a device or a fifo can block or act, and again on what was opened)."""
    check_file_target(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # a symlink, or a fifo, put there since the check
            raise OutputError(f"{path} is not a regular file flexmesh writes; remove it or choose another "
                              "path") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OutputError(f"{path} is {_kind(st.st_mode)}, not a file flexmesh writes; remove it or choose "
                          "another path")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def append_file(path: str | Path):
    """``path`` opened for appending text (created if missing) under :func:`open_file`'s rules."""
    return os.fdopen(open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")


def write_atomic_with(path: str | Path, write: Callable[[Path], None]) -> None:
    """Have ``write`` fill a temporary file next to ``path`` (for writers that want a file name, such
    as safetensors), fsync it and rename it over ``path`` (``os.replace`` is atomic on POSIX and
    Windows); parent folders are created. The temporary file is removed on any failure. Something at
    ``path`` that is not a regular file is refused (:func:`check_file_target`), never replaced."""
    path = Path(path)
    check_file_target(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as e:  # a folder that cannot hold files: say so of the path the user gave
        raise OutputError(f"cannot write {path}: {path.parent} {_why(e)}; choose a writable folder") from None
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        check_file_target(path)  # again: the write may have taken long
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically (:func:`write_atomic_with`)."""
    payload = data.encode() if isinstance(data, str) else data

    def write(tmp: Path) -> None:
        tmp.write_bytes(payload)

    write_atomic_with(path, write)


def read_json(path: str | Path, error: type[Exception], *, missing: str, invalid: str = "not valid JSON",
              finite: bool = True) -> Any:
    """The JSON value in ``path``, read by the one bounded reader (:func:`flexmesh.inputs.load_json`):
    ``error(missing)`` when there is no such file and ``error("<path>: <invalid> (<reason>)")`` when it
    is not UTF-8 JSON, so every file format reports both alike. ``finite=False`` leaves non-finite
    numbers to a reader that checks each field it uses.

    >>> import tempfile, pathlib
    >>> bad = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
    >>> _ = bad.write_bytes(b"{")
    >>> read_json(bad, ValueError, missing="no plan")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: .../plan.json: not valid JSON (...)
    """
    return load_json(path, error, missing=missing, invalid=invalid, finite=finite)
