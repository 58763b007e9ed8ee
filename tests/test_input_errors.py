"""Bad user input is a one-line FlexmeshError (or argparse's usage line) saying what to change: model
configs, cluster strings and files, plans, length files, jsonl corpora, tokenizers, weights,
checkpoint manifests and profiles. Flags are in tests/test_input_flags.py."""

from __future__ import annotations

import gzip
import json
import math

import pytest

from flexmesh.errors import CheckpointError, DataError, PlanError, ProfileError, SpecError
from flexmesh.spec import MODEL_PRESETS, parse_cluster, parse_model

TINY = MODEL_PRESETS["tiny"]


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text.strip() and "Traceback" not in text
    return text


# ---- model config ---------------------------------------------------------------------------------
def _config(tmp_path, **changes):
    from flexmesh.spec.hf import to_hf_config

    cfg = {**to_hf_config(TINY), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("value", ["4", [4], None, True, 3.5, -1, 0, math.nan, 2**40])
def test_config_counts_must_be_whole_positive_numbers(tmp_path, value):
    with pytest.raises(SpecError) as e:
        parse_model(_config(tmp_path, num_hidden_layers=value))
    assert "num_hidden_layers" in _one_line(e) and ("whole number" in str(e.value) or "largest" in str(e.value))


@pytest.mark.parametrize("key,value,expect", [
    ("rms_norm_eps", "small", "finite number > 0"), ("rms_norm_eps", math.nan, "finite number > 0"),
    ("max_position_embeddings", 4096.5, "whole number"), ("tie_word_embeddings", "yes", "true or false"),
    ("attention_dropout", "0", "finite number >= 0"), ("rope_theta", -1.0, "finite number > 0"),
    ("vocab_size", None, "null"), ("_name_or_path", ["x"], "must be a string"),
])
def test_config_values_of_the_wrong_type_name_the_key(tmp_path, key, value, expect):
    with pytest.raises(SpecError) as e:
        parse_model(_config(tmp_path, **{key: value}))
    assert key in _one_line(e) and expect in str(e.value)


def test_rope_parameters_of_the_wrong_type(tmp_path):
    rope = {"rope_type": "linear", "rope_theta": 1e4, "factor": "8"}
    with pytest.raises(SpecError, match="rope parameter factor must be a finite number > 0"):
        parse_model(_config(tmp_path, rope_parameters=rope))
    with pytest.raises(SpecError, match="rope_type"):
        parse_model(_config(tmp_path, rope_parameters={"rope_type": ["linear"], "factor": 2.0}))


# ---- cluster ----------------------------------------------------------------------------------------
def _cluster_file(tmp_path, d, name="cluster.json"):
    path = tmp_path / name
    path.write_text(json.dumps(d) if isinstance(d, (dict, list)) else d)
    return str(path)


def test_typo_in_a_cluster_file_lists_the_fields(tmp_path):
    with pytest.raises(SpecError) as e:
        parse_cluster(_cluster_file(tmp_path, {"nodes": 1, "devices_per_node": 2, "device": "H100",
                                               "speed_factor": [1.0, 0.5]}))
    assert "speed_factor" in _one_line(e) and "speed_factors" in str(e.value) and "devices_per_node" in str(e.value)
    with pytest.raises(SpecError, match="hbm_gbs.*hbm_gbps"):
        parse_cluster(_cluster_file(tmp_path, {"nodes": 1, "devices_per_node": 2,
                                               "device": {"base": "H100", "hbm_gbs": 3000}}))


@pytest.mark.parametrize("nodes", [1.9, "2", None, 0, -1, True])
def test_cluster_nodes_must_be_a_whole_number(tmp_path, nodes):
    with pytest.raises(SpecError) as e:
        parse_cluster(_cluster_file(tmp_path, {"nodes": nodes, "devices_per_node": 2, "device": "H100"}))
    assert "nodes" in _one_line(e)


@pytest.mark.parametrize("key,value", [("hbm_gbps", math.nan), ("hbm_gbps", math.inf), ("nvlink_gbps", 0),
                                       ("node_net_gbps", -5.0), ("mm_efficiency", 0.0), ("mm_efficiency", 1.5),
                                       ("intra_efficiency", "high"), ("memory_gib", None),
                                       # finite but past any real part: they priced steps past a float's range
                                       ("mm_efficiency", 1e-300), ("hbm_gbps", 1e308),
                                       ("peak_tflops", {"bf16": 1e-300})])
def test_device_numbers_must_be_finite_and_in_range(tmp_path, key, value):
    d = {"nodes": 1, "devices_per_node": 2, "device": {"base": "A100-80GB", key: value}}
    with pytest.raises(SpecError) as e:
        parse_cluster(_cluster_file(tmp_path, d))
    assert key in _one_line(e) and "cluster.json" in str(e.value)


@pytest.mark.parametrize("factors", [[1.0, math.nan], [1.0, -0.5], [1.0, 0.0], [1.0, "fast"], 0.5, [1.0, 1e308],
                                     [1e-9, 1.0]])
def test_speed_factors_must_be_positive_numbers(tmp_path, factors):
    d = {"nodes": 1, "devices_per_node": 2, "device": "H100", "speed_factors": factors}
    with pytest.raises(SpecError):
        parse_cluster(_cluster_file(tmp_path, d))


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_cluster_string(text):
    with pytest.raises(SpecError, match="cluster is empty"):
        parse_cluster(text)


@pytest.mark.parametrize("content", [[1, 2], "\"8xH100\"", b"\xff\xfe{", "{\"nodes\": "])
def test_cluster_file_that_is_not_an_object(tmp_path, content):
    path = tmp_path / "c.json"
    path.write_bytes(content if isinstance(content, bytes) else
                     (json.dumps(content) if isinstance(content, list) else content).encode())
    with pytest.raises(SpecError) as e:
        parse_cluster(str(path))
    _one_line(e)


# ---- plans ------------------------------------------------------------------------------------------
def _plan(**changes) -> dict:
    d = {"version": 2, "model": "tiny", "cluster": "2xA100-80GB", "world_size": 2, "pp": 1,
         "pipeline_schedule": "1f1b", "num_microbatches": 1, "seq_len": 1024, "global_batch": 4,
         "stages": [{"layers": [0, 4], "strategies": ["tp1-dp2z1"] * 4}]}
    d.update(changes)
    return d


@pytest.mark.parametrize("changes,expect", [
    ({"seq_len": -1}, "seq_len"), ({"global_batch": 0}, "global_batch"), ({"world_size": 2.5}, "world_size"),
    ({"pp": "1"}, "pp"), ({"seq_len": None}, "seq_len"), ({"model": 7}, "model"), ({"stages": "all"}, "stages"),
    ({"stages": [{"layers": [0, "4"], "strategies": ["tp1-dp2z1"] * 4}]}, "end layer"),
    ({"stages": [{"layers": [0, 4], "strategies": [1, 2, 3, 4]}]}, "stage 0"),
    # a repeat count is refused before the list is built (10^11 copies would exhaust the memory)
    ({"stages": [{"layers": [0, 4], "strategies": ["99999999999x tp1-dp2z1"]}]}, "more than the stage's 4"),
    ({"predicted": [1]}, "predicted"), ({"pipeline_schedule": ["1f1b"]}, "pipeline schedule"),
])
def test_plan_values_of_the_wrong_type(changes, expect):
    from flexmesh.layout.plan import Plan

    with pytest.raises(PlanError) as e:
        Plan.from_dict(_plan(**changes))
    assert expect in _one_line(e)


def test_plan_missing_keys_and_not_an_object(tmp_path):
    from flexmesh.layout.plan import Plan

    d = _plan()
    del d["global_batch"], d["stages"]
    with pytest.raises(PlanError, match="missing global_batch, stages"):
        Plan.from_dict(d)
    for content in ("[1, 2]", "\"plan\"", "null"):
        (tmp_path / "p.json").write_text(content)
        with pytest.raises(PlanError, match="must be a JSON object"):
            Plan.load(tmp_path / "p.json")


def test_check_refuses_a_plan_for_another_model_with_as_many_layers(tmp_path):
    from dataclasses import replace

    from flexmesh.layout.plan import Plan
    from flexmesh.search.check import check_plan

    plan, cluster = Plan.from_dict(_plan()), parse_cluster("2xA100-80GB")
    other = replace(TINY, name="wide", hidden=512, ffn_hidden=1376)  # 4 layers too
    with pytest.raises(PlanError) as e:
        check_plan(plan, other, cluster)
    assert "made for model 'tiny', not 'wide'" in _one_line(e) and "hidden 256 vs 512" in str(e.value)
    # the same shape under another name (a preset and its config.json) is the same model
    check_plan(plan, parse_model(_config(tmp_path)), cluster)
    check_plan(plan, TINY, cluster)


# ---- lengths ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,content,expect", [
    ("l.txt", "5\n3.5\n", "'3.5' is not a whole number"),
    ("l.json", "[5, 3.5]", "3.5 \\(a fraction\\)"),
    ("l.json", "[5, null]", "null"),
    ("l.json", "[5, \"7\"]", "str"),
    ("l.json", f"[5, {2**40}]", "2\\*\\*31 - 1"),
    ("l.json", "[100, 1e12]", "length 1000000000000 is above"),  # a whole number written as a float: its size
    ("l.json", "{\"a\": 1}", "expected a JSON list of lengths \\(e.g."),  # was read as lines of text
    ("l.txt", f"5\n{10**25}\n", "2\\*\\*31 - 1"),
    ("l.txt", "5\n0\n", ">= 1 token"),
    ("l.json", "[5, -3]", ">= 1 token"),
    ("l.txt", "", "empty"),
    ("l.json", "[]", "non-empty"),
    ("l.json", "[[1, 2], [3]]", "list"),
    ("l.txt", b"\x89PNG\r\n\x1a\n\x00\xff", "not a text file"),
    ("l.txt.gz", b"\x1f\x8b\x08\x00garbage", "not a readable gzip"),
    ("l.txt.gz", gzip.compress(b"5\n6\n", mtime=0)[:-6], "not a readable gzip"),
])
def test_length_files_refuse_what_is_not_a_token_count(tmp_path, name, content, expect):
    from flexmesh.data.lengths import load_lengths

    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError, match=expect) as e:
        load_lengths(str(path))
    _one_line(e)


