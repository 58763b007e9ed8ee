"""Atomic file writing: a crash or a full disk never leaves a half-written file behind.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "sub" / "x.json"
>>> write_atomic(p, '{"ok": true}\\n')
>>> p.read_text()
'{"ok": true}\\n'
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_atomic_with(path: str | Path, write: Callable[[Path], None]) -> None:
    """Have ``write`` fill a temporary file next to ``path`` (for writers that want a file name, such
    as safetensors), fsync it and rename it over ``path`` (``os.replace`` is atomic on POSIX and
    Windows); parent folders are created. The temporary file is removed on any failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
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


def read_json(path: str | Path, error: type[Exception], *, missing: str, invalid: str = "not valid JSON") -> Any:
    """The JSON value in ``path``; ``error(missing)`` when there is no such file and ``error("<path>:
    <invalid> (<reason>)")`` when it is not UTF-8 JSON, so every file format reports both alike.

    >>> import tempfile, pathlib
    >>> bad = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
    >>> _ = bad.write_bytes(b"\\xff{")
    >>> read_json(bad, ValueError, missing="no plan")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: .../plan.json: not valid JSON (...)
    """
    path = Path(path)
    if not path.is_file():
        raise error(missing)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError as e:  # nested deeper than Python's parser goes
        raise error(f"{path}: {invalid} (nested too deeply)") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: {invalid} ({e})") from e
