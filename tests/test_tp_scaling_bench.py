"""bench/tp_scaling.py: each all-reduce priced as Vidur ran it (an eager call) and as a CUDA graph replays it."""

from __future__ import annotations

import pytest

import bench.tp_scaling as tps
from flexmesh.cost.device.hardware import EAGER_FLOOR_OP
from flexmesh.spec.devices import COMM_TABLES


@pytest.mark.parametrize(("gpu", "kind"), list(tps.NODES))
def test_an_eager_call_costs_at_least_the_nodes_measured_floor(gpu, kind):
    system = tps.DEVICE_PRESETS[tps.PARTS[gpu]].comm_table if kind == "nvswitch" else ""
    for tp in (2, 4):
        for tokens in (8, 64, 4096):
            layer, ar = tps.predicted_layer(gpu, kind, "Llama-2-70b-hf", tp, tokens)
            eager_layer, eager_ar = tps.predicted_layer(gpu, kind, "Llama-2-70b-hf", tp, tokens, eager=True)
            assert eager_ar >= ar and eager_layer - layer == pytest.approx(eager_ar - ar, abs=1e-12)
            if not system:  # no table of an eager call on the bridged nodes: the kernel time
                assert eager_ar == ar  # exact: the same call
                continue
            floor = COMM_TABLES[system][EAGER_FLOOR_OP][tp][1][0]  # its smallest message's seconds
            assert eager_ar == pytest.approx(2 * max(ar / 2, floor), rel=1e-12)
    # decode-sized messages on an NVSwitch node sit under the floor; a long prefill's above it
    if system:
        small, big = (tps.predicted_layer(gpu, kind, "Llama-2-70b-hf", 4, t, eager=e)[1] for t, e in
                      ((8, True), (4096, True)))
        assert small > tps.predicted_layer(gpu, kind, "Llama-2-70b-hf", 4, 8)[1]
        assert big == tps.predicted_layer(gpu, kind, "Llama-2-70b-hf", 4, 4096)[1]  # exact: the kernel time wins


def test_every_row_is_scored_both_ways():
    cases = tps.cases()
    assert cases and all({"predicted", "eager", "measured"} <= set(c) for c in cases)
    assert all(c["eager"] <= c["predicted"] * (1 + 1e-12) for c in cases)  # a slower all-reduce: less speedup