def test_length_files_that_are_fine(tmp_path):
    from flexmesh.data.lengths import load_lengths

    (tmp_path / "l.txt.gz").write_bytes(gzip.compress(b"5\n6 7\n"))
    (tmp_path / "l.json").write_text("[5, 2147483647]")
    assert load_lengths(str(tmp_path / "l.txt.gz")).tolist() == [5, 6, 7]
    assert load_lengths(str(tmp_path / "l.json")).tolist() == [5, 2**31 - 1]


# ---- jsonl corpus ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("line,expect", [
    (b"{\"text\": \"caf\xe9\"}", "line 2 is not UTF-8"),
    (b"[\"a list\"]", "line 2 is a JSON list, not an object"),
    (b"\"just text\"", "line 2 is a JSON str, not an object"),
    (b"{\"body\": \"x\"}", "line 2 has no 'text' field"),
    (b"{\"text\": 5}", "field 'text' is a int"),
    (b"{\"text\": ", "line 2 is not valid JSON"),
])
def test_jsonl_corpus_lines_that_are_not_documents(tmp_path, line, expect):
    from flexmesh.data.corpus import read_corpus

    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"{\"text\": \"fine\"}\n" + line + b"\n")
    with pytest.raises(DataError, match=expect) as e:
        list(read_corpus(path).documents())
    _one_line(e)


