"""The engines' twin: each request reaches its engine the profiled admission delay after the router received it,
its record keeping the router's arrival."""

import pytest

from flexmesh.cost.inference.timing import EngineLoop
from flexmesh.data.requests import Request, Workload, constant_lengths, with_arrivals
from flexmesh.errors import SpecError
from flexmesh.profile.iteration import TERMS, EngineProfile, ProfiledIterationTiming
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.serve.engine.twin import twin_fleet

CFG = EngineConfig(num_blocks=256, page_size=16, max_batch_tokens=64, max_requests_per_batch=8)


def times(records) -> list[float]:
    """Each record's first-token and finish times, in order (flat: ``pytest.approx`` compares no nested lists)."""
    return [t for r in records for t in (r.first_token_s, r.finish_s)]


class Flat:
    """Every iteration 10 ms."""

    def iteration_s(self, batch):
        return 0.01


def test_admission_delays_every_arrival_and_keeps_the_routers_arrival():
    work = with_arrivals(constant_lengths(32, 6), rate=3.0, n=12)
    plain = twin_fleet(CFG, 2, Flat()).run(work).records
    late = twin_fleet(CFG, 2, Flat(), admission_s=0.003).run(work).records
    # exact: the records carry the requests' arrival times
    assert [r.arrival_s for r in late] == [r.arrival_s for r in plain] == [r.arrival_s for r in work.requests]
    for a, b in zip(plain, late):
        assert b.ttft_s == pytest.approx(a.ttft_s + 0.003)  # idle engines: the delay, no more
        assert b.tpot_s == pytest.approx(a.tpot_s)


def test_on_a_busy_engine_the_delay_moves_every_iteration_alike():
    # one engine: r0 decodes in 10 ms iterations; r1 reaches the router at 9 ms and joins the one after
    work = Workload((Request(0, 0.0, 16, 8), Request(1, 0.009, 16, 2)), "two")
    for d in (0.0, 0.0005, 0.002):
        r0, r1 = twin_fleet(CFG, 1, Flat(), admission_s=d).run(work).records
        assert (r0.first_token_s, r0.finish_s) == pytest.approx((0.01 + d, 0.08 + d))
        assert (r1.arrival_s, r1.first_token_s, r1.finish_s) == pytest.approx((0.009, 0.02 + d, 0.03 + d))


class ColdFlat(Flat):
    """10 ms, and 15 ms for the first iteration after 2 ms or more idle (an engine profile's ``after_idle``)."""

    loop = EngineLoop(after_idle=0.5, idle_gap_s=0.002)


def test_the_first_iteration_after_idling_costs_after_idle_more_and_the_ones_that_follow_do_not():
    # one engine: r0 alone from idle; r1 joins while r0 decodes (no idle between); r2 after both finished
    work = Workload((Request(0, 0.0, 16, 4), Request(1, 0.012, 16, 2), Request(2, 0.5, 16, 3)), "three")
    plain = twin_fleet(CFG, 1, Flat()).run(work).records
    cold = twin_fleet(CFG, 1, ColdFlat()).run(work).records
    r0, r1, r2 = cold
    assert (r0.first_token_s, r0.finish_s) == pytest.approx((0.015, 0.045))  # 15 ms, then three of 10 ms
    assert (r1.first_token_s, r1.finish_s) == pytest.approx((0.025, 0.035))  # joined a running engine: 10 ms each
    assert (r2.first_token_s, r2.finish_s) == pytest.approx((0.515, 0.535))  # idle again since 45 ms
    assert [p.first_token_s + 0.005 for p in plain[::2]] == pytest.approx([r0.first_token_s, r2.first_token_s])
    # a gap shorter than idle_gap_s is back to back: 1 ms after r0 ends, r3 starts at the plain price
    short = Workload((Request(0, 0.0, 16, 1), Request(3, 0.0160, 16, 1)), "short")
    a, b = twin_fleet(CFG, 1, ColdFlat()).run(short).records
    assert a.first_token_s == pytest.approx(0.015) and b.first_token_s - b.arrival_s == pytest.approx(0.01)


def test_the_twin_takes_the_profiles_admission_and_refuses_a_negative_one():
    fit = dict(zip(TERMS, (1e-3, 0.0, 0.0, 0.0, 0.0, 0.0)))
    timing = ProfiledIterationTiming(EngineProfile({}, {}, fit, admission_s=0.0015))
    assert timing.loop.admission_s == 0.0015
    assert twin_fleet(CFG, 2, timing).admission_s == 0.0015
    assert twin_fleet(CFG, 2, timing, admission_s=0.0).admission_s == 0.0  # given: it wins
    assert twin_fleet(CFG, 2, Flat()).admission_s == 0.0  # a timing without one: none
    with pytest.raises(SpecError, match="admission_s") as e:
        twin_fleet(CFG, 2, Flat(), admission_s=-0.001)
    assert "\n" not in str(e.value)


class Chatty(Flat):
    """10 ms, and a busy engine's HTTP thread: 2 ms per request taken in, 1 ms per request answered."""

    loop = EngineLoop(intake_s=0.002, answer_s=0.001)


