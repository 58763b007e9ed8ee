"""DCP never reads a checkpoint flexmesh loads on its own terms: the metadata is the one flexmesh read through its
allow-list (no second unpickling, no per-rank fallback), every storage file it names is a plain file of the folder,
and bytes entries load weights-only. Each path DCP could unpickle or open, tried."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from flexmesh.errors import CheckpointError
from flexmesh.runtime.state.checkpoint import read_metadata
from flexmesh.runtime.state.checkpoint_io import bytes_loading_planner, guarded_reader


class Planted:
    """An object whose unpickling creates a file: what a bytes entry made to run code would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _save(folder: Path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def _load(folder: Path, state: dict) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=guarded_reader(folder, read_metadata(folder), CheckpointError),
                 planner=bytes_loading_planner(), no_dist=True)
    return state


def test_a_checkpoint_of_tensors_and_param_groups_loads_as_saved(tmp_path):
    saved = {"w": torch.arange(6.0).reshape(2, 3), "lr": 0.001, "betas": (0.9, 0.95), "name": "decay", "step": 7}
    _save(tmp_path / "c", saved)
    got = _load(tmp_path / "c", {"w": torch.zeros(2, 3), "lr": 0.0, "betas": (0.0, 0.0), "name": "", "step": 0})
    assert torch.equal(got["w"], saved["w"])  # exact: the same bytes read back
    assert {k: got[k] for k in ("lr", "betas", "name", "step")} == {k: saved[k] for k in ("lr", "betas", "name",
                                                                                          "step")}  # exact: copied


def test_a_bytes_entry_that_would_run_code_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "code-ran"
    _save(tmp_path / "c", {"w": torch.ones(2), "groups": Planted(marker)})
    assert not marker.exists()
    with pytest.raises(BaseException) as err:  # DCP wraps the refusal in its CheckpointException
        _load(tmp_path / "c", {"w": torch.zeros(2), "groups": 0})
    assert "Unpickl" in str(err.value) or "weights_only" in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["../outside.distcp", "/etc/hostname", "sub/__0_0.distcp", "fifo.distcp",
                                   "link.distcp"])
def test_a_storage_file_outside_the_folder_or_not_a_file_is_refused_before_reading(tmp_path, where):
    folder = tmp_path / "c"
    _save(folder, {"w": torch.ones(4)})
    (tmp_path / "outside.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    if where == "fifo.distcp":
        import os

        os.mkfifo(folder / where)
    if where == "link.distcp":
        (folder / where).symlink_to(folder / "__0_0.distcp")
    md = read_metadata(folder)
    for info in md.storage_data.values():
        info.relative_path = where
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(BaseException) as err:  # DCP hands every rank's error on inside its CheckpointException
        _load(folder, {"w": torch.zeros(4)})
    assert "not a file of the checkpoint folder" in str(err.value)


def test_dcp_never_unpickles_the_metadata_itself(tmp_path, monkeypatch):
    folder = tmp_path / "c"
    _save(folder, {"w": torch.ones(4)})
    md = read_metadata(folder)
    (folder / ".metadata").write_bytes(b"not a pickle at all")  # what DCP would read, were it to read again
    (folder / "__0.metadata").write_bytes(b"nor this")  # the per-rank fallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"w": torch.zeros(4)}
        dcp.load(state, storage_reader=guarded_reader(folder, md, CheckpointError), planner=bytes_loading_planner(),
                 no_dist=True)
    assert torch.equal(state["w"], torch.ones(4))  # exact: copied
