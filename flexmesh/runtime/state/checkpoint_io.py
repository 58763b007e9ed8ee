"""How a checkpoint's files reach the disk, are hashed and are read back: DCP's writer with every file it creates
opened through flexmesh.files, several files per rank at once, and their sha256 over several threads; DCP's reader
given the metadata flexmesh read once through its allow-list (DCP never unpickles ``.metadata`` itself, nor falls
back to a per-rank one), every storage file it names checked to be a plain file of the checkpoint folder, and bytes
entries (optimizer param groups) loaded with ``weights_only=True``."""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path
from typing import Any

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


# A storage file of a DCP checkpoint: a plain name inside its folder (DCP writes __R_K.distcp)
STORAGE_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")


def guarded_reader(folder: Path, metadata: Any, error: type[Exception]):  # noqa: ANN201 - a FileSystemReader
    """DCP's file reader for checkpoint ``folder`` that takes ``metadata`` as read once through the allow-list
    (flexmesh.runtime.state.checkpoint.read_metadata) and checks, before any read, that every storage file the
    metadata names is a plain name of a regular file in ``folder`` (``error`` naming it otherwise)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class GuardedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            for info in (self.storage_data or {}).values():
                name = str(info.relative_path)
                target = folder / name
                if (not STORAGE_FILE.fullmatch(name) or name in (".", "..") or target.is_symlink()
                        or not target.is_file()):
                    raise error(f"checkpoint {folder}: .metadata names the storage file {name[:80]!r}, not a file "
                                "of the checkpoint folder; it is corrupt or was tampered with: delete it, do not "
                                "load it")

    return GuardedReader(str(folder))


def bytes_loading_planner():  # noqa: ANN201 - DCP's DefaultLoadPlanner
    """DCP's default load planner with its bytes entries (optimizer param groups: numbers, strings, lists and
    dicts) read with ``weights_only=True``: a checkpoint's bytes never run code."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            super().load_bytes(read_item, io.BytesIO(_weights_only(torch.load, value)))

    return WeightsOnlyPlanner()


def _weights_only(load, value: io.BytesIO) -> bytes:  # noqa: ANN001
    """``value`` checked to load with ``weights_only=True`` (an UnpicklingError otherwise), as bytes DCP's own
    load then reads: the check is what runs first."""
    raw = value.getvalue()
    load(io.BytesIO(raw), weights_only=True)
    return raw
