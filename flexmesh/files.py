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
A regular file with another hard link is refused too: writing it would change the file it shares.
Below a folder flexmesh owns (``root``: a run folder, an export), every component is checked the
same way, so a symlinked ``OUT/tokenizer`` or ``OUT/adapters`` is refused rather than written
through; and a name that came from a file (a task name, a shard name, a manifest entry) is one plain
name (:func:`plain_name`), so it never leaves its folder. Files are created with mode 0666 less the
umask, as any program's, never read through a link planted after the check (``O_NOFOLLOW``) and never
over a file that appeared meanwhile (``O_EXCL``).

>>> write_atomic("/dev/null", "x")
Traceback (most recent call last):
flexmesh.errors.OutputError: /dev/null is a device, not a file flexmesh writes; remove it or choose another path
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
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
    _check_links(path, os.lstat(path))


def _check_links(path: str | Path, st: os.stat_result) -> None:
    if st.st_nlink > 1:
        raise OutputError(f"{path} is a hard link shared with another file ({st.st_nlink} names), which writing it "
                          "would change too; remove it or choose another path")


def plain_name(name: object, what: str, error: type[Exception] = OutputError) -> str:
    """``name`` when it is one plain file name (what a name read from a file must be: a task name, a
    shard name, a manifest entry); else ``error`` naming ``what``: empty, ``.``/``..``, a path (``/``,
    ``\\``), a NUL byte, or longer than a file system allows are refused, so the name never leaves
    the folder it is joined to.

    >>> plain_name("chat", "task name")
    'chat'
    >>> plain_name("../../x", "task")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    flexmesh.errors.OutputError: task '../../x' is not one plain name usable as a folder name; ...
    """
    if (not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0")
            or len(name.encode("utf-8", "surrogateescape")) > 255):
        raise error(f"{what} {name!r} is not one plain name usable as a folder name; choose one without path "
                    "separators or '..'")
    return name


def below(root: str | Path, path: str | Path) -> Path:
    """``path`` once every component of it below ``root`` that exists is a real folder (not a symlink,
    file, device, ...), and ``path`` itself, if there, is no symlink; an OutputError otherwise.
    ``path`` must lie under ``root`` lexically (no ``..``)."""
    root, path = Path(root), Path(path)
    rel = path.relative_to(root)
    if ".." in rel.parts:
        raise OutputError(f"{path} leaves {root}; choose a path inside it")
    at = root
    for part in rel.parts:
        at = at / part
        try:
            mode = os.lstat(at).st_mode
        except FileNotFoundError:
            break
        if stat.S_ISLNK(mode) or (at != path and not stat.S_ISDIR(mode)):
            raise OutputError(f"{at} is {_kind(mode) if not stat.S_ISREG(mode) else 'a file'}, where flexmesh keeps "
                              f"a folder of {root}; remove it or choose another path")
    return path


def make_folder(path: str | Path, create: bool = True, root: str | Path | None = None) -> Path:
    """Create the folder ``path`` (parents too) unless it is there (or ``create`` is False); an
    OutputError when ``path`` is a symlink or anything but a folder, or (given ``root``, a folder
    flexmesh owns) when a component between ``root`` and ``path`` is. Returns ``path``."""
    path = Path(path)
    if root is not None:
        below(root, path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        if not create:
            return path
        if root is None:
            path.mkdir(parents=True, exist_ok=True)
        else:  # one component at a time, none followed: each is checked by below() or made here
            at = make_folder(root)
            for part in path.relative_to(root).parts:
                at = at / part
                try:
                    os.mkdir(at)
                except FileExistsError:
                    pass
            below(root, path)
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
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        if st.st_nlink > 1:
            _check_links(path, st)
        raise OutputError(f"{path} is {_kind(st.st_mode)}, not a file flexmesh writes; remove it or choose "
                          "another path")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def fresh_folder(path: str | Path, root: str | Path) -> Path:
    """An empty folder at ``path`` (a scratch folder of flexmesh's own, under ``root``): a real folder
    left there by an earlier attempt is removed first, and the new one is made with ``os.mkdir``,
    which never follows nor reuses what appeared meanwhile. A symlink or anything else that is not a
    folder there is refused (OutputError), never removed: flexmesh did not make it."""
    path = Path(path)
    below(root, path)  # a symlink at path or a linked component above it is refused here
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISDIR(mode):
            raise OutputError(f"{path} is {_kind(mode) if not stat.S_ISREG(mode) else 'a file'}, where flexmesh keeps "
                              "a scratch folder; remove it or choose another path")
        shutil.rmtree(path)  # rmtree never follows a symlink inside the folder: it unlinks it
    make_folder(path.parent, root=root)
    try:
        os.mkdir(path)
    except FileExistsError:  # made by another program since the check: not ours to use
        raise OutputError(f"{path} appeared while flexmesh was making it; remove it and try again") from None
    return path


def create_file(path: str | Path, root: str | Path | None = None, *, exclusive: bool = True):
    """``path`` opened for writing bytes under :func:`open_file`'s rules, each component between
    ``root`` (a folder flexmesh owns) and ``path`` checked as :func:`below` does. ``exclusive`` (a
    file in a folder flexmesh just made) refuses a file already there; otherwise a regular file
    there is truncated (a log rewritten by a later run)."""
    if root is not None:
        below(root, path)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    return os.fdopen(open_file(path, flags, 0o666), "wb")


def append_file(path: str | Path):
    """``path`` opened for appending text (created if missing) under :func:`open_file`'s rules."""
    return os.fdopen(open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")


def write_atomic_with(path: str | Path, write: Callable[[Path], None], root: str | Path | None = None) -> None:
    """Have ``write`` fill a temporary file next to ``path`` (for writers that want a file name, such
    as safetensors), fsync it and rename it over ``path`` (``os.replace`` is atomic on POSIX and
    Windows); parent folders are created (given ``root``, the folder flexmesh owns, each checked as
    :func:`make_folder` does). The temporary file is removed on any failure. Something at ``path``
    that is not a regular file is refused (:func:`check_file_target`), never replaced. The file gets
    mode 0666 less the umask (the kernel applies it to ``os.open``'s mode), even where ``write`` made it anew
    with a mode of its own (safetensors writes 0600).

    >>> import tempfile, pathlib, stat
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "w.bin"
    >>> def private(tmp):
    ...     tmp.unlink(); tmp.touch(mode=0o600); tmp.write_bytes(b"x")
    >>> old = os.umask(0o022); write_atomic_with(p, private); _ = os.umask(old)
    >>> oct(stat.S_IMODE(p.stat().st_mode))
    '0o644'
    """
    path = Path(path)
    check_file_target(path)
    try:
        if root is not None:
            make_folder(path.parent, root=root)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:  # a folder that cannot hold files: say so of the path the user gave
        raise OutputError(f"cannot write {path}: {path.parent} {_why(e)}; choose a writable folder") from None
    mode = stat.S_IMODE(os.fstat(fd).st_mode)  # 0666 less the umask
    os.close(fd)
    try:
        write(Path(tmp))
        if stat.S_IMODE(os.lstat(tmp).st_mode) != mode:  # a writer that made the file anew, with its own mode
            again = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fchmod(again, mode)
            finally:
                os.close(again)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        check_file_target(path)  # again: the write may have taken long
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_atomic(path: str | Path, data: str | bytes, root: str | Path | None = None) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically (:func:`write_atomic_with`)."""
    payload = data.encode() if isinstance(data, str) else data

    def write(tmp: Path) -> None:
        tmp.write_bytes(payload)

    write_atomic_with(path, write, root)


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
