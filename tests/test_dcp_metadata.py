"""No code from files: DCP's ``.metadata`` pickle is read through an exact allow-list of classes.

Every name a payload could reach through the modules DCP's classes live in is tried, as a plain
global and as a dotted name (``filesystem.os.system``); each is refused before anything is called.
The allow-list itself is what DCP writes: the globals of a real ``.metadata`` are listed here.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flexmesh.errors import CheckpointError  # noqa: E402
from flexmesh.runtime.state.checkpoint import _METADATA_GLOBALS, metadata_global_allowed, read_metadata  # noqa: E402

DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
               "torch.serialization", "torch", "pathlib", "collections")


def _globals_of(raw: bytes) -> set[tuple[str, str]]:
    """(module, name) of every global a pickle names (GLOBAL and STACK_GLOBAL, memo followed)."""
    out, strings, memo = set(), [], {}
    for op, arg, _ in pickletools.genops(raw):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(arg)
        elif op.name == "MEMOIZE" and strings:
            memo[len(memo)] = strings[-1]
        elif op.name in ("BINGET", "LONG_BINGET", "GET") and arg in memo:
            strings.append(memo[arg])
        elif op.name == "STACK_GLOBAL":
            out.add((strings[-2], strings[-1]))
        elif op.name == "GLOBAL":
            out.add(tuple(arg.split(" ", 1)))
    return out


def _global_pickle(module: str, name: str, *args: str) -> bytes:
    """A protocol 4 pickle that calls ``module.name(*args)`` when loaded."""
    body = b"\x80\x04"
    body += pickle.SHORT_BINUNICODE + bytes([len(module)]) + module.encode()
    body += pickle.SHORT_BINUNICODE + bytes([len(name)]) + name.encode()
    body += pickle.STACK_GLOBAL + pickle.MARK
    for a in args:
        body += pickle.SHORT_BINUNICODE + bytes([len(a)]) + a.encode()
    return body + pickle.TUPLE + pickle.REDUCE + pickle.STOP


def _plant(folder: Path, raw: bytes) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / ".metadata").write_bytes(raw)
    return folder


def test_the_allow_list_is_what_dcp_writes(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16), "i": torch.zeros(2, dtype=torch.int64),
          "step": 3, "extra": {"lr": [1.0, "x"]}}
    dcp.save(sd, checkpoint_id=tmp_path / "ck")
    written = _globals_of((tmp_path / "ck" / ".metadata").read_bytes())
    assert written, "no globals found: the listing is broken"
    assert all(metadata_global_allowed(m, n) for m, n in written), written - set(_METADATA_GLOBALS)
    assert read_metadata(tmp_path / "ck").state_dict_metadata.keys() >= {"w", "b", "i"}


def _reachable() -> list[tuple[str, str]]:
    """Every public or private name in the modules DCP's classes live in that is not allowed."""
    import importlib

    names = []
    for module in DCP_MODULES:
        mod = importlib.import_module(module)
        names += [(module, n) for n in sorted(vars(mod)) if not metadata_global_allowed(module, n)]
    return names


def test_every_other_name_of_those_modules_is_refused(tmp_path):
    reachable = _reachable()
    assert len(reachable) > 200  # the modules' namespaces, torch's included
    for module, name in reachable:
        folder = _plant(tmp_path / "ck", _global_pickle(module, name))
        with pytest.raises(CheckpointError, match="which a DCP checkpoint never holds"):
            read_metadata(folder)


@pytest.mark.parametrize(("module", "name"), [
    ("torch.distributed.checkpoint.filesystem", "os.system"),
    ("torch.distributed.checkpoint.metadata", "os.system"),
    ("torch.serialization", "os.system"),
    ("torch", "os.system"),
    ("pathlib", "os.system"),
    ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"),
    ("torch", "float32.__class__"),
    ("os", "system"),
    ("builtins", "exec"),
    ("builtins", "eval"),
    ("subprocess", "call"),
    ("torch", "load"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
    ("torch.distributed.checkpoint.filesystem", "shutil"),
])
def test_a_payload_never_runs(tmp_path, module, name):
    marker = tmp_path / "ran"
    folder = _plant(tmp_path / "ck", _global_pickle(module, name, f"touch {marker}"))
    with pytest.raises(CheckpointError) as e:
        read_metadata(folder)
    assert "\n" not in str(e.value)
    assert not marker.exists()


@pytest.mark.parametrize(("module", "name"), sorted(_METADATA_GLOBALS))
def test_every_allowed_name_is_a_data_class_or_a_lookup(module, name):
    """What the list allows is what DCP writes and nothing that acts: classes (data classes, an enum,
    paths, Size, OrderedDict) or torch's layout lookup, a dict read."""
    import importlib

    obj = getattr(importlib.import_module(module), name)
    assert isinstance(obj, type) or (module, name) == ("torch.serialization", "_get_layout")
    assert "." not in name


def test_a_fifo_as_metadata_is_refused_without_waiting(tmp_path):
    import os

    folder = tmp_path / "ck"
    folder.mkdir()
    os.mkfifo(folder / ".metadata")
    with pytest.raises(CheckpointError, match="fifo"):
        read_metadata(folder)


def test_a_metadata_of_random_bytes_is_one_line(tmp_path):
    folder = _plant(tmp_path / "ck", io.BytesIO(b"\x80\x04garbage").getvalue())
    with pytest.raises(CheckpointError, match="cannot be read"):
        read_metadata(folder)