def test_requests_reaching_or_leaving_a_busy_engine_lengthen_its_next_iteration_and_lapse_when_it_idles():
    # one engine: r0 from idle (no intake); r1 reaches it busy at 12 ms, its 2 ms on the iteration from 20 ms that
    # prefills it; r1 answered at 32 ms, its 1 ms on r0's last decode; r0's answer lapses as the engine idles
    work = Workload((Request(0, 0.0, 16, 4), Request(1, 0.012, 16, 1), Request(2, 0.5, 16, 2)), "three")
    r0, r1, r2 = twin_fleet(CFG, 1, Chatty()).run(work).records
    assert (r0.first_token_s, r0.finish_s) == pytest.approx((0.010, 0.043))
    assert (r1.first_token_s, r1.finish_s) == pytest.approx((0.032, 0.032))
    assert (r2.first_token_s, r2.finish_s) == pytest.approx((0.51, 0.52))
    plain = twin_fleet(CFG, 1, Flat()).run(work).records
    assert times(plain) == pytest.approx([0.01, 0.04, 0.03, 0.03, 0.51, 0.52])


def test_the_twin_takes_the_profiles_request_costs():
    fit = dict(zip(TERMS, (1e-2, 0.0, 0.0, 0.0, 0.0, 0.0)))
    timing = ProfiledIterationTiming(EngineProfile({}, {}, fit, intake_s=0.002, answer_s=0.001))
    work = Workload((Request(0, 0.0, 16, 4), Request(1, 0.012, 16, 1)), "two")
    got = twin_fleet(CFG, 1, timing).run(work).records
    want = twin_fleet(CFG, 1, Chatty()).run(work).records
    assert times(got) == pytest.approx(times(want))


class Hosted(Flat):
    """10 ms, on a host of 2 cores whose router's process takes 3 ms a request, 0.1 ms a prompt token and 0.2 ms an
    output token."""

    host_cores, host_request_s, host_token_s, host_output_s = 2, 0.003, 0.0001, 0.0002


def test_the_router_process_takes_the_engines_cores_only_while_they_fill_every_core():
    # two engines, round robin: r0 on engine 0 and r1 on engine 1 decode 8 tokens each in 10 ms iterations; r2 reaches
    # engine 0 at 12 ms while both iterate (the host's 2 cores taken): its 3 ms and 16 prompt tokens' 1.6 ms lengthen
    # engine 0's iteration from 20 ms; r2's 2 output tokens answered at 44.6 ms while engine 1 still iterates: 0.4 ms
    # on engine 0's next iteration
    work = Workload((Request(0, 0.0, 16, 8), Request(1, 0.001, 16, 8), Request(2, 0.012, 16, 2)), "three")
    plain = twin_fleet(CFG, 2, Flat()).run(work).records
    hosted = twin_fleet(CFG, 2, Hosted()).run(work).records
    assert times(plain) == pytest.approx([0.01, 0.08, 0.011, 0.081, 0.03, 0.04])
    r0, r1, r2 = hosted
    assert (r2.first_token_s, r2.finish_s) == pytest.approx((0.0346, 0.0446))
    assert r0.finish_s == pytest.approx(0.0850)
    assert (r1.first_token_s, r1.finish_s) == pytest.approx((0.011, 0.081))  # its own requests met a free core

    class Roomy(Hosted):
        host_cores = 3  # a core to spare beside the two engines: the router's process takes none of theirs

    roomy = twin_fleet(CFG, 2, Roomy()).run(work).records
    assert times(roomy) == pytest.approx(times(plain))
    one = Workload((Request(0, 0.0, 16, 8), Request(2, 0.012, 16, 2)), "two")  # one engine busy of two: no charge
    assert (times(twin_fleet(CFG, 2, Hosted()).run(one).records)
            == pytest.approx(times(twin_fleet(CFG, 2, Flat()).run(one).records)))


def test_the_twin_takes_the_profiles_host():
    fit = dict(zip(TERMS, (1e-2, 0.0, 0.0, 0.0, 0.0, 0.0)))
    timing = ProfiledIterationTiming(EngineProfile({}, {}, fit, host_cores=2, host_request_s=0.003,
                                                   host_token_s=0.0001, host_output_s=0.0002))
    work = Workload((Request(0, 0.0, 16, 8), Request(1, 0.001, 16, 8), Request(2, 0.012, 16, 2)), "three")
    got = twin_fleet(CFG, 2, timing).run(work).records
    want = twin_fleet(CFG, 2, Hosted()).run(work).records
    assert times(got) == pytest.approx(times(want))
    assert got[2].first_token_s > twin_fleet(CFG, 2, Flat()).run(work).records[2].first_token_s


def test_a_profile_from_before_output_tokens_were_told_apart_charges_them_its_one_token_cost():
    fit = dict(zip(TERMS, (1e-2, 0.0, 0.0, 0.0, 0.0, 0.0)))
    d = EngineProfile({}, {}, fit, host_cores=2, host_request_s=0.003, host_token_s=0.0001).to_dict()
    del d["host_output_s"]
    assert EngineProfile.from_dict(d).host_output_s == 0.0001
    d["host_output_s"] = 0.0002
    assert EngineProfile.from_dict(d).host_output_s == 0.0002
