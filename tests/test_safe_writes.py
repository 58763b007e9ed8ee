"""The one way flexmesh writes (flexmesh.files), tested against the classes: a symbolic link at every
component below a folder flexmesh owns, a hard link at the file, names from every file that carries
names, and the mode a created file gets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flexmesh.errors import CheckpointError, FlexmeshError, OutputError, SpecError
from flexmesh.files import make_folder, plain_name, write_atomic

PARTS = ("a", "b", "c")  # root/a/b/c/file.json: a link may sit at any of the four


def _elsewhere(tmp_path: Path) -> Path:
    d = tmp_path / "elsewhere"
    d.mkdir(exist_ok=True)
    (d / "file.json").write_text("theirs")
    return d


@pytest.mark.parametrize("at", range(len(PARTS) + 1))
@pytest.mark.parametrize("kind", ["symlink-to-folder", "symlink-to-file", "fifo", "file"])
def test_a_link_or_special_file_at_any_component_is_refused(tmp_path, at, kind):
    elsewhere = _elsewhere(tmp_path)
    parts = [*PARTS, "file.json"]
    here = tmp_path / "out" / Path(*parts[:at]) if at else tmp_path / "out"
    here.mkdir(parents=True, exist_ok=True)
    planted = here / parts[at]
    if kind == "symlink-to-folder":
        planted.symlink_to(elsewhere)
    elif kind == "symlink-to-file":
        planted.symlink_to(elsewhere / "file.json")
    elif kind == "fifo":
        os.mkfifo(planted)
    elif at == len(PARTS):
        pytest.skip("a regular file is what is written there")
    else:
        planted.write_text("x")
    before = sorted(p.name for p in elsewhere.iterdir())
    with pytest.raises(OutputError) as e:
        write_atomic(tmp_path / "out" / Path(*parts), "{}", root=tmp_path / "out")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in elsewhere.iterdir()) == before
    assert (elsewhere / "file.json").read_text() == "theirs"
    if at < len(PARTS):
        with pytest.raises(OutputError):
            make_folder(tmp_path / "out" / Path(*PARTS), root=tmp_path / "out")
        assert sorted(p.name for p in elsewhere.iterdir()) == before


def test_folders_below_the_root_are_made_one_by_one(tmp_path):
    write_atomic(tmp_path / "out" / "a" / "b" / "f.json", "{}", root=tmp_path / "out")
    assert (tmp_path / "out" / "a" / "b" / "f.json").read_text() == "{}"
    with pytest.raises(OutputError, match="leaves"):
        make_folder(tmp_path / "out" / ".." / "x", root=tmp_path / "out")


def test_a_hard_link_is_refused_and_the_shared_file_kept(tmp_path):
    theirs = tmp_path / "theirs.txt"
    theirs.write_text("precious")
    os.link(theirs, tmp_path / "plan.json")
    with pytest.raises(OutputError, match="hard link"):
        write_atomic(tmp_path / "plan.json", "{}")
    assert theirs.read_text() == "precious"


def test_a_hard_linked_lock_is_refused_and_not_truncated(tmp_path):
    from flexmesh.runtime.state.rundir import LOCK, hold_run_folder

    out = tmp_path / "out"
    out.mkdir()
    theirs = tmp_path / "theirs.txt"
    theirs.write_text("precious")
    os.link(theirs, out / LOCK)
    with pytest.raises(FlexmeshError, match="hard link"):
        hold_run_folder(out)
    assert theirs.read_text() == "precious"


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_a_created_file_gets_the_mode_the_umask_allows(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "x.json", "{}")
        make_folder(tmp_path / "d" / "e", root=tmp_path)
    finally:
        os.umask(old)
    assert (tmp_path / "x.json").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (tmp_path / "d" / "e").stat().st_mode & 0o777 == 0o777 & ~umask


# ---- names that come from files --------------------------------------------------------------------
BAD_NAMES = ["../../../x", "/etc/passwd", "a/b", "..", ".", "", "a\\b", "a\0b", "x" * 300]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_plain_name_refuses_every_way_out(name):
    with pytest.raises(OutputError):
        plain_name(name, "name")


@pytest.mark.parametrize("name", BAD_NAMES[:7])
def test_a_task_name_from_a_job_file_or_a_manifest_stays_inside(tmp_path, name):
    from flexmesh.spec.tasks import Task, load_tasks

    (tmp_path / "docs").mkdir()
    (tmp_path / "job.toml").write_text(f'[[task]]\nname = {json.dumps(name)}\ncorpus = "docs"\nrank = 8\nalpha = 16\n'
                                       'targets = ["q_proj"]\n')
    with pytest.raises(SpecError, match="not one plain name"):
        load_tasks(tmp_path / "job.toml")
    with pytest.raises(SpecError, match="not one plain name"):  # a manifest's tasks, as a checkpoint records them
        Task.from_dict({"name": name, "corpus": "docs", "rank": 8, "alpha": 16, "targets": ["q_proj"]})


@pytest.mark.parametrize("name", BAD_NAMES[:7])
def test_an_export_never_writes_an_adapter_outside_out(tmp_path, name):
    torch = pytest.importorskip("torch")
    from flexmesh.runtime.state.peft import write_adapters
    from flexmesh.spec.tasks import Task, TaskSet

    good = Task.from_dict({"name": "chat", "corpus": "docs", "rank": 8, "alpha": 16, "targets": ["q_proj"]})
    bad = Task(**{**good.__dict__, "name": name})  # as if the manifest's check were bypassed
    out = tmp_path / "deep" / "er" / "out"
    out.mkdir(parents=True)
    tensors = {"layers.0.attention.adapters.wq.lora_A.0": torch.zeros(8, 4)}
    with pytest.raises(FlexmeshError):
        write_adapters(out, TaskSet((bad,)), tensors, "base")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["deep", "deep/er", "deep/er/out"]


def test_a_symlinked_adapters_folder_is_not_written_through(tmp_path):
    torch = pytest.importorskip("torch")
    from flexmesh.runtime.state.peft import write_adapters
    from flexmesh.spec.tasks import Task, TaskSet

    out = tmp_path / "out"
    out.mkdir()
    elsewhere = _elsewhere(tmp_path)
    (out / "adapters").symlink_to(elsewhere)
    task = Task.from_dict({"name": "chat", "corpus": "docs", "rank": 8, "alpha": 16, "targets": ["q_proj"]})
    with pytest.raises(OutputError, match="adapters is a symlink"):
        write_adapters(out, TaskSet((task,)), {"layers.0.attention.adapters.wq.lora_A.0": torch.zeros(8, 4)}, "base")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["file.json"]


def test_a_symlinked_run_tokenizer_folder_is_not_written_through(tmp_path):
    pytest.importorskip("tokenizers")
    from flexmesh.data.hf_tokenizer import RUN_TOKENIZER, record_tokenizer
    from flexmesh.data.tokenizer import train_bpe

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    tok = train_bpe(tmp_path / "docs", vocab_size=280, cache_dir=tmp_path / "cache")
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = _elsewhere(tmp_path)
    (out / RUN_TOKENIZER).symlink_to(elsewhere)
    with pytest.raises(OutputError, match="tokenizer is a symlink"):
        record_tokenizer(out, tok, None, 64)[0]()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["file.json"]


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", ".."])
def test_weights_index_shard_names_stay_next_to_the_index(tmp_path, shard):
    pytest.importorskip("torch")
    from flexmesh.runtime.state.weights import _open_weights

    (tmp_path / "outside.safetensors").write_bytes(b"")
    d = tmp_path / "model"
    d.mkdir()
    (d / "sub").mkdir()
    (d / "sub" / "x.safetensors").write_bytes(b"")
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(CheckpointError, match="not one plain name") as e:
        _open_weights(index)
    assert "\n" not in str(e.value)


# ---- a port in use for --rdzv-endpoint -------------------------------------------------------------
def test_a_rendezvous_port_held_by_another_program_is_one_line():
    import socket
    import time

    from flexmesh.errors import PlanError
    from flexmesh.runtime.endpoint import check_endpoint

    with socket.socket() as held:  # a program that accepts and never answers
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(PlanError, match=f"port {port} is in use by another program"):
            check_endpoint(f"127.0.0.1:{port}", timeout_s=1.0)
        assert time.monotonic() - start < 30
    check_endpoint(f"127.0.0.1:{port}")  # free again


def test_a_rendezvous_on_another_host_that_never_answers_is_one_line_after_a_bounded_wait(capsys):
    import time

    from flexmesh.errors import PlanError
    from flexmesh.runtime.endpoint import check_endpoint

    start = time.monotonic()
    with pytest.raises(PlanError, match=r"192\.0\.2\.1:29400 did not answer within 1 s") as e:
        check_endpoint("192.0.2.1:29400", wait_s=1.0)  # TEST-NET-1 (RFC 5737): never routed
    assert time.monotonic() - start < 15
    said = str(e.value)
    assert "\n" not in said and "node 0's launcher" in said and "port 29400 is open" in said
    assert "waiting up to 1 s for the rendezvous at 192.0.2.1:29400" in capsys.readouterr().err
    with pytest.raises(PlanError, match="does not resolve"):
        check_endpoint("no-such-host.invalid:29400", wait_s=1.0)  # RFC 6761: never resolves


def test_a_rendezvous_host_that_starts_late_is_waited_for(capsys):
    import socket
    import threading
    import time

    from flexmesh.runtime.endpoint import _wait_for

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    late = socket.socket()
    late.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def serve() -> None:  # node 0's launcher, up half a second after this one
        time.sleep(0.5)
        late.bind(("127.0.0.1", port))
        late.listen()

    threading.Thread(target=serve, daemon=True).start()
    try:
        _wait_for(f"127.0.0.1:{port}", ("127.0.0.1", port), socket.AF_INET, 20.0)
    finally:
        late.close()
    assert f"waiting up to 20 s for the rendezvous at 127.0.0.1:{port}" in capsys.readouterr().err


def test_train_on_a_node_whose_rendezvous_host_never_answers_stops_in_one_line(tmp_path):
    import time

    from helpers import flexmesh_here, write_inputs

    _, corpus, plan = write_inputs(tmp_path, world=2)
    start = time.monotonic()
    done = flexmesh_here("train", "--plan", str(plan), "--corpus", str(corpus), "--out", str(tmp_path / "run"),
                         "--max-steps", "1", "--nproc", "1", "--nnodes", "2", "--node-rank", "1",
                         "--rdzv-endpoint", "192.0.2.1:29400", "--rdzv-wait", "1")
    assert time.monotonic() - start < 30
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and done.stderr.strip().splitlines()[-1] == errors[0], done.stderr
    assert "did not answer within 1 s" in errors[0] and "--rdzv-wait" in errors[0]
    assert not (tmp_path / "run").exists()  # nothing launched, nothing written


def test_a_rendezvous_port_where_a_store_serves_passes():
    import socket
    from datetime import timedelta

    dist = pytest.importorskip("torch.distributed")
    from flexmesh.runtime.endpoint import check_endpoint

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    check_endpoint(f"127.0.0.1:{port}")
    del store


def test_a_scratch_folder_is_made_anew_and_a_planted_link_there_refused(tmp_path):
    from flexmesh.files import fresh_folder

    root = tmp_path / "run"
    (root / ".tmp-x").mkdir(parents=True)
    (root / ".tmp-x" / "left.pt").write_text("an earlier attempt")
    assert list(fresh_folder(root / ".tmp-x", root).iterdir()) == []
    elsewhere = _elsewhere(tmp_path)
    (root / ".tmp-y").symlink_to(elsewhere)
    with pytest.raises(OutputError, match="symlink"):
        fresh_folder(root / ".tmp-y", root)
    assert (elsewhere / "file.json").read_text() == "theirs"


@pytest.mark.parametrize("exclusive", [True, False])
@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_create_file_never_writes_through_a_link(tmp_path, exclusive, kind):
    from flexmesh.files import create_file

    elsewhere = _elsewhere(tmp_path)
    (tmp_path / "run").mkdir()
    at = tmp_path / "run" / "rank_00000.pt"
    (at.symlink_to if kind == "symlink" else at.hardlink_to)(elsewhere / "file.json")
    with pytest.raises(OutputError):
        create_file(at, tmp_path / "run", exclusive=exclusive)
    assert (elsewhere / "file.json").read_text() == "theirs"


def test_dcp_shards_and_metadata_are_never_written_through_a_link(tmp_path):
    """The checkpoint writer's own files (DCP's shard and metadata) go through flexmesh.files too."""
    import torch
    import torch.distributed.checkpoint as dcp

    from flexmesh.runtime.state.checkpoint_io import guarded_writer

    good = tmp_path / "good"
    good.mkdir()
    dcp.save({"w": torch.ones(3)}, storage_writer=guarded_writer(good))
    written = sorted(p.name for p in good.iterdir())
    assert ".metadata" in written and any(n.endswith(".distcp") for n in written)
    for name in written:
        folder = tmp_path / f"planted-{name.strip('.')}"
        folder.mkdir()
        target = _elsewhere(tmp_path) / "file.json"
        plant = folder / (f"{name}.tmp" if name == ".metadata" else name)
        plant.symlink_to(target)
        with pytest.raises(BaseException, match="not a regular file|symlink"):
            dcp.save({"w": torch.ones(3)}, storage_writer=guarded_writer(folder))
        assert target.read_text() == "theirs"


def test_the_token_cache_scratch_folder_is_never_written_through(tmp_path):
    from flexmesh.data.cache import cache_key
    from flexmesh.data.corpus import read_corpus
    from flexmesh.data.loader import tokenize_corpus
    from flexmesh.data.tokenizer import tokenizer_hash, train_bpe

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello world, hello tokens\n" * 20)
    corpus = read_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    tok = train_bpe(corpus, vocab_size=300, cache_dir=cache)
    key = cache_key(corpus.fingerprint(), tokenizer_hash(tok), "end-of-text None")  # the store without one
    (cache / "tokens").mkdir(parents=True, exist_ok=True)
    elsewhere = _elsewhere(tmp_path)
    (cache / "tokens" / f"{key}.tmp{os.getpid()}").symlink_to(elsewhere)
    with pytest.raises(OutputError, match="symlink"):
        tokenize_corpus(corpus, tok, cache_dir=cache)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["file.json"]
    (cache / "tokens" / f"{key}.tmp{os.getpid()}").unlink()
    assert len(tokenize_corpus(corpus, tok, cache_dir=cache).offsets) == 2


def test_an_engine_log_is_never_written_through_a_link(tmp_path):
    import asyncio

    from flexmesh.serve.engine.config import EngineConfig
    from flexmesh.serve.engine.processes import start_engines

    elsewhere = _elsewhere(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "engine-0.log").symlink_to(elsewhere / "file.json")
    with pytest.raises(OutputError):
        asyncio.run(start_engines(EngineConfig(model="tiny"), 1, logs))
    assert (elsewhere / "file.json").read_text() == "theirs"
    (tmp_path / "linked-logs").symlink_to(elsewhere)
    with pytest.raises(OutputError, match="symlink"):
        asyncio.run(start_engines(EngineConfig(model="tiny"), 1, tmp_path / "linked-logs"))
