"""The on-disk cache that tokenizers and token stores share: where it lives, its keys, its lock.

Root: ``cache_dir`` if given, else ``$FLEXMESH_CACHE``, else ``~/.cache/flexmesh``. Every entry is
named by a short hash of what it was built from, so a changed input never reads a stale entry.

>>> cache_key("corpus", 8192) == cache_key("corpus", 8192) != cache_key("corpus", 4096)
True
>>> len(cache_key("x"))
16
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flexmesh.errors import DataError
from flexmesh.files import create_file, make_folder, open_file


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache folder: ``cache_dir``, else ``$FLEXMESH_CACHE``, else ``~/.cache/flexmesh``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("FLEXMESH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flexmesh"


def usable_cache(cache_dir: str | Path | None = None) -> Path:
    """The cache folder (:func:`cache_root`), made if missing; DataError when it cannot hold files
    (a path through a file or a read-only place, a full disk), naming it and what to pass instead."""
    root = cache_root(cache_dir)
    try:
        # The cache folder is named by the user (flag, variable or home) and may be a link they chose,
        # as any named path's parents; what flexmesh writes below it is checked (flexmesh.files).
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        create_file(probe, root, exclusive=False).close()
        probe.unlink()
    except OSError as e:
        raise DataError(f"the cache folder {root} cannot hold files ({e.strerror or e}); pass --cache-dir DIR or "
                        "set FLEXMESH_CACHE to a writable folder") from None
    return root


def cache_key(*parts: object) -> str:
    """16 hex digits of the SHA-256 of ``parts`` joined by ``|``: the name of one cache entry."""
    return hashlib.sha256("|".join(str(p) for p in parts).encode()).hexdigest()[:16]


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` so concurrent ranks build a cache entry only once. Its folder
    (created if needed) and the lock file itself must be real: never a symlink (flexmesh.files)."""
    make_folder(path.parent, root=path.parent.parent)  # e.g. CACHE/tokens: a real folder of the cache
    fd = open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
