"""The one bounded reader (flexmesh.inputs) and every structured reader routed through it.

Written against the classes, not instances: each reader is handed a fifo, a device, a folder, a file
over its size bound, nesting deeper than the bound (and deeper than Python's parser goes), numbers
that are not finite, bytes that are not UTF-8 and an integer too long to parse. Each answers with one
line naming the file (and, for values, the field), a FlexmeshError (exit status 2), and never waits
on the fifo. A hypothesis fuzz test per reader checks the same for random corruptions of a valid file.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexmesh import inputs
from flexmesh.errors import FlexmeshError, PlanError

FUZZ = settings(max_examples=int(os.environ.get("FLEXMESH_FUZZ_EXAMPLES") or 30), deadline=None,
                derandomize=not os.environ.get("FLEXMESH_FUZZ_EXAMPLES"),
                suppress_health_check=[HealthCheck.function_scoped_fixture])


# ---- the readers, each with a valid file ---------------------------------------------------------
@dataclass(frozen=True)
class Reader:
    """A reader of one kind of file: ``read(folder, file)`` parses ``file`` (named ``name`` in
    ``folder``); ``valid`` its valid content as records (a dict, or a list of dicts for JSON lines;
    ``toml`` text for the job file)."""

    name: str
    read: Callable[[Path, Path], object]
    valid: Callable[[], object]
    lines: bool = False
    toml: bool = False
    limit: int = inputs.MAX_BYTES


def _plan() -> dict:
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    s = LayerStrategy.parse("tp2-dp2z1")
    return Plan.uniform(model="tiny", cluster="4xA100-80GB", world_size=4, pp=1, pipeline_schedule="1f1b",
                        num_microbatches=2, seq_len=1024, global_batch=8, stages=(StagePlan(0, 2, (s, s)),),
                        predicted={"step_time_s": 1.0}).to_dict()


def _read_plan(_: Path, f: Path) -> object:
    from flexmesh.layout.plan import Plan

    return Plan.load(f)


def _read_cluster(_: Path, f: Path) -> object:
    from flexmesh.spec.cluster import parse_cluster

    return parse_cluster(str(f))


def _cluster() -> dict:
    from flexmesh.spec.cluster import parse_cluster

    return parse_cluster("1x2xA100-80GB").to_dict()


def _read_profile(_: Path, f: Path) -> object:
    from flexmesh.profile import load_profile

    return load_profile(f)


def _profile() -> dict:
    from test_fuzz_parsers import _profiles

    return _profiles()["hardware"]


def _read_job(d: Path, f: Path) -> object:
    from flexmesh.spec.tasks import load_tasks

    (d / "docs").mkdir(exist_ok=True)
    return load_tasks(f)


def _read_routing(_: Path, f: Path) -> object:
    from flexmesh.schedule.expert_placement import read_trace

    return read_trace(f)


def _read_migration(d: Path, f: Path) -> object:
    from flexmesh.commands.migrate import take_request

    return take_request(d)


def _read_metrics(_: Path, f: Path) -> object:
    from flexmesh.runtime.state.rundir import read_metrics

    return read_metrics(f)


def _read_manifest(d: Path, f: Path) -> object:
    from flexmesh.runtime.state.checkpoint import read_manifest

    return read_manifest(d)


def _read_export_manifest(d: Path, f: Path) -> object:
    from flexmesh.runtime.state.export import _manifest

    (d / ".metadata").write_bytes(b"")
    return _manifest(d)


def _read_lengths(_: Path, f: Path) -> object:
    from flexmesh.data.lengths import load_lengths

    return load_lengths(str(f))


def _read_trace(_: Path, f: Path) -> object:
    from flexmesh.data.requests import load_trace

    return load_trace(str(f))


def _read_records(_: Path, f: Path) -> object:
    from flexmesh.serve.metrics import read_records

    return read_records(f)


def _read_index(d: Path, f: Path) -> object:
    from flexmesh.runtime.state.weights import _open_weights

    (d / "model.safetensors").write_bytes(b"")
    return _open_weights(f)


def _read_hf_config(_: Path, f: Path) -> object:
    from flexmesh.spec.model import parse_model

    return parse_model(str(f))


def _hf_config() -> dict:
    from flexmesh.spec.hf import to_hf_config
    from flexmesh.spec.model import MODEL_PRESETS

    return to_hf_config(MODEL_PRESETS["tiny"])


def _read_prices(_: Path, f: Path) -> object:
    from flexmesh.spec.prices import gpu_prices

    return gpu_prices(f)


def _record() -> dict:
    return {"id": 0, "arrival_s": 0.0, "prompt_tokens": 10, "output_tokens": 5, "first_token_s": 0.1,
            "finish_s": 0.5, "replica": 0}


READERS = {
    "plan.json": Reader("plan", _read_plan, _plan),
    "cluster.json": Reader("cluster", _read_cluster, _cluster),
    "hw.json": Reader("profile", _read_profile, _profile),
    "job.toml": Reader("job", _read_job, lambda: 'name = "chat"\ncorpus = "docs"\nrank = 8\nalpha = 16\n'
                       'targets = ["q_proj"]\n', toml=True),
    "routing.jsonl": Reader("routing", _read_routing,
                            lambda: [{"step": 1, "layer": 0, "expert_tokens": [3, 4, 5, 6]}], lines=True),
    "migration.json": Reader("migration", _read_migration, lambda: {"plan": __file__, "checkpoint": "step_000002"}),
    "metrics.jsonl": Reader("metrics", _read_metrics, lambda: [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.4}],
                            lines=True),
    "manifest.json": Reader("manifest", _read_manifest, lambda: {"format": 2, "step": 3, "plan_hash": "ab"}),
    "lengths.json": Reader("lengths", _read_lengths, lambda: [1, 2, 3]),
    "trace.jsonl": Reader("trace", _read_trace,
                          lambda: [{"id": 0, "arrival_s": 0.0, "prompt_tokens": 5, "output_tokens": 3}],
                          lines=True, limit=1 << 30),
    "requests.jsonl": Reader("records", _read_records, lambda: [_record()], lines=True),
    "model.safetensors.index.json": Reader("weights index", _read_index,
                                           lambda: {"weight_map": {"w": "model.safetensors"}}),
    "config.json": Reader("model config", _read_hf_config, _hf_config),
    "prices.json": Reader("prices", _read_prices, lambda: {"H100-80GB": {"usd_per_hour": 2.5}}),
}
# export reads the same manifest.json by its own path
EXPORT = Reader("export manifest", _read_export_manifest, READERS["manifest.json"].valid)


def _encode(reader: Reader, value: object, extra: str | None = None) -> bytes:
    """``value`` in the reader's format, with ``zz = EXTRA`` (raw text) added to its first record."""
    if reader.toml:
        head = f"zz = {extra}\n" if extra is not None else ""
        return (head + "[[task]]\n" + str(value)).encode("utf-8", "surrogateescape")
    records = value if reader.lines else [value]
    out = []
    for i, rec in enumerate(records):  # type: ignore[arg-type]
        text = json.dumps(rec)
        if i == 0 and extra is not None and isinstance(rec, list):
            text = text[:-1] + f", {extra}]"
        elif i == 0 and extra is not None and isinstance(rec, dict):
            text = text[:-1] + f', "zz": {extra}}}' if rec else f'{{"zz": {extra}}}'
        out.append(text)
    return ("\n".join(out) + "\n").encode("utf-8", "surrogateescape")


