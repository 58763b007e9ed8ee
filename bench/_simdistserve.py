"""Runs DistServe's simulator (simdistserve, Apache-2.0, github.com/LLMServe/DistServe) on a request list, for
:mod:`bench.serve_peer`. This file runs in simdistserve's own environment (simpy, pandas; never flexmesh's), as

    PYTHONPATH=<DistServe checkout> <its python> bench/_simdistserve.py IN.json OUT.json

IN: ``{"requests": [{"id", "arrival_s", "prompt_tokens", "output_tokens"}], "instances", "tp",
"prefill_max_tokens", "decode_max_tokens", "chunked_prefill", "profile", "ray_overhead"}``. ``profile`` is
null for the A100 profile simdistserve ships (its vLLM fit of OPT-13B), else coefficients in its own format
(``prefill``, ``decoding_smallbs``, ``decoding_largebs``: [a, b, c] in ms; ``decoding_large_small_bs_threshold``).
OUT: ``[{"id", "arrival_s", "first_token_s", "finish_s"}]``, times in seconds.

Two things are set from outside simdistserve's own options, each said where it is done: a fitted profile is
put where its estimator looks up OPT-13B's (it keys its profiles by OPT model names and reads them from its
package), and ``ray_overhead: false`` turns off the per-iteration Ray RPC delay its workers add (2 ms plus
1e-4 ms per context token, a constant of DistServe's GPU deployment) when the profile already holds the
engine's whole iteration.
"""

from __future__ import annotations

import json
import random
import sys


def simulate(spec: dict) -> list[dict]:
    import simpy
    from simdistserve.base.request import Request
    from simdistserve.base.scheduler import put_requests_with_interarrivals
    from simdistserve.base.worker import Worker, WorkerConfig
    from simdistserve.clusters.vllm import VLLMCluster
    from simdistserve.constants import ModelTypes
    from simdistserve.estimators import time_estimator

    random.seed(0)  # its chunk ids are drawn from random
    model = ModelTypes.opt_13b
    if spec.get("profile") is not None:  # the estimator reads this module global at each call
        time_estimator.vllm_profile_data = {ModelTypes.formalize_model_name(model): {str(spec["tp"]): spec["profile"]}}
    if not spec.get("ray_overhead", True):
        Worker.add_ray_overhead = lambda self, sum_of_tokens: 0.0
    env = simpy.Environment()
    tp = spec["tp"]
    cfg = WorkerConfig(model_type=model, TP=tp, TP_Prefill=tp, TP_Decode=tp, prefill_max_batch_size=10 ** 7,
                       decode_max_batch_size=10 ** 7, prefill_max_tokens=spec["prefill_max_tokens"],
                       decode_max_tokens=spec["decode_max_tokens"], enable_chunked_prefill=spec["chunked_prefill"],
                       engine_type="vllm")
    cluster = VLLMCluster(env=env, N_instance=spec["instances"], PP=1, worker_configs=cfg)
    cluster.run()
    reqs = spec["requests"]
    # simdistserve counts decode steps after the prefill's token: output_lens = tokens - 1 makes the same total
    sim = [Request(env=env, req_id=r["id"], prefill_length=r["prompt_tokens"], output_lens=r["output_tokens"] - 1)
           for r in reqs]
    arrivals_ms = [r["arrival_s"] * 1e3 for r in reqs]
    gaps = [arrivals_ms[0]] + [b - a for a, b in zip(arrivals_ms, arrivals_ms[1:])]
    put_requests_with_interarrivals(env, cluster.scheduler, gaps, sim)
    env.run()
    out = []
    for r, q in zip(reqs, sim):
        first = min(t for t, ev, _ in q.log if ev == "wait_decode")
        finish = max(t for t, ev, _ in q.log if ev == "exit_system")
        out.append({"id": r["id"], "arrival_s": r["arrival_s"], "first_token_s": first / 1e3,
                    "finish_s": finish / 1e3})
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = simulate(json.load(f))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