# ---- tokenizer, weights, checkpoint manifest ----------------------------------------------------------
@pytest.mark.parametrize("content", [b"", b"{\"model\": 5}", b"\xff\xfe\x00", b"{\"version\": \"1.0\", \"trunc"])
def test_corrupt_tokenizer_file(tmp_path, content):
    from flexmesh.data.tokenizer import load_tokenizer

    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(DataError, match="not a valid tokenizer.json") as e:
        load_tokenizer(tmp_path)
    _one_line(e)


def test_truncated_or_corrupt_weights(tmp_path):
    import torch
    from safetensors.torch import save_file

    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.state.weights import load_hf_safetensors

    spec = MODEL_PRESETS["tiny"].__class__(name="w", num_layers=1, hidden=32, num_heads=2, num_kv_heads=2,
                                           ffn_hidden=64, vocab=64, dtype="fp32")
    model = build_model(spec, "cpu")
    shard = tmp_path / "model-00001.safetensors"
    save_file({"x": torch.ones(1000)}, str(shard))
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated download
    with pytest.raises(CheckpointError, match="not a readable safetensors file.*truncated") as e:
        load_hf_safetensors(model, shard)
    _one_line(e)
    index = tmp_path / "model.safetensors.index.json"
    for content in (b"\xff\xfe", b"{\"weight_map\": [1]}", b"{\"weight_map\": {\"a\": 5}}", b"[]"):
        index.write_bytes(content)
        with pytest.raises(CheckpointError) as e:
            load_hf_safetensors(model, index)
        _one_line(e)
    # an index whose shard is truncated: refused before any tensor is read
    names = [n for n, _ in model.named_parameters()]
    from flexmesh.runtime.state.weights import hf_name

    index.write_text(json.dumps({"weight_map": {hf_name(n): shard.name for n in names}}))
    with pytest.raises(CheckpointError, match="model-00001.safetensors: not a readable safetensors file"):
        load_hf_safetensors(model, index)