ALL = [*READERS.items(), ("manifest.json", EXPORT)]
IDS = [r.name for _, r in ALL]


def _refused(reader: Reader, folder: Path, f: Path, *words: str) -> str:
    with pytest.raises(FlexmeshError) as e:
        reader.read(folder, f)
    msg = str(e.value)
    assert "\n" not in msg.strip(), msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_valid_files_are_read(tmp_path):
    """The base of every class test below: each reader accepts its valid file (else the classes test
    nothing)."""
    for name, reader in ALL:
        d = tmp_path / reader.name.replace(" ", "-")
        d.mkdir()
        f = d / name
        f.write_bytes(_encode(reader, reader.valid()))
        reader.read(d, f)


# ---- the classes -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "reader"), ALL, ids=IDS)
def test_a_fifo_is_refused_without_waiting(tmp_path, name, reader):
    f = tmp_path / name
    os.mkfifo(f)
    done: list[object] = []

    def read() -> None:
        try:
            done.append(reader.read(tmp_path, f))
        except FlexmeshError as e:
            done.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # unblock the reader before failing, so the test process can end
        with open(f, "w"):
            pass
        pytest.fail(f"{reader.name} waited on a fifo")
    # the launcher's migration request is only ever the run's own regular file: anything else is no request
    assert isinstance(done[0], FlexmeshError) or (reader.name == "migration" and done[0] is None), done
    if isinstance(done[0], FlexmeshError):
        assert "\n" not in str(done[0]).strip()


