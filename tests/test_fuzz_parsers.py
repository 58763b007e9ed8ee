"""Fuzzing every parser of user files: a valid file written by the project's own writer, corrupted at
random (truncated, bytes replaced, invalid UTF-8, random bytes, wrong types / NaN / infinities /
negatives / nulls put into random JSON fields, keys removed), either parses or raises a
FlexmeshError; never another exception (which the CLI would print as a traceback)."""

from __future__ import annotations

import gzip
import json
import math
import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexmesh.errors import FlexmeshError

# FLEXMESH_FUZZ_EXAMPLES=2000 searches harder (and at random) than the bounded, reproducible default.
_EXAMPLES = os.environ.get("FLEXMESH_FUZZ_EXAMPLES")
FUZZ = settings(max_examples=int(_EXAMPLES or 40), deadline=None, derandomize=_EXAMPLES is None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

# Values put in place of a JSON field: wrong types, non-finite numbers, zero, negatives, fractions,
# huge numbers, nulls and empty containers.
ODD_VALUES = st.sampled_from([None, True, False, 0, -1, -7, 3.5, -0.5, 0.0, math.nan, math.inf, -math.inf,
                              2**63, 10**30, "", "x", "12", [], [1, "a"], {}, {"a": 1}])


def _paths(obj, prefix=()):
    """Every path (tuple of keys and indices) into a JSON value, the value's own () included."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):  # a few entries of long lists are enough
            yield from _paths(v, (*prefix, i))


def _set(obj, path, value, delete=False):
    if not path:
        return value
    node = obj
    for part in path[:-1]:
        node = node[part]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return obj


@st.composite
def corrupted(draw, valid: dict) -> bytes:
    """The bytes of ``valid`` as JSON, corrupted one way or another."""
    how = draw(st.sampled_from(["field", "field", "field", "delete", "truncate", "byte", "utf8", "random"]))
    if how in ("field", "delete"):
        obj = json.loads(json.dumps(valid))
        paths = list(_paths(obj))
        for _ in range(draw(st.integers(1, 3))):
            path = draw(st.sampled_from(paths))
            try:
                obj = _set(obj, path, json.loads(json.dumps(draw(ODD_VALUES))), delete=how == "delete")
            except (KeyError, IndexError, TypeError):
                pass  # an earlier change removed or replaced the parent
            paths = list(_paths(obj))
        return json.dumps(obj).encode()
    raw = json.dumps(valid, indent=1).encode()
    if how == "truncate":
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if how == "byte":
        at = draw(st.integers(0, len(raw) - 1))
        return raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1:]
    if how == "utf8":
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x80\x80"])) + raw[at:]
    return draw(st.binary(max_size=200))


def _only_user_errors(parse, path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        parse(path)
    except FlexmeshError as e:
        assert "\n" not in str(e).strip(), str(e)


# ---- model config (config.json) -----------------------------------------------------------------
def _hf_config() -> dict:
    from flexmesh.spec.hf import to_hf_config
    from flexmesh.spec.model import MODEL_PRESETS

    return to_hf_config(MODEL_PRESETS["llama3.1-8b"])


@FUZZ
@given(st.data())
def test_fuzz_model_config(tmp_path_factory, data):
    from flexmesh.spec.model import parse_model

    path = tmp_path_factory.mktemp("cfg") / "config.json"
    _only_user_errors(lambda p: parse_model(str(p)), path, data.draw(corrupted(_hf_config())))


# ---- cluster (string or JSON file) -------------------------------------------------------------
@FUZZ
@given(st.data())
def test_fuzz_cluster_file(tmp_path_factory, data):
    from flexmesh.spec.cluster import parse_cluster

    valid = {**parse_cluster("2x4xA100-80GB").to_dict(), "speed_factors": [1.0] * 7 + [0.5]}
    path = tmp_path_factory.mktemp("cluster") / "cluster.json"
    _only_user_errors(lambda p: parse_cluster(str(p)), path, data.draw(corrupted(valid)))


@FUZZ
@given(st.one_of(st.text(max_size=30), st.from_regex(r"\A(\d{1,12}x)?\d{1,12}x[A-Za-z0-9\-]{0,12}\Z")))
def test_fuzz_cluster_string(text):
    from flexmesh.spec.cluster import parse_cluster

    try:
        parse_cluster(text)
    except FlexmeshError:
        pass


# ---- plan files ---------------------------------------------------------------------------------
def _plan_dict() -> dict:
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    s = LayerStrategy.parse("tp2-dp2z1")
    plan = Plan.uniform(model="tiny", cluster="8xA100-80GB", world_size=8, pp=2, pipeline_schedule="1f1b",
                num_microbatches=2, seq_len=1024, global_batch=8,
                stages=(StagePlan(0, 2, (s, s)), StagePlan(2, 4, (s, LayerStrategy.parse("tp1-u2-dp2z3-ac")))),
                predicted={"step_time_s": 1.0, "peak_memory_gib": [1.0, 2.0]})
    return plan.to_dict()


@FUZZ
@given(st.data())
def test_fuzz_plan_file(tmp_path_factory, data):
    from flexmesh.layout.plan import Plan
    from flexmesh.search.check import check_plan
    from flexmesh.spec import MODEL_PRESETS, parse_cluster

    path = tmp_path_factory.mktemp("plan") / "plan.json"

    def parse_and_check(p):
        check_plan(Plan.load(p), MODEL_PRESETS["tiny"], parse_cluster("8xA100-80GB"))

    _only_user_errors(parse_and_check, path, data.draw(corrupted(_plan_dict())))


# ---- length files (.txt, .json, .gz) ------------------------------------------------------------
@st.composite
def corrupted_bytes(draw, raw: bytes) -> bytes:
    how = draw(st.sampled_from(["truncate", "byte", "utf8", "random", "insert"]))
    if how == "truncate":
        return raw[: draw(st.integers(0, len(raw) - 1))]
    at = draw(st.integers(0, len(raw) - 1))
    if how == "byte":
        return raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1:]
    if how == "utf8":
        return raw[:at] + b"\xff\xfe" + raw[at:]
    if how == "insert":
        return raw[:at] + draw(st.sampled_from([b"3.5", b"-4", b"0", b"null", b"1e9", b"99999999999999999999",
                                                b"NaN", b"\x00", b"\n\n"])) + raw[at:]
    return draw(st.binary(max_size=200))


@FUZZ
@given(st.data(), st.sampled_from(["txt", "json", "txt.gz"]))
def test_fuzz_lengths_file(tmp_path_factory, data, kind):
    from flexmesh.data.lengths import load_lengths

    valid = [int(x) for x in load_lengths("prolong")[:40]]
    if kind == "json":
        raw = data.draw(st.one_of(corrupted(valid), corrupted_bytes(json.dumps(valid).encode())))
    else:
        raw = data.draw(corrupted_bytes("\n".join(map(str, valid)).encode() + b"\n"))
        if kind == "txt.gz" and data.draw(st.booleans()):
            raw = gzip.compress(raw)  # a good gzip of a bad text; else bad gzip bytes
    _only_user_errors(load_lengths, tmp_path_factory.mktemp("lengths") / f"lengths.{kind}", raw)


# ---- jsonl corpus -------------------------------------------------------------------------------
@FUZZ
@given(st.data())
def test_fuzz_jsonl_corpus(tmp_path_factory, data):
    from flexmesh.data.corpus import read_corpus

    docs = [{"text": f"document {i}: " + "héllo wörld " * i, "id": i} for i in range(6)]
    if data.draw(st.booleans()):
        docs[data.draw(st.integers(0, 5))] = data.draw(st.one_of(ODD_VALUES, st.builds(dict, text=ODD_VALUES)))
    raw = "".join(json.dumps(d) + "\n" for d in docs).encode()
    raw = data.draw(st.one_of(st.just(raw), corrupted_bytes(raw)))
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    _only_user_errors(lambda p: list(read_corpus(p).documents()), path, raw)


# ---- tokenizer.json -----------------------------------------------------------------------------
_TOKENIZER: dict = {}


def _tokenizer_json(tmp: Path) -> dict:
    if not _TOKENIZER:
        from flexmesh.data.tokenizer import train_bpe

        (tmp / "docs").mkdir()
        (tmp / "docs" / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
        _TOKENIZER.update(json.loads(train_bpe(tmp / "docs", vocab_size=280, cache_dir=tmp / "cache").to_str()))
    return _TOKENIZER


@FUZZ
@given(st.data())
def test_fuzz_tokenizer_file(tmp_path_factory, data):
    from flexmesh.data.tokenizer import load_tokenizer

    valid = _tokenizer_json(tmp_path_factory.mktemp("tok"))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    _only_user_errors(load_tokenizer, path, data.draw(corrupted(valid)))


# ---- profiles -----------------------------------------------------------------------------------
def _profiles() -> dict:
    from flexmesh.profile import CollectiveFit, HardwareProfile, LayerFit, ModelProfile
    from flexmesh.spec import MODEL_PRESETS

    hw = HardwareProfile(device={"type": "cpu", "name": "cpu", "nodes": 1, "devices_per_node": 2,
                                 "memory_bytes": 4 * 2**30}, dtype="fp32", matmul_flops_per_s={"fp32": 4e10},
                         memory_bytes_per_s=8e9, attention={"fp32": {"alpha_s": 0.0, "flops_per_s": 1e10}},
                         collectives=[CollectiveFit("all_reduce", 2, "intra", 2e-4, 2e-9, ((1024, 2e-4),)),
                                      CollectiveFit("send_recv", 2, "intra", 4e-5, 5e-10)],
                         produced_by={"processes": 2}, overlap={"hidden_fraction": 0.5})
    fit = LayerFit(1e-3, 5e-6, 1e-9, 2e-9)
    mp = ModelProfile(model=MODEL_PRESETS["tiny"].to_dict(), dtype="fp32",
                      layer={"forward": fit, "backward": fit, "backward_recompute": fit},
                      embedding={"forward": fit, "backward": fit}, head={"forward": fit, "backward": fit},
                      activations={"layers": [{"tp": 1, "cp": 1, "recompute": False, "bytes_per_token": 2e4}],
                                   "attention_mask_bytes_per_sq_row_token": 4.0, "embedding_bytes_per_token": 8.0,
                                   "head_bytes_per_token": 3e4},
                      states={"weight_bytes_per_param": 4, "grad_bytes_per_param": 4, "optimizer_bytes_per_param": 8,
                              "optimizer_step_s_per_param": 2e-9},
                      produced_by={"processes": 1},
                      parallel={"layers": [{"tp": 2, "cp": 1, "cp_kind": "none", "forward": fit, "backward": fit,
                                            "backward_recompute": fit}]})
    return {"hardware": hw.to_dict(), "model": mp.to_dict()}


@FUZZ
@given(st.data(), st.sampled_from(["hardware", "model"]))
def test_fuzz_profile(tmp_path_factory, data, kind):
    from flexmesh.profile import cluster_from_profile, cost_model_from_profiles, load_profile
    from flexmesh.spec import MODEL_PRESETS

    def parse(p):
        prof = load_profile(p, data.draw(st.sampled_from([kind, None])))
        if prof.kind == "hardware":
            cluster_from_profile(prof, 2)
        else:
            cost_model_from_profiles(MODEL_PRESETS["tiny"], model=prof, cluster=None, hardware=_hw_profile())

    path = tmp_path_factory.mktemp("profile") / f"{kind}.json"
    _only_user_errors(parse, path, data.draw(corrupted(_profiles()[kind])))


def _hw_profile():
    from flexmesh.profile import HardwareProfile

    return HardwareProfile.from_dict(_profiles()["hardware"], name="hw.json")