@pytest.mark.parametrize("content", [b"\xff\xfe{", b"[1, 2]", b"{\"step\": \"x\", \"plan_hash\": \"h\"}", b"{",
                                     b"{\"step\": -1, \"plan_hash\": \"h\"}", b"{\"step\": 2.5, \"plan_hash\": \"h\"}"])
def test_corrupt_checkpoint_manifest(tmp_path, content):
    from flexmesh.runtime.state.checkpoint import latest_checkpoint, read_manifest

    step = tmp_path / "step_000001"
    step.mkdir()
    (step / "manifest.json").write_bytes(content)
    with pytest.raises(CheckpointError, match="is corrupt") as e:
        read_manifest(step)
    _one_line(e)
    (tmp_path / "latest").write_bytes(b"\xff\xfe" + content)
    with pytest.raises(CheckpointError, match="not a step_NNNNNN folder"):
        latest_checkpoint(tmp_path)


# ---- profiles -------------------------------------------------------------------------------------------
def _hardware(**changes) -> dict:
    from flexmesh.profile import CollectiveFit, HardwareProfile

    d = HardwareProfile(device={"type": "cpu", "name": "cpu", "nodes": 1, "devices_per_node": 2,
                                "memory_bytes": 2**33}, dtype="fp32", matmul_flops_per_s={"fp32": 4e10},
                        memory_bytes_per_s=8e9, attention={"fp32": {"flops_per_s": 1e10}},
                        collectives=[CollectiveFit("send_recv", 2, "intra", 4e-5, 5e-10)]).to_dict()
    for path, value in changes.items():
        node = d
        *parents, last = path.split(".")
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[int(last) if isinstance(node, list) else last] = value
    return d


@pytest.mark.parametrize("path,value", [
    ("memory_bytes_per_s", 0), ("memory_bytes_per_s", math.nan), ("memory_bytes_per_s", -1.0),
    ("memory_bytes_per_s", "fast"), ("matmul_flops_per_s.fp32", 0.0), ("attention.fp32.flops_per_s", math.inf),
    ("device.devices_per_node", 2.5), ("device.memory_bytes", None), ("collectives.0.group_size", "2"),
    ("collectives.0.alpha_s", -1e-5), ("collectives.0.beta_s_per_byte", math.nan), ("collectives.0.scope", "far"),
    ("collectives", {"send_recv": 1}), ("overlap", {"hidden_fraction": "half"}),
])
def test_hardware_profile_values(tmp_path, path, value):
    from flexmesh.profile import load_profile

    f = tmp_path / "hw.json"
    f.write_text(json.dumps(_hardware(**{path: value})))
    with pytest.raises(ProfileError) as e:
        load_profile(f, "hardware")
    assert path.split(".")[-1] in _one_line(e) or path.split(".")[0] in str(e.value)


