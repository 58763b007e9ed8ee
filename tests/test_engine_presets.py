"""Engine descriptions: each preset makes the simulator do what its source says the engine does, a description file is
read as documented, a plan carries its engine, and export writes the flags that match it."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from importlib import resources
from pathlib import Path

import pytest
import tomllib

from flexmesh.cost.device.hardware import GroupShape, Hardware, unmeasured, unmeasured_notes
from flexmesh.cost.inference.analytic import AnalyticIteration
from flexmesh.cost.inference.overhead import decode_cpu_samples
from flexmesh.data.requests import constant_lengths, with_arrivals
from flexmesh.errors import PlanError, SpecError
from flexmesh.serve.export import EXAMPLE_PLAN, launches
from flexmesh.serve.layout.engine import EngineSpec, engine_spec, presets
from flexmesh.serve.layout.knobs import EngineKnobs
from flexmesh.serve.layout.plan import ServingPlan
from flexmesh.serve.layout.replicas import parse_replicas, place
from flexmesh.serve.simulator import Fleet
from flexmesh.spec import parse_cluster, parse_model
from flexmesh.spec.cluster import parse_mixed_cluster
from flexmesh.spec.devices import device

MODEL = parse_model("llama3-8b")


class Recording:
    """An iteration price that records every batch the replica ran: (decodes, chunks)."""

    def __init__(self, engine: EngineSpec):
        self.timing = engine.iteration(MODEL, Hardware(parse_cluster("1xH100")))
        self.batches: list[tuple[int, tuple[tuple[int, int], ...]]] = []

    def split_s(self, decodes, decode_context, chunks):
        self.batches.append((decodes, tuple(chunks)))
        return self.timing.split_s(decodes, decode_context, chunks)


def _run(engine: str, prompt: int = 1500, budget: int = 2048, n: int = 80, rate: float = 30.0):
    spec = engine_spec(engine)
    rec = Recording(spec)
    c = parse_mixed_cluster("1xH100")
    knobs = {0: EngineKnobs(max_seqs=64, max_batched_tokens=budget)}
    fleet = Fleet(MODEL, c, place(parse_replicas("tp1", c), c), knobs, timing=lambda r: rec, engine=spec)
    out = fleet.run(with_arrivals(constant_lengths(prompt, 40), rate=rate, n=n))
    del rec.batches[:2]  # the run's two rate probes for the router (a budget's prefill, a batch's decode)
    assert len(out.records) == n and all(r.output_tokens == 40 for r in out.records)
    return rec.batches, out


def _mixed(batches) -> int:
    return sum(1 for d, chunks in batches if d and chunks)


def _split(batches, prompt: int) -> int:
    return sum(1 for _, chunks in batches for ctx, k in chunks if ctx > 0 or k < prompt)


def test_a_prefill_first_engine_never_mixes_a_prompt_into_a_decode_batch():
    for name in ("vllm-v0", "sglang", "distserve"):
        batches, _ = _run(name)
        assert engine_spec(name).prefill_first
        assert _mixed(batches) == 0, name
        assert any(chunks for _, chunks in batches) and any(d for d, _ in batches)
    batches, _ = _run("vllm")  # the same load on current vLLM mixes them: the check can fail
    assert _mixed(batches) > 0


def test_an_engine_without_chunked_prefill_never_splits_a_prompt():
    # prompts of 1500 tokens against a budget of 2048: a second one does not fit beside the first
    for name in ("vllm-v0", "trtllm", "distserve"):
        batches, _ = _run(name)
        assert not engine_spec(name).chunked_prefill
        assert _split(batches, 1500) == 0, name
        assert max(len(chunks) for _, chunks in batches) == 1  # two never fit together
    for name in ("vllm", "sglang"):  # chunked engines cut them
        batches, _ = _run(name)
        assert _split(batches, 1500) > 0, name


def test_a_prompt_longer_than_the_budget_runs_alone_on_an_engine_that_never_chunks():
    batches, out = _run("trtllm", prompt=3000, budget=2048, n=20, rate=5.0)
    prompts = [k for _, chunks in batches for _, k in chunks]
    assert prompts == [3000] * 20
    assert all(len(chunks) <= 1 for _, chunks in batches)


def test_every_preset_cites_a_source_for_what_it_sets_and_round_trips():
    assert set(presets()) >= {"vllm", "vllm-v0", "sglang", "trtllm", "transformers"}
    for name, e in presets().items():
        cited = dict(e.sources)
        assert "overhead" in cited and "cuda_graphs" in cited, name
        assert EngineSpec.from_dict(json.loads(json.dumps(e.to_dict()))) == e  # exact: JSON keeps a float's repr
    assert engine_spec() is presets()["vllm"]


def test_a_replica_of_more_than_one_gpu_pays_the_engines_rpc_and_overlap_takes_the_larger():
    hw = Hardware(parse_cluster("1x8xH100"))
    v0, v1 = engine_spec("vllm-v0"), engine_spec("vllm")
    one = v0.iteration(MODEL, hw, tp=1).split_s(8, 8000, ())
    assert one == pytest.approx(replace(v0, multi_gpu_ms=0.0).iteration(MODEL, hw, tp=1).split_s(8, 8000, ()))
    two, two_free = (e.iteration(MODEL, hw, tp=2).split_s(8, 8000, ()) for e in (v0, replace(v0, multi_gpu_ms=0.0)))
    assert two - two_free == pytest.approx(v0.multi_gpu_ms * 1e-3, rel=1e-9)
    # the RPC makes tp2 decode barely faster than tp1 on the older engine, about 1.6x on current vLLM
    assert one / two < 1.2 < v1.iteration(MODEL, hw, tp=1).split_s(8, 8000, ()) / v1.iteration(
        MODEL, hw, tp=2).split_s(8, 8000, ())
    over = v1.iteration(MODEL, hw)  # current vLLM schedules the next iteration while the GPU runs this one
    plain = replace(v1, cpu_overlap=False).iteration(MODEL, hw)
    gpu, cpu = plain.split_s(8, 8000, ()) - plain.cpu_s(8), plain.cpu_s(8)
    assert over.split_s(8, 8000, ()) == pytest.approx(max(gpu, cpu), rel=1e-12)
    # decode runs in closed form agree with the iterations one by one, overlap or not
    for t in (over, plain, replace(v1, cpu_overlap=True, overhead=replace(v1.overhead, fixed_s=0.02)).iteration(
            MODEL, hw)):
        steps = [t.split_s(4, 400 + 4 * i, ()) for i in range(300)]
        assert t.decode_run_s(4, 400, 300) == pytest.approx(sum(steps), rel=1e-9)


def test_without_cuda_graphs_decode_pays_the_eager_calls():
    hw = Hardware(parse_cluster("1xH100"))
    v1 = engine_spec("vllm")
    eager = replace(v1, cuda_graphs=False).iteration(MODEL, hw)
    graphs = v1.iteration(MODEL, hw)
    assert eager.split_s(4, 4000, ()) > graphs.split_s(4, 4000, ())
    assert eager.split_s(0, 0, [(0, 1000)]) == pytest.approx(graphs.split_s(0, 0, [(0, 1000)]), rel=1e-12)


def test_only_iterations_within_the_graph_sizes_are_priced_as_replayed():
    hw = Hardware(parse_cluster("1x8xH100"))
    v1 = engine_spec("vllm")
    eager = replace(v1, cuda_graphs=False).iteration(MODEL, hw, tp=2)
    small = replace(v1, graph_batch=64, graph_tokens=0).iteration(MODEL, hw, tp=2)
    # a decode batch up to the size: attention's launch and the graphed all-reduce; one past it: the eager calls
    assert small.attention_s(64, 64_000, ()) < eager.attention_s(64, 64_000, ())
    assert small.dense_s(64, True) < eager.dense_s(64, True)
    # exact: the same terms summed in the same order
    assert small.attention_s(65, 65_000, ()) == eager.attention_s(65, 65_000, ())
    assert small.dense_s(65, True) == eager.dense_s(65, True)  # exact: the same terms
    # graph_tokens 0: an iteration with a prompt chunk runs eagerly; vLLM's 512 replays it piecewise
    assert small.dense_s(256, False) == eager.dense_s(256, False)  # exact: the same terms
    assert v1.iteration(MODEL, hw, tp=2).dense_s(256, False) < eager.dense_s(256, False)
    # each preset's sizes, as its sources give them
    assert {n: e.graphs for n, e in presets().items()} == {
        "vllm": (512, 512), "vllm-v0": (256, 0), "sglang": (160, 0), "trtllm": (128, 0), "distserve": (0, 0),
        "transformers": (0, 0)}
    with pytest.raises(SpecError, match="graph_batch is a whole number >= 0"):
        EngineSpec.from_dict({"base": "vllm", "name": "x", "graph_batch": -1})


def test_the_eager_engines_host_time_is_its_h200_profile_scaled_by_layers_and_hides_the_gpu():
    # the preset's samples are what decode_cpu_samples makes of the iterations the engine logged on the H200
    run = Path(__file__).resolve().parent.parent / "bench" / "data" / "serve_gpu" / "h200-2026-11-30"
    logged = [it for replica in json.loads((run / "iterations-4.json").read_text()) for it in replica]
    raw = tomllib.loads(resources.files("flexmesh.spec").joinpath("presets/engine_overhead.toml").read_text())
    assert decode_cpu_samples(logged) == (raw["transformers"]["requests"], raw["transformers"]["ms"])
    e = engine_spec("transformers")
    assert e.cpu_overlap and not e.cuda_graphs and e.overhead.layers == 22
    hw = Hardware(parse_cluster("1xH200"))
    tiny, deep = parse_model("tinyllama-1.1b"), replace(parse_model("tinyllama-1.1b"), num_layers=44)
    small, big = e.iteration(tiny, hw), e.iteration(deep, hw)
    assert big.cpu_s(4) == pytest.approx(2 * small.cpu_s(4), rel=1e-12)  # the host's time per layer
    # a small decode is the host's time (the GPU's kernels run under it); a long prefill the GPU's
    assert small.split_s(2, 600, ()) == pytest.approx(small.cpu_s(2), rel=1e-12)
    long = small.split_s(0, 0, [(0, 16384)])
    assert long > 2 * small.cpu_s(1) and long == pytest.approx(
        replace(e, cpu_overlap=False).iteration(tiny, hw).split_s(0, 0, [(0, 16384)]) - small.cpu_s(1), rel=1e-12)
    # a description's own layers-scaled overhead round-trips; bad layers are refused in one line
    mine = EngineSpec.from_dict({"base": "vllm", "name": "mine",
                                 "overhead": {"fixed_ms": 10.0, "layers": 16, "source": "my profile"}})
    assert mine.overhead.layers == 16 and EngineSpec.from_dict(mine.to_dict()) == mine
    with pytest.raises(SpecError, match="layers .* is a whole number >= 0") as err:
        EngineSpec.from_dict({"base": "vllm", "name": "bad", "overhead": {"fixed_ms": 1.0, "layers": -2}})
    assert "\n" not in str(err.value)


def test_each_engine_all_reduces_as_its_own_kernels_were_timed_inside_it():
    assert {n: e.all_reduce for n, e in presets().items()} == {
        "vllm": "vllm", "vllm-v0": "nccl", "sglang": "sglang", "trtllm": "trtllm", "distserve": "nccl",
        "transformers": "nccl"}
    hw = Hardware(parse_cluster("2x8xH100"))
    tp4, small, large = GroupShape(4, 4), 8 * 4096 * 2.0, 4096 * 4096 * 2.0
    nccl = hw.collective_time("all_reduce", small, tp4)
    graphed, eager = (hw.engine_all_reduce("vllm", g, small, tp4) for g in (True, False))
    # vLLM's custom kernel replayed in a graph beats NCCL on a decode's message; called eagerly it pays the host
    assert graphed < 0.6 * nccl and eager > 2 * graphed
    # TensorRT-LLM's op has one timing; NCCL's is NCCL's; across nodes every engine falls back to NCCL
    # exact: both read the one curve it has
    assert hw.engine_all_reduce("trtllm", False, small, tp4) == hw.engine_all_reduce("trtllm", True, small, tp4)
    assert hw.engine_all_reduce("nccl", True, small, tp4) == nccl  # exact: the same call
    # NCCL called eagerly pays at least the node's measured host work per call (vLLM's eager call of its smallest
    # message), which a large message's kernel time exceeds; nodes and groups nothing measured it on keep NCCL's
    floor = hw.eager_floor(tp4)
    assert 10e-6 < floor < 60e-6 and floor > 1.5 * nccl
    assert hw.engine_all_reduce("nccl", False, small, tp4) == floor  # exact: the floor itself
    # exact: the same call, the floor below it
    assert hw.engine_all_reduce("nccl", False, large, tp4) == hw.collective_time("all_reduce", large, tp4)
    assert hw.eager_floor(GroupShape(16, 8)) == 0.0 == Hardware(parse_cluster("1x8xL40S")).eager_floor(tp4)
    across = GroupShape(16, 8)
    # exact: the same call
    assert hw.engine_all_reduce("vllm", True, small, across) == hw.collective_time("all_reduce", small, across)
    # large messages: the engine's own dispatch hands them to NCCL, within the tables' noise of NCCL's time
    assert hw.engine_all_reduce("vllm", True, large, tp4) == pytest.approx(
        hw.collective_time("all_reduce", large, tp4), rel=0.15)
    # which timing an iteration pays: vLLM graphs up to 512 tokens, decode or mixed; SGLang decode batches only;
    # an engine run eagerly never
    v1 = engine_spec("vllm")
    engines = {"vllm": v1, "sglang": engine_spec("sglang"), "eager": replace(v1, cuda_graphs=False),
               "nccl": replace(v1, all_reduce="nccl")}
    its = {name: e.iteration(MODEL, hw, tp=4) for name, e in engines.items()}
    for tokens, decode_only in ((64, True), (64, False), (2048, False)):
        dense = {name: it.dense_s(tokens, decode_only) for name, it in its.items()}
        act = tokens * its["vllm"].hidden_bytes
        per_layer = {g: hw.engine_all_reduce("vllm", g, act, tp4) for g in (True, False)}
        expect_graphed = tokens <= 512
        # exact: the same terms but the all-reduces (two per layer and the embedding's)
        assert dense["vllm"] - dense["eager"] == pytest.approx(
            (2 * MODEL.num_layers + 1) * (per_layer[expect_graphed] - per_layer[False]), rel=1e-9, abs=1e-12)
        assert (dense["vllm"] < dense["nccl"]) == expect_graphed
    # SGLang replays decode batches of up to 160 requests only
    sglang = its["sglang"]
    assert sglang.dense_s(64, True) < sglang.dense_s(64, False)
    assert sglang.dense_s(400, True) == sglang.dense_s(400, False)  # exact: both eager, the same terms
    # a part whose node has no engine table (L40S) prices NCCL's, whatever the engine
    l40s = Hardware(parse_cluster("1x8xL40S"))
    # exact: the same NCCL times summed in the same order
    assert v1.iteration(MODEL, l40s, tp=4).split_s(8, 8000, ()) == replace(v1, all_reduce="nccl").iteration(
        MODEL, l40s, tp=4).split_s(8, 8000, ())
    # a profiled machine's own all-reduce measurement prices it, whatever the engine
    from flexmesh.profile.format import CollectiveFit, HardwareProfile
    from flexmesh.profile.timing import ProfiledHardware
    from flexmesh.spec.cluster import ClusterSpec

    fits = [CollectiveFit(k, 2, "intra", 1e-5, 1e-11) for k in ("all_reduce", "all_gather")]
    prof = HardwareProfile(device={"type": "cuda", "name": "x", "nodes": 1, "devices_per_node": 2,
                                   "memory_bytes": 2**36}, dtype="bf16", matmul_flops_per_s={"bf16": 1e14},
                           memory_bytes_per_s=1e12, attention={"bf16": {"flops_per_s": 5e13}}, collectives=fits)
    mine = ProfiledHardware(ClusterSpec(1, 2, device("A100-80GB")), prof, "bf16")
    assert AnalyticIteration(MODEL, mine, 2, all_reduce="vllm").split_s(8, 8000, ()) == AnalyticIteration(
        MODEL, mine, 2).split_s(8, 8000, ())  # exact: the same measured curve, summed in the same order
    with pytest.raises(SpecError, match="all_reduce is one of"):
        EngineSpec.from_dict({"base": "vllm", "name": "x", "all_reduce": "gloo"})


def test_tensor_parallel_pricing_is_monotone_in_link_speed():
    base = parse_cluster("1x8xA100-80GB")
    times = []
    for gbps in (16.0, 64.0, 150.0, 300.0, 600.0):
        d = replace(base.device, nvlink_gbps=gbps, comm_table="")
        hw = Hardware(replace(base, device=d))
        it = engine_spec().iteration(MODEL, hw, tp=4)
        times.append((it.split_s(64, 64 * 2000, ()), it.split_s(0, 0, [(0, 4096)])))
    for kind in (0, 1):
        series = [t[kind] for t in times]
        assert series == sorted(series, reverse=True) and series[0] > series[-1], series


def test_a_description_file_starts_from_a_base_and_errors_are_one_line(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('base = "vllm"\nprefill_first = true\nchunked_prefill = false\nmulti_gpu_ms = [1.0, 2.0, 9.0]\n'
                 '[overhead]\nfixed_ms = 2.5\nper_request_ms = 0.05\nsource = "my profile"\n')
    e = engine_spec(str(f))
    assert (e.name, e.scheduler_name, e.multi_gpu_ms, e.cuda_graphs) == ("mine", "prefill-first-whole", 2.0, True)
    assert e.overhead.fixed_s == pytest.approx(2.5e-3) and e.overhead.source == "my profile"
    j = tmp_path / "other.json"
    j.write_text(json.dumps({"title": "Other", "kind": "vllm", "cuda_graphs": False}))
    assert (engine_spec(str(j)).name, engine_spec(str(j)).cuda_graphs) == ("other", False)
    for body, says in (('base = "vllm"\nmax_seqs = 0\n', "max_seqs is a whole number >= 1"),
                       ('base = "vllm"\ncuda_graph = true\n', "unknown field(s) cuda_graph"),
                       ('base = "nope"\n', "unknown engine 'nope'"),
                       ('base = "vllm"\noverhead = 3\n', "overhead is a preset name or a table"),
                       ('base = "vllm"\nrates = {gemm = -1}\n', "gemm rate is a factor > 0")):
        f.write_text(body)
        with pytest.raises(SpecError, match=re.escape(says)) as err:
            engine_spec(str(f))
        assert "\n" not in str(err.value)
    with pytest.raises(SpecError, match=re.escape("(no such file): give a preset")):
        engine_spec(str(tmp_path / "missing.toml"))


def test_a_base_file_is_found_beside_its_file_and_a_loop_or_a_wrong_type_is_one_line(tmp_path, monkeypatch):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "mine.toml").write_text('base = "vllm"\ncuda_graphs = false\n')
    (sub / "child.toml").write_text('base = "mine.toml"\nmax_seqs = 7\n')
    monkeypatch.chdir(tmp_path)  # the base is named relative to child.toml's folder, not to this one
    child = engine_spec("sub/child.toml")
    assert (child.max_seqs, child.cuda_graphs) == (7, False)
    (sub / "a.toml").write_text('base = "b.toml"\n')
    (sub / "b.toml").write_text('base = "a.toml"\n')
    (sub / "self.json").write_text(json.dumps({"base": "self.json"}))
    (sub / "five.json").write_text(json.dumps({"base": 5}))
    (sub / "list.toml").write_text('base = ["vllm"]\n')
    for name, says in (("a.toml", "leads back to a file it is read through (a.toml -> b.toml -> a.toml)"),
                       ("self.json", "(self.json -> self.json)"), ("five.json", "base names a preset"),
                       ("list.toml", "got ['vllm']")):
        with pytest.raises(SpecError, match=re.escape(says)) as err:
            engine_spec(str(sub / name))
        assert "\n" not in str(err.value)


def test_a_plan_carries_its_engine_and_export_writes_its_flags():
    plan = ServingPlan.from_dict(json.loads(EXAMPLE_PLAN))
    assert plan.engine == engine_spec()  # a plan file without one: current vLLM
    v0 = replace(plan, engine=engine_spec("vllm-v0"))
    again = ServingPlan.from_dict(json.loads(json.dumps(v0.to_dict())))
    assert again.engine == engine_spec("vllm-v0")  # exact: JSON keeps a float's repr
    assert Fleet.from_plan(again)[0].engine.scheduler_name == "prefill-first-whole"
    vllm = [c.argv for c in launches("vllm", v0, "/m")]
    assert all("--no-enable-chunked-prefill" in a for a in vllm)
    assert not any("--no-enable-chunked-prefill" in c.argv for c in launches("vllm", plan, "/m"))
    sg = [c.argv for c in launches("sglang", replace(plan, engine=engine_spec("sglang")), "/m")]
    assert all("--enable-mixed-chunk" not in a and "--disable-overlap-schedule" not in a for a in sg)
    sg_v1 = [c.argv for c in launches("sglang", plan, "/m")]  # SGLang made to batch as the plan was priced
    assert all("--enable-mixed-chunk" in a and "--disable-overlap-schedule" not in a for a in sg_v1)
    # an engine priced with NCCL's all-reduce is started without its own
    assert all("--disable-custom-all-reduce" in a for a in vllm)
    assert not any("--disable-custom-all-reduce" in c.argv for c in launches("vllm", plan, "/m"))
    assert all("--disable-custom-all-reduce" not in a for a in sg)
    # vLLM overlaps its CPU work by default (async scheduling): an engine priced without it is started without it
    assert all("--no-async-scheduling" in a for a in vllm)
    assert not any("--no-async-scheduling" in c.argv or "--async-scheduling" in c.argv
                   for c in launches("vllm", plan, "/m"))
    # the CUDA graph sizes it was priced with: vLLM's one capture size, SGLang's decode batch; none at the defaults
    assert all(a[a.index("--max-cudagraph-capture-size") + 1] == "256" for a in vllm)
    assert not any("--max-cudagraph-capture-size" in c.argv for c in launches("vllm", plan, "/m"))
    assert all("--cuda-graph-max-bs" not in a for a in sg)
    assert all(a[a.index("--cuda-graph-max-bs") + 1] == "512" for a in sg_v1)
    # a plan file from before the sizes were fields prices its preset's
    old = v0.to_dict()
    for k in ("graph_batch", "graph_tokens"):
        del old["engine"][k]
    assert ServingPlan.from_dict(json.loads(json.dumps(old))).engine.graphs == (256, 0)
    bad = {**json.loads(EXAMPLE_PLAN), "engine": {"base": "vllm", "max_seqs": -3}}
    with pytest.raises(PlanError, match="plan: engine: .*max_seqs"):
        ServingPlan.from_dict(bad)


def test_parts_priced_from_another_parts_tables_are_named():
    assert unmeasured(device("H100")) is None and unmeasured(device("A100-80GB")) is None
    assert "no turing kernel tables" in unmeasured(device("RTX-2080Ti"))
    # a part with a GEMM table of its own borrows only its attention, and says both
    assert "no turing attention tables" in unmeasured(device("T4")) and "t4_deepbench" in unmeasured(device("T4"))
    assert "l40s" in unmeasured(device("L4"))
    notes = unmeasured_notes([device("T4"), device("T4"), device("H100")])
    assert len(notes) == 1 and notes[0].startswith("T4:")


def test_serve_simulate_and_plan_name_the_engine_and_unmeasured_parts(capsys):
    from flexmesh.cli import main

    rc = main(["serve", "simulate", "--cluster", "1xH100+1xT4", "--trace", "const:500:50", "--requests", "30",
               "--rate", "2", "--engine", "sglang"])
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert rc == 0 and "engine sglang (SGLang" in out and notes[0].startswith("note: T4: no turing attention tables")
    assert not any("H100" in line.split(":")[1] for line in notes)
    rc = main(["serve", "plan", "--cluster", "1xH100+2xL4", "--buckets", "500:50=1", "--budget", "20",
               "--no-simulate", "--engine", "vllm-v0"])
    out = capsys.readouterr().out
    assert rc == 0 and "engine vllm-v0 (vLLM V0" in out and "note: L4: no kernel tables of its own" in out
    # tensor-parallel replicas on a node no table measured: their all-reduces' pricing named, in the summary too;
    # tp 1 replicas of such a part, and tp replicas of a measured node, have none
    for replicas, named in (("2xtp2", True), ("4xtp1", False)):
        rc = main(["serve", "simulate", "--cluster", "4xL40S", "--replicas", replicas, "--trace", "const:500:50",
                   "--requests", "20", "--rate", "2", "--json"])
        doc = json.loads(capsys.readouterr().out)
        tp_notes = [n for n in doc["unmeasured"] if "all-reduces priced by NCCL's tuning model" in n]
        assert rc == 0 and len(tp_notes) == named, doc["unmeasured"]
        assert not named or "vllm's own all-reduce, not timed there" in tp_notes[0]
    rc = main(["serve", "simulate", "--cluster", "4xH100", "--replicas", "2xtp2", "--trace", "const:500:50",
               "--requests", "20", "--rate", "2", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["unmeasured"] == []


def test_a_part_without_bf16_serves_in_fp16_and_its_launch_says_so():
    d = json.loads(EXAMPLE_PLAN.replace('"2xH100+1xL4"', '"2xH100+2xT4"').replace('"device": "L4", "replicas": 1, '
                                                                                  '"tp": 1', '"device": "T4", '
                                                                                  '"replicas": 1, "tp": 2'))
    plan = ServingPlan.from_dict(d)
    fleet, _ = Fleet.from_plan(plan)  # priced: a bf16 model on T4 (no bf16 Tensor Cores) raised before
    out = fleet.run(with_arrivals(constant_lengths(300, 20), rate=2.0, n=10))
    assert len(out.records) == 10
    for engine in ("vllm", "sglang"):
        argv = {c.device: c.argv for c in launches(engine, plan, "/m")}
        assert argv["T4"][-2:] == ("--dtype", "half") and "--dtype" not in argv["H100-80GB"]


def test_the_older_vllms_kernel_rates_are_the_fit_to_vidurs_profiles():
    """vllm-v0's rates are what bench/vidur_layers fits to Vidur's published sarathi-serve profiles, redone here."""
    import numpy as np

    from bench import vidur_layers as v

    layer = v.fit_layer_rates(tuple(sorted(v.measured_operators())))
    fitted = v.fit_attention_rates(np.ones(len(v.measured_attention()["is_prefill"]), bool), layer).factors()
    preset = engine_spec("vllm-v0").rates.factors()
    assert preset == pytest.approx(fitted, abs=5e-4)
    # and they price it: the older engine's prefill is slower than the device layer's kernels
    hw = Hardware(parse_cluster("1xA100-80GB"))
    assert engine_spec("vllm-v0").iteration(MODEL, hw).split_s(0, 0, [(0, 2000)]) > \
        engine_spec("vllm").iteration(MODEL, hw).split_s(0, 0, [(0, 2000)]) * 1.1


def test_serve_engines_lists_every_preset_and_shows_a_descriptions_fields_with_their_sources(capsys, tmp_path,
                                                                                               monkeypatch):
    from flexmesh.cli import main

    monkeypatch.setenv("COLUMNS", "250")  # rows unwrapped, whatever the terminal

    assert main(["serve", "engines"]) == 0
    listed = capsys.readouterr().out
    for name, e in presets().items():
        assert re.search(rf"^. {re.escape(name)}\b.*{re.escape(e.title)}", listed, re.M), name
    assert main(["serve", "engines", "distserve"]) == 0
    shown = capsys.readouterr().out
    assert shown.splitlines()[0] == engine_spec("distserve").label()
    row = next(line for line in shown.splitlines() if line.startswith("│ max_batched_tokens"))
    assert "8192" in row and "--context-max-tokens-per-batch" in row
    # a file on a preset: its own value shows, the preset's source stays beside the fields it kept
    mine = tmp_path / "mine.toml"
    mine.write_text('base = "vllm-v0"\ncuda_graphs = false\ngraph_batch = 0\n')
    assert main(["serve", "engines", str(mine)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("mine (vLLM V0, Ray workers") and "no CUDA graphs" in shown.splitlines()[0]
    assert re.search(r"^│ rates .*gemm 0\.843", shown, re.M)
    assert main(["serve", "engines", "sarathi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown engine 'sarathi': give a preset (vllm, vllm-v0") and err.count("\n") == 1


def test_a_description_file_keeps_its_bases_sources_only_for_the_fields_it_keeps(tmp_path):
    e = EngineSpec.from_dict({"base": "vllm-v0", "name": "mine", "cuda_graphs": False, "prefill_first": False,
                              "sources": {"cuda_graphs": "run with --enforce-eager"}})
    cited = dict(e.sources)
    assert cited["cuda_graphs"] == "run with --enforce-eager"
    assert "scheduler" not in cited and "overhead" in cited  # the base's scheduler is not this one's
    assert cited["overhead"] == dict(engine_spec("vllm-v0").sources)["overhead"]
    for bad, said in (({"name": "x"}, "gives no field: set base = a preset"),
                      ({"base": "vllm", "name": 5}, "name and title are text"),
                      ({"base": "vllm", "sources": {"cuda_graph": "x"}}, "not fields: cuda_graph")):
        with pytest.raises(SpecError, match=said):
            EngineSpec.from_dict(bad, "engine file f.toml")
