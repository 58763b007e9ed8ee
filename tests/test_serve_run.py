"""A serving plan run here (its replicas as engines, its GPUs checked or mapped) and exported to vLLM and SGLang
(commands, the router's config, the engines' own parsers where importable)."""

from __future__ import annotations

import json
import sys

import pytest

from flexmesh.errors import ServeError, SpecError
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.serve.engine.local import plan_engines
from flexmesh.serve.engines import VLLM_KV_TRANSFER
from flexmesh.serve.export import EXAMPLE_PLAN, check_launches, launches, router_config, router_options
from flexmesh.serve.layout.plan import ServingPlan


def _plan(**change) -> ServingPlan:
    d = json.loads(EXAMPLE_PLAN)
    d.update(change)
    return ServingPlan.from_dict(d)


def _pd_plan() -> ServingPlan:
    d = json.loads(EXAMPLE_PLAN)
    d["cluster"] = "4xH100"
    d["groups"] = [{"model": 0, "group": 0, "device": "H100-80GB", "replicas": 1, "tp": 1, "role": "prefill",
                    "engine": {"max_seqs": 64, "max_batched_tokens": 4096}, "entry": [1.0]},
                   {"model": 0, "group": 0, "device": "H100-80GB", "replicas": 1, "tp": 2, "role": "decode",
                    "engine": {"max_seqs": 256, "max_batched_tokens": 1024, "kv_blocks": 5000}, "decode": [1.0]}]
    return ServingPlan.from_dict(d)


def test_a_plan_for_gpus_this_machine_lacks_is_one_line_or_mapped():
    plan, base = _plan(), EngineConfig(num_blocks=512)
    with pytest.raises(ServeError, match="needs 2 H100-80GB, 1 L4; this machine has no GPU: run it here") as e:
        plan_engines(plan, base, gpus=[])
    assert "\n" not in str(e.value)
    with pytest.raises(ServeError, match="this machine has 1 H100-80GB"):
        plan_engines(plan, base, gpus=["H100-80GB"])
    with pytest.raises(ServeError, match="15.0 GiB of weights"):
        plan_engines(plan, base, map_to_cpu=True)
    local = plan_engines(plan, base, "tiny", map_to_cpu=True)
    assert [c.device for c in local.configs] == ["cpu", "cpu"] and {c.model for c in local.configs} == {"tiny"}
    assert [c.max_requests_per_batch for c in local.configs] == [256, 64] == list(local.max_running)
    assert [c.max_batch_tokens for c in local.configs] == [2048, 1024]
    assert [c.block_sharing for c in local.configs] == [True, False] and local.configs[0].num_blocks == 512
    assert any("--map-to-cpu" in n for n in local.notes) and local.table.entry == ((0.8, 0.2),)


def test_a_plan_runs_on_the_gpus_it_names():
    one = json.loads(EXAMPLE_PLAN)
    one["groups"][0]["tp"] = 1
    plan = ServingPlan.from_dict(one)
    local = plan_engines(plan, EngineConfig(), "tiny", gpus=["L4", "H100-80GB", "H100-80GB"])
    assert [c.device for c in local.configs] == ["cuda:1", "cuda:0"]
    with pytest.raises(ServeError, match="span 2 devices"):
        plan_engines(_plan(), EngineConfig(), "tiny", gpus=["H100-80GB"] * 2 + ["L4"])


def test_what_transformers_engines_cannot_be_is_one_line():
    with pytest.raises(ServeError, match="decode and prefill replicas; transformers engines serve aggregated"):
        plan_engines(_pd_plan(), EngineConfig(), "tiny", map_to_cpu=True)