def _model_profile() -> dict:
    from flexmesh.profile import LayerFit, ModelProfile

    fit = LayerFit(1e-3, 5e-6, 1e-9, 0.0)
    return ModelProfile(model=TINY.to_dict(), dtype="fp32", layer={"forward": fit, "backward": fit,
                                                                   "backward_recompute": fit},
                        embedding={"forward": fit, "backward": fit}, head={"forward": fit, "backward": fit},
                        activations={"layers": [{"tp": 1, "cp": 1, "recompute": False, "bytes_per_token": 2e4}],
                                     "attention_mask_bytes_per_sq_row_token": 4.0, "embedding_bytes_per_token": 8.0,
                                     "head_bytes_per_token": 3e4},
                        states={"weight_bytes_per_param": 4, "grad_bytes_per_param": 4, "optimizer_bytes_per_param": 8,
                                "optimizer_step_s_per_param": 2e-9}).to_dict()


@pytest.mark.parametrize("part,key,value", [
    ("states", "weight_bytes_per_param", 0), ("states", "optimizer_step_s_per_param", math.nan),
    ("activations", "head_bytes_per_token", -1.0), ("layer", "forward", {"c0_s": -1.0, "c1_s_per_token": 0,
                                                                         "c2_s_per_sq_token": 0}),
    ("layer", "backward", {"c0_s": "x", "c1_s_per_token": 0, "c2_s_per_sq_token": 0}),
    ("model", "num_layers", "4"),
])
def test_model_profile_values(tmp_path, part, key, value):
    from flexmesh.profile import load_profile

    d = _model_profile()
    d[part][key] = value
    f = tmp_path / "model.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ProfileError) as e:
        load_profile(f, "model")
    _one_line(e)
    d = _model_profile()
    d["activations"]["layers"][0]["tp"] = 1.5
    f.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"activations.layers\[0\].tp must be a whole number"):
        load_profile(f, "model")


# ---- serving plans --------------------------------------------------------------------------------
@pytest.mark.parametrize("section,key,value,expect", [
    ("workload", "window", [5, 1], "workload.window must be a non-empty string"),
    ("workload", "window", "5:1", "workload.window must be \"START:END\""),
    ("workload", "trace", 5, "workload.trace must be a non-empty string"),
    ("workload", "requests", -3, "workload.requests must be a whole number >= 1"),  # was a slice of the trace
    ("workload", "fit_context", "yes", "workload.fit_context must be true or false"),
    ("workload", "zzz", 1, "workload has unknown field(s) zzz"),
    ("predicted", "goodput", -1, "predicted.goodput must be a finite number >= 0"),
])
def test_a_serving_plans_workload_and_predictions_are_checked_as_the_flags_that_wrote_them(section, key, value,
                                                                                         expect):
    from flexmesh.serve.export import EXAMPLE_PLAN
    from flexmesh.serve.layout.plan import ServingPlan

    d = json.loads(EXAMPLE_PLAN)
    d[section] = {**d.get(section, {}), "trace": "azure-conv", key: value} if section == "workload" else {key: value}
    with pytest.raises(PlanError) as e:
        ServingPlan.from_dict(d)
    assert expect in _one_line(e)
    d[section] = {"trace": "azure-conv", "window": "0:600", "requests": 100, "fit_context": False}
    if section == "workload":
        assert ServingPlan.from_dict(d).workload["window"] == "0:600"


def test_arrival_times_past_a_floats_resolution_of_a_latency_are_refused(tmp_path):
    from flexmesh.data.requests import constant_lengths, load_trace, with_arrivals

    f = tmp_path / "epoch_ns.csv"  # epoch nanoseconds read as seconds: every latency rounded to 0 before
    f.write_text("arrival_s,prompt_tokens,output_tokens\n1700000000000000000,100,20\n1700000000500000000,200,30\n")
    with pytest.raises(DataError) as e:
        load_trace(str(f))
    assert "give arrival times in seconds" in _one_line(e)
    f.write_text("arrival_s,prompt_tokens,output_tokens\n1700000000,100,20\n1700000000.5,200,30\n")  # epoch seconds
    assert load_trace(str(f)).duration_s == pytest.approx(0.5)
    with pytest.raises(DataError, match="or a higher rate"):
        with_arrivals(constant_lengths(100, 10), 1e-300, n=3)