@pytest.mark.parametrize(("name", "reader"), [(n, r) for n, r in ALL if r.name not in ("migration", "manifest",
                                                                                          "export manifest")],
                         ids=[r.name for _, r in ALL if r.name not in ("migration", "manifest", "export manifest")])
def test_a_device_or_folder_is_refused(tmp_path, name, reader):
    _refused(reader, tmp_path, Path("/dev/zero"), "/dev/zero")
    (tmp_path / name).mkdir()
    _refused(reader, tmp_path, tmp_path / name, name)


@pytest.mark.parametrize(("name", "reader"), ALL, ids=IDS)
def test_a_file_over_the_size_bound_is_refused_before_reading(tmp_path, name, reader):
    f = tmp_path / name
    with open(f, "wb") as out:  # sparse: no disk used, and reading it would take long
        out.truncate(reader.limit + 1)
    _refused(reader, tmp_path, f, name, "MiB")


@pytest.mark.parametrize(("name", "reader"), ALL, ids=IDS)
@pytest.mark.parametrize(("extra", "words"), [
    ("1e999", ["zz", "1e999", "not a finite number"]),
    ("-1e999", ["zz", "not a finite number"]),
    ("NaN", ["zz", "NaN", "not a finite number"]),
    ("Infinity", ["zz", "not a finite number"]),
    ('"caf\udcc3("', ["zz", "not UTF-8"]),
    ("[" * 100 + "]" * 100, ["zz", "levels deep"]),
    ("[" * 100_000 + "]" * 100_000, ["levels deep"]),
    ("1" * 5000, ["digits"]),
], ids=["1e999", "-1e999", "NaN", "Infinity", "not-utf8", "deep", "deeper-than-python", "long-int"])
def test_a_hostile_value_is_named_in_one_line(tmp_path, name, reader, extra, words):
    if reader.toml:
        extra = {"1e999": "1e999", "-1e999": "-inf", "NaN": "nan", "Infinity": "inf"}.get(extra, extra)
    if reader.name == "metrics" and extra in ("1e999", "-1e999", "NaN", "Infinity"):
        # a step whose loss is NaN is recorded as such (the run stops there): metrics hold what was measured
        f = tmp_path / name
        f.write_bytes(_encode(reader, reader.valid(), extra))
        assert [step for step, _ in reader.read(tmp_path, f)] == [1, 2]  # type: ignore[attr-defined]
        f.write_text(f'{{"step": {extra}, "loss": 1.0}}\n{{"step": 2}}\n')
        _refused(reader, tmp_path, f, name, "line 1 is not a metrics record")
        return
    if reader.name == "model config" and extra in ("1e999", "-1e999", "NaN", "Infinity"):
        # each number a model config gives is checked by its own rule (a whole number > 0, ...); one it
        # does not use is not read
        f = tmp_path / name
        f.write_bytes(_encode(reader, reader.valid(), extra))
        reader.read(tmp_path, f)
        text = json.dumps({**_hf_config(), "hidden_size": 1})
        f.write_text(text.replace('"hidden_size": 1', f'"hidden_size": {extra}'))
        _refused(reader, tmp_path, f, name, "hidden_size")
        return
    if not reader.lines and isinstance(reader.valid(), list):  # a list: the value is an entry, not a field
        words = [w for w in words if w != "zz"]
    f = tmp_path / name
    f.write_bytes(_encode(reader, reader.valid(), extra))
    msg = _refused(reader, tmp_path, f, *words)
    if reader.name != "migration":
        assert name in msg, msg


