"""Atomic file writing: a crash or a full disk never leaves a half-written file behind.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "sub" / "x.json"
>>> write_atomic(p, '{"ok": true}\\n')
>>> p.read_text()
'{"ok": true}\\n'
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder, fsynced, then renamed
    over ``path`` (``os.replace`` is atomic on POSIX and Windows); parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