@pytest.mark.parametrize("text,says", [("ttft=2s,ttft=3s", "names ttft twice"), ("e2e=1e400s", "a finite time")])
def test_an_slo_naming_a_metric_twice_or_an_infinite_bound_is_refused(text, says):
    from flexmesh.errors import FlexmeshError
    from flexmesh.serve.layout.slo import parse_slo

    with pytest.raises(FlexmeshError, match=says):  # the last value won, or the bound was inf
        parse_slo(text)


@pytest.mark.parametrize("name,content,says", [
    ("dup.csv", "arrival_s,prompt_tokens,prompt_tokens,output_tokens\n0,10,20,5\n", "names 'prompt_tokens' twice"),
    ("b0.jsonl", '{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5, "branches": 0}\n', "'branches' is 0"),
    ("n0.csv", "arrival_s,prompt_tokens,output_tokens,needed\n0,10,5,0\n", "'needed' is 0"),
])
def test_a_trace_column_given_twice_or_a_zero_count_is_refused_not_defaulted(tmp_path, name, content, says):
    from flexmesh.data.requests import load_trace

    (tmp_path / name).write_text(content)
    with pytest.raises(DataError) as e:
        load_trace(str(tmp_path / name))
    assert says in _one_line(e)
    (tmp_path / "blank.csv").write_text("arrival_s,prompt_tokens,output_tokens,branches\n0,10,5,\n")
    assert load_trace(str(tmp_path / "blank.csv")).requests[0].branches == 1  # an empty cell: the default


def test_a_serving_plan_without_a_devices_price_takes_the_presets_or_says_so():
    from flexmesh.serve.export import EXAMPLE_PLAN
    from flexmesh.serve.layout.plan import ServingPlan
    from flexmesh.spec.prices import gpu_prices

    d = json.loads(EXAMPLE_PLAN)
    d["prices"] = {}  # priced $nan/h before
    plan = ServingPlan.from_dict(d)
    assert plan.dollars_per_hour == pytest.approx(sum(gpu_prices()[k].usd_per_hour * n
                                                      for k, n in plan.devices.items()))


@pytest.mark.parametrize("name,content,says", [
    ("nb.toml", 'nodes = 1\ndevices_per_node = 2\n[device]\nmemory_gib = 80\n',
     "a device table without base needs every field of a device (15 missing: name,"),
    ("c.yaml", 'nodes = 1\ndevices_per_node = 2\ndevice = "H100"\n', "give a .json or .toml file"),
])
def test_a_cluster_file_error_names_what_to_give_not_pythons_internals(tmp_path, name, content, says):
    (tmp_path / name).write_text(content)
    with pytest.raises(SpecError) as e:
        parse_cluster(str(tmp_path / name))
    assert says in _one_line(e) and "__init__" not in str(e.value)
    with pytest.raises(SpecError, match="no such file"):
        parse_cluster(str(tmp_path / "missing.toml"))


@pytest.mark.parametrize("flag", ["--attainment=0", "--attainment=1.5"])
def test_an_attainment_target_is_in_zero_one(flag):
    from flexmesh.cli import build_parser

    for command in (["serve", "simulate"], ["serve", "plan", "--rate", "5"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, flag])


def test_a_sha256_table_that_lists_no_file_checks_nothing_and_is_refused(tmp_path):
    from flexmesh.runtime.state.checkpoint import _verify

    step = tmp_path / "step_000001"
    step.mkdir()
    (step / ".metadata").write_bytes(b"m")
    (step / "__0_0.distcp").write_bytes(b"s")
    for sums, says in (({}, "does not list .metadata"), ({".metadata": "0" * 64}, "does not list __0_0.distcp")):
        with pytest.raises(CheckpointError, match=says) as e:
            _verify(step, {"step": 1, "sha256": sums})
        _one_line(e)