def test_non_utf8_outside_a_string_names_the_line(tmp_path):
    f = tmp_path / "plan.json"
    f.write_bytes(b'{\n"a": 1,\n\xff\n}')
    with pytest.raises(PlanError, match=r"plan.json: line 3 holds bytes that are not UTF-8"):
        inputs.load_json(f, PlanError)


def test_a_file_that_grows_while_read_is_cut_at_the_bound(tmp_path):
    f = tmp_path / "x.json"
    f.write_text("[" + "1," * 100 + "1]")
    with pytest.raises(PlanError, match="more than the 16 bytes"):
        inputs.load_json(f, PlanError, limit=16)


def test_count_and_depth_bounds_hold_for_text_from_memory():
    with pytest.raises(PlanError, match="more than 10 values"):
        inputs.check_values(list(range(20)), PlanError, "x", max_values=10)
    with pytest.raises(PlanError, match=r"x: a\[0\]\[0\] nests more than 2 levels deep"):
        inputs.check_values({"a": [[[1]]]}, PlanError, "x", max_depth=2)
    assert inputs.check_values({"loss": float("nan")}, PlanError, "x", finite=False) is not None


def test_a_surrogate_in_a_key_is_named(tmp_path):
    f = tmp_path / "c.json"
    f.write_bytes(b'{"ok": {"k\xff": 1}}')
    with pytest.raises(PlanError, match=r"the key 'k\\\\xff' under ok holds bytes that are not UTF-8"):
        inputs.load_json(f, PlanError)


def test_toml_and_json_by_suffix(tmp_path):
    (tmp_path / "a.toml").write_text("x = 1\n")
    (tmp_path / "a.json").write_text('{"x": 1}')
    assert inputs.load_config(tmp_path / "a.toml", PlanError) == inputs.load_config(tmp_path / "a.json", PlanError)
    (tmp_path / "b.toml").write_text("x = inf\n")
    with pytest.raises(PlanError, match="b.toml: x is 1e999, not a finite number"):
        inputs.load_config(tmp_path / "b.toml", PlanError)


# ---- a fuzz test per reader --------------------------------------------------------------------------
@st.composite
def _corrupt(draw, raw: bytes) -> bytes:
    how = draw(st.sampled_from(["truncate", "byte", "insert", "random"]))
    if how == "random" or not raw:
        return draw(st.binary(max_size=300))
    at = draw(st.integers(0, len(raw) - 1))
    if how == "truncate":
        return raw[:at]
    if how == "byte":
        return raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1:]
    return raw[:at] + draw(st.sampled_from([b"1e999", b"NaN", b"-Infinity", b"\xff\xfe", b"[[[[[[", b"}", b"\x00",
                                            b'"', b"\n", b"9" * 5000, b"null", b"{}", b"[]"])) + raw[at:]


@FUZZ
@given(st.data(), st.sampled_from(ALL))
def test_fuzz_every_reader(tmp_path_factory, data, entry):
    """Random corruptions of every reader's valid file: read, or one line of FlexmeshError."""
    name, reader = entry
    d = tmp_path_factory.mktemp("fuzz")
    f = d / name
    f.write_bytes(data.draw(_corrupt(_encode(reader, reader.valid()))))
    try:
        reader.read(d, f)
    except FlexmeshError as e:
        assert "\n" not in str(e).strip(), str(e)


@FUZZ
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=4),
                    max_leaves=30))
def test_fuzz_the_reader_itself(value):
    """Any JSON value: parsed back equal, or refused as non-finite in one line."""
    text = json.dumps(value)
    try:
        back = inputs.parse_json(text, PlanError, "x")
    except PlanError as e:
        assert "not a finite number" in str(e) and "\n" not in str(e)
        return
    assert json.dumps(back) == text
