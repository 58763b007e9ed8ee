"""bench/serve_peer.py: DistServe's cost form fitted to an engine profile, the verdict of which simulator is
nearer, and (optional: marker ``simdistserve``) the driver that runs DistServe's simulator on flexmesh's
requests.

simdistserve runs from its own environment: a DistServe checkout (github.com/LLMServe/DistServe, Apache-2.0)
at ``$FLEXMESH_SIMDISTSERVE`` and a python with simpy and pandas at ``$FLEXMESH_SIMDISTSERVE_PYTHON``
(defaults under .venvs/simdistserve/)::

    python -m venv .venvs/simdistserve/venv && .venvs/simdistserve/venv/bin/pip install simpy pandas
    git clone https://github.com/LLMServe/DistServe .venvs/simdistserve/src
    git -C .venvs/simdistserve/src rev-parse HEAD > .venvs/simdistserve/src/COMMIT   # named in the record

Without them those tests are skipped.
"""

from __future__ import annotations

import pytest

from bench.serve_peer import distserve_profile, fit_abc, nearer, run_simdistserve, simdistserve_paths
from flexmesh.data.requests import Request, Workload

peer = pytest.mark.skipif(simdistserve_paths() is None,
                          reason="no simdistserve (set FLEXMESH_SIMDISTSERVE and FLEXMESH_SIMDISTSERVE_PYTHON)")


def _samples():
    """Batches priced exactly by DistServe's form: prefill 3 + 0.02 t + 1e-5 sum(q^2), decode 4 + 1e-3 ctx + 0.05 bs
    (ms), and mixed batches that its fit must leave out."""
    out = []
    for chunks in ([64], [128], [256], [64, 64], [100, 30, 20], [200, 50]):
        ms = 3 + 0.02 * sum(chunks) + 1e-5 * sum(q * q for q in chunks)
        out.append(([(0, q) for q in chunks], ms / 1e3))
    for bs, ctx in ((1, 100), (4, 500), (16, 300), (64, 1000), (8, 2000)):
        ms = 4 + 1e-3 * bs * (ctx + 1) + 0.05 * bs
        out.append(([(ctx, 1)] * bs, ms / 1e3))
    out.append(([(0, 100), (500, 1)], 1.0))  # mixed: no row of either fit
    return out


def test_distserve_form_recovers_the_costs_it_was_made_from():
    prof = distserve_profile(_samples())
    assert prof["prefill"] == pytest.approx([3, 0.02, 1e-5], rel=1e-6)
    assert prof["decoding_smallbs"] == pytest.approx([4, 1e-3, 0.05], rel=1e-6)
    # no decode batch above the threshold was profiled: the one fit serves both ranges
    assert prof["decoding_largebs"] == prof["decoding_smallbs"]  # exact: one fit serves both ranges


def test_distserve_form_needs_prefill_and_decode_batches():
    decodes_only = [s for s in _samples() if all(q == 1 for _, q in s[0])]
    with pytest.raises(SystemExit, match="0 prefill-only"):
        distserve_profile(decodes_only)


def test_fit_weighs_relative_error():
    # 1 + 2x exactly, and one large row 50% above it: weighed by relative error, the small rows stay near their
    # times (absolute least squares would price x = 1 at 1.49, half its 3)
    rows = [(x, 0.0, 1 + 2 * x) for x in (1, 2, 3, 4)] + [(100, 0.0, 300.0)]
    a, b, _ = fit_abc(rows)
    assert a + b * 1 == pytest.approx(3, rel=0.1)
    assert a + b * 100 < 300


def test_nearer_is_relative_to_the_measurement():
    assert nearer(0.1, 0.12, 0.07) == "flexmesh"
    assert nearer(0.1, 0.13, 0.09) == "simdistserve"
    assert nearer(0.1, 0.105, 0.095) == "tie"


FLAT = {"decoding_large_small_bs_threshold": 95, "prefill": [10.0, 0.0, 0.0], "decoding_smallbs": [5.0, 0.0, 0.0],
        "decoding_largebs": [5.0, 0.0, 0.0]}


def _spec(**kw):
    return {"instances": 1, "tp": 1, "prefill_max_tokens": 256, "decode_max_tokens": 256, "chunked_prefill": True,
            "profile": FLAT, "ray_overhead": False, **kw}


@pytest.mark.simdistserve
@peer
def test_simdistserve_prices_the_requests_as_given():
    # a prefill iteration 10 ms (and the 1 ms simdistserve adds to each, its pipeline constant at PP 1), a decode
    # iteration 5 ms: a 4-token output is 11 + 3 x 5 ms; a 300-token prompt takes two chunks of the 256-token
    # budget before its first token
    w = Workload((Request(0, 0.0, 100, 4), Request(1, 1.0, 300, 1)), "t")
    a, b = run_simdistserve(w, _spec(), simdistserve_paths())
    assert (a.ttft_s, a.e2e_s, a.tpot_s) == pytest.approx((0.011, 0.026, 0.005))
    assert (b.ttft_s, b.e2e_s, b.tpot_s) == (pytest.approx(0.022), pytest.approx(0.022), None)


@pytest.mark.simdistserve
@peer
def test_simdistserve_ray_delay_is_added_when_asked():
    w = Workload((Request(0, 0.0, 100, 2),), "t")
    off, = run_simdistserve(w, _spec(), simdistserve_paths())
    on, = run_simdistserve(w, _spec(ray_overhead=True), simdistserve_paths())
    # its Ray delay: 2 ms + 1e-4 ms per context token (its count before the iteration), each iteration: the
    # prefill of 100 tokens, then one decode over them
    assert on.e2e_s - off.e2e_s == pytest.approx(2 * (2 + 1e-4 * 100) / 1e3, rel=1e-6)