def test_vllm_and_sglang_commands_carry_the_plans_knobs():
    plan = _pd_plan()
    v = launches("vllm", plan, "/m", base_port=9000)
    assert [x.port for x in v] == [9000, 9001] and [x.role for x in v] == ["decode", "prefill"]  # widest first
    def value(x, flag):
        return x.argv[x.argv.index(flag) + 1]

    assert value(v[0], "--tensor-parallel-size") == "2" and value(v[0], "--max-num-seqs") == "256"
    assert value(v[0], "--num-gpu-blocks-override") == "5000" and v[0].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert json.loads(v[0].argv[v[0].argv.index("--kv-transfer-config") + 1]) == VLLM_KV_TRANSFER
    assert "--kv-transfer-config" in v[1].argv and v[1].env["CUDA_VISIBLE_DEVICES"] == "2"
    s = launches("sglang", plan, "/m")
    assert s[1].argv[s[1].argv.index("--disaggregation-mode") + 1] == "prefill"
    assert s[0].argv[s[0].argv.index("--max-total-tokens") + 1] == str(5000 * 16)
    assert s[1].argv[s[1].argv.index("--chunked-prefill-size") + 1] == "4096"
    opts = router_options(router_config(plan, v))
    assert opts["route"] == "plan" and opts["max_running"] == [256, 64] and opts["urls"][0].endswith(":9000")
    assert opts["table"].decode == ((1.0, 0.0),) and opts["table"].entry == ((0.0, 1.0),)
    with pytest.raises(SpecError, match="several models"):
        launches("vllm", _plan(models=["llama3.1-8b", "llama3.1-70b"], cascade=None), "/m")


def test_the_engines_parsers_check_the_commands_or_say_they_did_not():
    plan = _plan()
    said = check_launches("sglang", launches("sglang", plan, "/m"), sys.executable)
    try:
        import sglang  # noqa: F401
        assert said.startswith("checked by SGLang")
    except ModuleNotFoundError:
        assert said == f"not checked (sglang is not importable by {sys.executable})"
    bad = check_launches("vllm", launches("vllm", plan, "/m"), "/nonexistent/python")
    assert bad.startswith("not checked (/nonexistent/python")


BENCH = ["bench", "--engines", "1", "--requests", "4", "--rate", "2"]


@pytest.mark.parametrize("argv,says", [
    (["run", "--engines", "1", "--host", ""], "host '' is empty"),
    (["run", "--engines", "1", "--host", "no.such.host.invalid"], "give an address of this machine"),
    ([*BENCH, "--engines", "2", "--route", "weights", "--weights", "1,2,3"], "one finite weight >= 0 per engine (2"),
    ([*BENCH, "--profile", "no-such-profile.json"], "no-such-profile.json"),
    ([*BENCH, "--context", "1"], "a context of 1 tokens"),
    (["bench", "--requests", "4", "--rate", "2", "--backend", "http://127.0.0.1:1"], "no engine answers at http://127.0.0.1:1"),
])
def test_what_a_fleet_cannot_be_is_refused_before_any_engine_starts(tmp_path, monkeypatch, argv, says):
    pytest.importorskip("aiohttp")
    from helpers import flexmesh_here

    import flexmesh.serve.engine.processes as processes

    def started(*a, **k):  # noqa: ANN002, ANN003
        raise AssertionError("an engine was started")

    monkeypatch.setattr(processes, "running_fleet", started)
    monkeypatch.setattr(processes, "serve_fleet", started)
    monkeypatch.chdir(tmp_path)
    r = flexmesh_here("serve", *argv, "--model", "tiny")
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_router_config_still_holding_the_export_placeholder_is_one_line(tmp_path):
    from flexmesh.cli import build_parser
    from flexmesh.commands.serve_run import resolve_fleet

    config = {"kind": "flexmesh router", "version": 1, "model": "tiny", "route": "plan", "queue": "fcfs",
              "engines": [{"url": "http://HOST-OF-NODE-0:8100", "replica": 0, "node": 0, "device": "H100-80GB",
                           "role": "aggregated", "max_running": 64}],
              "table": {"prompt_edges": [], "output_edges": [], "entry": [[1.0]], "decode": [], "policy": "weights"}}
    (tmp_path / "router.json").write_text(json.dumps(config))  # as serve export writes it, before it is filled in
    args = build_parser().parse_args(["serve", "run", "--router-config", str(tmp_path / "router.json")])
    with pytest.raises(ServeError, match="replace HOST-OF-NODE-N with that node's address"):
        resolve_fleet(args)
