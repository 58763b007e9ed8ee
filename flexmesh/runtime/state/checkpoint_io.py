"""How a checkpoint's files reach the disk and are hashed: DCP's writer with every file it creates opened
through flexmesh.files, several files per rank at once, and their sha256 over several threads."""

from __future__ import annotations

import hashlib
from pathlib import Path

from flexmesh.files import create_file, make_folder
from flexmesh.runtime.model.params import host_threads


def guarded_writer(folder: Path, threads: int = 1):  # noqa: ANN201 - DCP's FileSystemWriter
    """DCP's file writer for ``folder`` with every file it creates opened by flexmesh.files (no
    symlink, hard link or special file written through, none reused: ``folder`` was just made
    empty). DCP takes the file system as its writer's ``fs``; only its writes are replaced here.
    ``threads``: files per rank, written at once."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class GuardedFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path, mode):
            if "r" in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with create_file(Path(path), folder) as stream:
                yield stream

        def mkdir(self, path) -> None:
            make_folder(Path(path), root=folder)

    writer = FileSystemWriter(folder, thread_count=threads)
    writer.fs = GuardedFileSystem()
    return writer


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def hash_files(folder: Path, names: list[str]) -> dict[str, str]:
    """sha256 of each of ``names`` in ``folder`` ("missing" where it is not a file), several at once
    (hashlib releases the GIL while it hashes)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(n: str) -> str:
        return sha256_file(folder / n) if (folder / n).is_file() else "missing"

    with ThreadPoolExecutor(host_threads()) as pool:
        return dict(zip(names, pool.map(one, names)))
