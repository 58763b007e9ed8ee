"""Engine profiles: the fit recovers known terms, prices a batch and its split form alike, refuses malformed
files in one line; ``flexmesh profile engine --quick`` measures a real engine and writes a profile whose
timing prices the batches it measured."""

import json
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmesh.cost.inference.timing import SplitTiming, split_s
from flexmesh.errors import ProfileError
from flexmesh.profile.engine import SERVING, idle_admissions, refit, scenarios, serving_lengths
from flexmesh.profile.host import HOST_REPLAYS, host_costs_from
from flexmesh.profile.iteration import (
    IDLE_GAP_S,
    REQUEST_GROUP,
    TERMS,
    EngineProfile,
    ProfiledIterationTiming,
    after_idle_from,
    fit_iterations,
    iteration_features,
    load_engine_profile,
    price_runs,
    request_costs_from,
)
from flexmesh.profile.samples import read_iteration_samples
from flexmesh.serve.engine.config import EngineConfig

TRUE = dict(zip(TERMS, (2e-3, 5e-5, 3e-5, 4e-8, 2e-10, 1e-8)))


def seconds(batch):
    return sum(TRUE[t] * f for t, f in zip(TERMS, iteration_features(batch)))


def test_fit_recovers_the_terms_of_prefill_decode_and_mixed_batches():
    batches = ([[(0, n)] for n in (8, 64, 256)] + [[(256 * k, 256)] for k in (1, 3)]
               + [[(c, 1)] * b for b in (1, 4, 16, 64) for c in (16, 512)] + [[(100, 1)] * 8 + [(0, 200)]])
    fit = fit_iterations([(b, seconds(b)) for b in batches])
    assert all(fit[t] == pytest.approx(TRUE[t], rel=1e-6) for t in TERMS)
    prof = EngineProfile({}, {}, fit, samples=[(b, seconds(b)) for b in batches])
    assert prof.error["max"] < 1e-6


def test_fit_needs_enough_batches():
    with pytest.raises(ProfileError, match="cannot fit 6 terms"):
        fit_iterations([([(0, 8)], 1e-3)] * 3)


batch = st.lists(st.tuples(st.integers(0, 4000), st.integers(1, 300)), min_size=0, max_size=12)


@settings(max_examples=60, deadline=None)
@given(decodes=st.lists(st.integers(0, 4000), max_size=40), chunks=batch)
def test_split_form_prices_the_batch_it_stands_for(decodes, chunks):
    timing = ProfiledIterationTiming(EngineProfile({}, {}, TRUE))
    assert isinstance(timing, SplitTiming)  # the simulator's constant-time path
    full = [(c, 1) for c in decodes] + chunks
    assert split_s(timing, len(decodes), sum(decodes), chunks) == pytest.approx(timing.iteration_s(full), rel=1e-12)
    assert timing.iteration_s(full) >= (TRUE["c0_s"] if full else 0.0)


@settings(max_examples=60, deadline=None)
@given(decodes=st.integers(1, 64), context=st.integers(0, 100_000), steps=st.integers(1, 50))
def test_a_run_of_decodes_costs_its_iterations_one_by_one(decodes, context, steps):
    timing = ProfiledIterationTiming(EngineProfile({}, {}, TRUE))
    one_by_one = sum(timing.split_s(decodes, context + decodes * j, ()) for j in range(steps))
    assert timing.decode_run_s(decodes, context, steps) == pytest.approx(one_by_one, rel=1e-9)


def test_profile_round_trips_and_refuses_malformed_files(tmp_path):
    prof = EngineProfile({"name": "tiny"}, {"model": "tiny"}, TRUE, samples=[([(0, 8)], 1e-3)], name="p",
                         admission_s=0.0016, after_idle=0.2, intake_s=0.0015, answer_s=0.0005, host_cores=2,
                         host_request_s=0.0022, host_token_s=1e-5)
    path = tmp_path / "engine.json"
    prof.save(path)
    back = load_engine_profile(path)
    assert back.fit == TRUE and back.samples == [([(0, 8)], 1e-3)] and back.name == "engine.json"
    loop = ProfiledIterationTiming(back).loop
    assert back.admission_s == 0.0016 and loop.admission_s == 0.0016
    assert back.after_idle == 0.2 and loop.after_idle == 0.2
    assert (loop.intake_s, loop.answer_s) == (0.0015, 0.0005)
    t = ProfiledIterationTiming(back)
    assert (t.host_cores, t.host_request_s, t.host_token_s) == (2, 0.0022, 1e-5)
    older = {k: v for k, v in prof.to_dict().items()
             if k not in ("admission_s", "after_idle", "intake_s", "answer_s", "host_cores", "host_request_s",
                          "host_token_s")}  # before measured
    path.write_text(json.dumps(older))
    old = load_engine_profile(path)
    assert (old.admission_s, old.after_idle, old.intake_s, old.answer_s) == (0.0, 0.0, 0.0, 0.0)
    assert (old.host_cores, old.host_request_s, old.host_token_s) == (0, 0.0, 0.0)
    bad = tmp_path / "bad.json"
    for d, match in (({**prof.to_dict(), "kind": "model"}, "not an engine profile"),
                     ({**prof.to_dict(), "admission_s": -1e-3}, "admission_s"),
                     ({**prof.to_dict(), "admission_s": "2 ms"}, "admission_s"),
                     ({**prof.to_dict(), "after_idle": -0.1}, "after_idle"),
                     ({**prof.to_dict(), "after_idle": True}, "after_idle"),
                     ({**prof.to_dict(), "intake_s": -1e-3}, "intake_s"),
                     ({**prof.to_dict(), "answer_s": "1 ms"}, "answer_s"),
                     ({**prof.to_dict(), "host_cores": 2.5}, "host_cores"),
                     ({**prof.to_dict(), "host_cores": True}, "host_cores"),
                     ({**prof.to_dict(), "host_cores": -1}, "host_cores"),
                     ({**prof.to_dict(), "host_request_s": -1e-3}, "host_request_s"),
                     ({**prof.to_dict(), "host_token_s": "0.01 ms"}, "host_token_s"),
                     ({**prof.to_dict(), "version": 9}, "version 9"),
                     ({**prof.to_dict(), "fit": {**TRUE, "c0_s": -1}}, "non-negative"),
                     ({**prof.to_dict(), "samples": [{"batch": 3}]}, "malformed samples")):
        bad.write_text(json.dumps(d))
        with pytest.raises(ProfileError, match=match) as e:
            load_engine_profile(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ProfileError, match="flexmesh profile engine"):
        load_engine_profile(tmp_path / "none.json")


def test_after_idle_is_what_the_first_iterations_after_a_gap_cost_beyond_the_rest():
    timing = ProfiledIterationTiming(EngineProfile({}, {}, TRUE))

    def run(t0, batches, cold):
        """Back-to-back iterations from t0, the first ``cold`` times its price, the rest at their price x 0.9 (a fit
        that is 10% high everywhere: the ratio of medians cancels it)."""
        out, t = [], t0
        for k, b in enumerate(batches):
            s = timing.iteration_s(b) * (cold if k == 0 else 0.9) * 0.9 ** (k == 0)
            out.append({"batch": [list(x) for x in b], "start_s": t, "end_s": t + s, "cpu_s": s})
            t += s
        return out

    batches = [[(0, 64)], [(64, 1)], [(65, 1)], [(66, 1), (0, 30)], [(67, 1), (30, 1)]]
    engine = [it for k in range(6) for it in run(1.0 * k, batches, 1.3)]  # idle 1 s between runs
    assert after_idle_from([engine], timing) == pytest.approx(0.3)
    assert after_idle_from([engine, run(0.0, batches, 1.5)], timing) == pytest.approx(0.3)  # medians over engines
    assert after_idle_from([run(0.0, batches, 0.8)], timing) == 0.0  # no slower after idling: nothing
    assert after_idle_from([[]], timing) == 0.0
    # a gap shorter than IDLE_GAP_S is not idling: these runs follow one another at once, all "rest"
    tight = run(0.0, batches, 1.3)
    joined = tight + run(tight[-1]["end_s"] + IDLE_GAP_S / 2, batches, 1.3)
    assert after_idle_from([joined], timing) == pytest.approx(0.3)  # only the very first counts as after idle


def test_request_costs_are_what_the_engines_other_threads_spend_per_request_taken_in_and_answered():
    def its(n, taken, answered, background=3e-5, jitter=0.0):
        """n iterations whose other threads had the background, 1.2 ms per request taken in, 0.4 ms per answer."""
        return [{"batch": [[64, 1]], "taken": taken, "answered": answered,
                 "others_cpu_s": background + 1.2e-3 * taken + 4e-4 * answered + jitter * (-1) ** k}
                for k in range(n)]

    mixed = its(200, 0, 0) + its(30, 1, 0) + its(30, 0, 1) + its(10, 2, 1) + its(6, 5, 0)
    assert request_costs_from(mixed) == pytest.approx((1.2e-3, 4e-4))
    assert request_costs_from([{**it, "others_cpu_s": it["others_cpu_s"] + 1e-3 * (k % 2 - 0.5)}
                               for k, it in enumerate(mixed)]) == pytest.approx((1.2e-3, 4e-4), rel=0.1)  # noisy
    # too few iterations of a kind: that cost is 0; engines that count nothing (an older log): both 0
    assert request_costs_from(its(200, 0, 0) + its(30, 1, 0) + its(5, 0, 1)) == pytest.approx((1.2e-3, 0.0), abs=2e-5)
    assert request_costs_from([{k: v for k, v in it.items() if k != "others_cpu_s"} for it in mixed]) == (0.0, 0.0)
    cheaper = its(200, 0, 0, background=2e-3) + its(30, 1, 0)  # taking one in "saves" 0.8 ms: never below 0
    assert request_costs_from(cheaper) == (0.0, 0.0)
    # the iterations' price carries them, per request counted
    timing = ProfiledIterationTiming(EngineProfile({}, {}, TRUE, intake_s=1.5e-3, answer_s=0.5e-3))
    run = [{"batch": [[64, 1]], "start_s": 0.01 * k, "end_s": 0.01 * k + 0.005, "taken": k, "answered": 1}
           for k in range(3)]
    assert price_runs([run], timing) == pytest.approx([timing.iteration_s([(64, 1)]) + 1.5e-3 * k + 0.5e-3
                                                        for k in range(3)])


def test_host_costs_split_the_router_process_cpu_into_a_request_its_prompt_tokens_and_its_output_tokens():
    def replay(n, prompt, outputs, request_s=2.2e-3, token_s=1e-6, output_s=2e-4):
        return (n, prompt, outputs, n * request_s + prompt * token_s + outputs * output_s)

    # the host's replays (short requests, long answers, long prompts) beside serving replays tell the three apart
    rows = [replay(16, 16 * p, 16 * o) for p, o in HOST_REPLAYS] + [replay(60, 6000, 1100)]
    assert host_costs_from(rows) == pytest.approx((2.2e-3, 1e-6, 2e-4))
    # every replay with one output length per request: the request's cost holds its output tokens' too
    assert host_costs_from([replay(20, 100, 20), replay(40, 800, 40)]) == pytest.approx((2.4e-3, 1e-6, 0.0))
    # a replay that answered nothing says nothing; none at all: no cost; never below 0
    assert host_costs_from([(0, 0, 0, 0.1), replay(10, 10, 10)]) == pytest.approx((2.401e-3, 0.0, 0.0))
    assert host_costs_from([]) == (0.0, 0.0, 0.0)
    assert min(host_costs_from([(10, 10, 10, 0.03), (10, 500, 10, 0.02), (10, 10, 300, 0.01)])) >= 0.0


def test_price_runs_charges_the_router_process_only_where_the_engines_filled_the_hosts_cores():
    timing = ProfiledIterationTiming(EngineProfile({}, {}, TRUE, host_cores=2, host_request_s=2e-3))
    alone = ProfiledIterationTiming(EngineProfile({}, {}, TRUE))
    a = [{"batch": [[64, 1]], "start_s": 0.0, "end_s": 0.01, "taken": 1},
         {"batch": [[64, 1]], "start_s": 0.01, "end_s": 0.02, "taken": 2}]
    b = [{"batch": [[64, 1]], "start_s": 0.005, "end_s": 0.03, "taken": 1}]  # engine 1 iterates from 5 ms
    base = price_runs([a, b], alone)
    # a's second iteration and b's start while the other engine iterates: 2 ms per request taken in
    assert price_runs([a, b], timing) == pytest.approx([base[0], base[1] + 4e-3, base[2] + 2e-3])
    assert price_runs([a], timing) == pytest.approx(price_runs([a], alone))  # one engine: a core to spare


def _served(its, phase):
    return [{**it, "phase": phase} for it in its]


def test_request_costs_come_from_the_serving_phase_where_requests_arrive_one_at_a_time():
    def its(n, taken, answered, each_in=1.2e-3, each_out=4e-4):
        return [{"batch": [[64, 1]], "taken": taken, "answered": answered,
                 "others_cpu_s": 3e-5 + each_in * taken + each_out * answered} for _ in range(n)]

    serving = _served(its(200, 0, 0) + its(30, 1, 0) + its(30, 0, 1) + its(5, 1, 1), "serving")
    # a sweep's bursts: tens of requests taken in (and answered) by one iteration, at a fifth of the cost each
    bursts = _served(its(100, 0, 0) + its(25, 40, 0, each_in=2.4e-4) + its(25, 0, 16, each_out=8e-5), "sweep")
    assert request_costs_from(serving + bursts) == pytest.approx((1.2e-3, 4e-4))
    both = request_costs_from([{k: v for k, v in it.items() if k != "phase"} for it in serving + bursts])
    assert both[0] < 0.5e-3 and both[1] < 0.2e-3  # fitted together, the bursts pull both costs down
    # a serving phase that counted too few answers: the sweep's are used for both rather than none
    thin = _served(its(200, 0, 0) + its(30, 1, 0) + its(REQUEST_GROUP - 1, 0, 1), "serving")
    assert request_costs_from(thin + bursts)[1] > 0
    assert request_costs_from(thin)[1] == 0.0


def test_after_idle_comes_from_the_serving_phase_where_it_woke_often_enough():
    timing = ProfiledIterationTiming(EngineProfile({}, {}, TRUE))

    def run(t0, batches, cold, phase):
        out, t = [], t0
        for k, b in enumerate(batches):
            s = timing.iteration_s(b) * (cold if k == 0 else 1.0)
            out.append({"batch": [list(x) for x in b], "start_s": t, "end_s": t + s, "cpu_s": s, "phase": phase})
            t += s
        return out

    decodes = [[(64, 1)], [(65, 1)], [(66, 1)]]
    sweep = [it for k in range(30) for it in run(1.0 * k, [[(0, 200)] * 4] + decodes, 0.9, "sweep")]
    serving = [it for k in range(REQUEST_GROUP) for it in run(100.0 + k, [[(0, 50)]] + decodes, 1.2, "serving")]
    assert after_idle_from([sweep + serving], timing) == pytest.approx(0.2)
    # fewer serving wake-ups than REQUEST_GROUP: every iteration counts, the sweep's too
    few = serving[:4 * (REQUEST_GROUP - 1)]
    assert after_idle_from([sweep + few], timing) < 0.2


def test_refit_measures_a_profiles_constants_again_from_its_samples():
    def line(k, batch, cpu, phase="serving", **more):
        return {"engine": k % 2, "phase": phase, "batch": [list(b) for b in batch], "start_s": 0.02 * k,
                "end_s": 0.02 * k + cpu * 1.25, "wall_s": cpu * 1.25, "cpu_s": cpu, "taken": 0, "answered": 0,
                "others_cpu_s": 1e-5, **more}

    batches = ([[(0, t)] for t in (16, 64, 256)] + [[(c, 1)] * b for b in (1, 8, 32) for c in (64, 512)]
               + [[(0, 200), (300, 1)], [(256, 256)] * 2, [(256, 128)]])
    raw = [line(k, b, seconds(b), "sweep") for k, b in enumerate(batches * 3)]
    raw += [line(100 + k, [(64, 1)], seconds([(64, 1)]), taken=k % 2, others_cpu_s=1e-5 + 7e-4 * (k % 2))
            for k in range(2 * REQUEST_GROUP)]
    old = EngineProfile({"name": "tiny"}, {"num_blocks": 64}, dict(TRUE), admission_s=1.5e-3, intake_s=0.2e-3,
                        produced_by={"processes": 2, "sweep": {"scenarios": ["prefill 16"], "cpu_share": 0.5}})
    new = refit(old, raw)
    assert [t for t in TERMS if new.fit[t] != pytest.approx(TRUE[t], rel=1e-3, abs=1e-12)] == []
    assert len(new.samples) == len(batches) and new.intake_s == pytest.approx(7e-4)
    assert (new.model, new.engine, new.admission_s) == (old.model, old.engine, old.admission_s)  # not in the samples
    sweep = new.produced_by["sweep"]
    assert sweep["scenarios"] == ["prefill 16"] and sweep["iterations"] == len(raw)
    # the serving phase ran one batch, too few to fit: only the sweep's fit is held against the other phase
    assert sweep["cpu_share"] == pytest.approx(0.8) and set(sweep["held_out"]) == {"sweep->serving"}
    assert old.produced_by["sweep"]["cpu_share"] == 0.5  # the profile refitted is left as it was


def test_admissions_are_timed_for_the_serving_requests_that_found_their_engine_idle():
    from flexmesh.serve.metrics import RequestRecord

    def rec(rid, replica, arrival, prompt):
        return RequestRecord(rid, replica, arrival, arrival + 0.02, arrival + 0.05, prompt, 4)

    origin = 100.0
    engine0 = [{"start_s": 100.0011, "end_s": 100.01, "batch": [[0, 256]]},  # r0: 300 tokens, a 256 chunk first
               {"start_s": 100.01, "end_s": 100.02, "batch": [[256, 44]]},
               {"start_s": 100.02 + IDLE_GAP_S / 2, "end_s": 100.03, "batch": [[0, 9]]},  # r1: not idle (short gap)
               {"start_s": 100.5014, "end_s": 100.51, "batch": [[0, 12]]}]  # r3: 1.4 ms after it arrived
    engine1 = [{"start_s": 100.2009, "end_s": 100.21, "batch": [[0, 20]]}]  # r2 asked for 30: not its chunk
    records = [rec(0, 0, 0.0, 300), rec(1, 0, 0.0195, 9), rec(2, 1, 0.2, 30), rec(3, 0, 0.5, 12),
               rec(4, 1, 0.9, 5)]  # r4: no iteration after it
    waits = idle_admissions(records, origin, [engine0, engine1], 256)
    assert waits == pytest.approx([0.0011, 0.0014])


def test_sweep_stays_inside_the_engine():
    cfg = EngineConfig(num_blocks=512, page_size=16, max_batch_tokens=128, max_requests_per_batch=16)
    room = cfg.kv_tokens * (1 - cfg.safety_margin)
    plan = scenarios(cfg, quick=False, max_position=4096)
    assert {name.split()[0] for name, _, _ in plan} == {"prefill", "decode", "mixed"}
    for name, prompts, outputs in plan:
        assert len(prompts) <= cfg.max_requests_per_batch, name
        assert sum(p + o for p, o in zip(prompts, outputs)) <= room, name
        if name.startswith("decode"):  # every request still decodes once the last prompt is in
            assert outputs[0] > -(-sum(prompts) // cfg.max_batch_tokens), name


@pytest.mark.parametrize("quick", [True, False])
def test_serving_requests_stay_inside_the_engine_and_repeat(quick):
    cfg = EngineConfig(num_blocks=256, page_size=16, max_batch_tokens=64, max_requests_per_batch=16)
    lengths = serving_lengths(cfg, quick, max_position=1024)
    assert len(lengths) == SERVING[quick]["requests"] and lengths == serving_lengths(cfg, quick, 1024)
    assert all(p + o <= cfg.kv_tokens // 4 and p >= 8 and o >= 1 for p, o in lengths)
    assert len({p for p, _ in lengths}) > len(lengths) // 2  # spread, not one length
    assert max(p for p, _ in lengths) > cfg.max_batch_tokens  # some prompts take several chunks
    short = serving_lengths(cfg, quick, max_position=100)  # a model of few positions bounds them
    assert all(p + o <= 100 for p, o in short)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_profile_engine_quick_writes_a_profile_that_prices_what_it_measured(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("aiohttp")
    from flexmesh.cli import main

    out, raw = tmp_path / "engine.json", tmp_path / "samples.jsonl"
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["profile", "engine", "--quick", "--no-progress", "--kv-blocks", "256", "--max-batch-tokens", "64",
                 "--out", str(out), "--samples", str(raw)]) == 0
    printed = capsys.readouterr().out
    assert "per-iteration overhead" in printed and "in-sample error" in printed
    prof = load_engine_profile(out)
    assert prof.engine["num_blocks"] == 256 and prof.model["name"] == "tiny"
    assert prof.produced_by["sweep"]["quick"] and len(prof.samples) >= 20
    assert prof.produced_by["processes"] == 2  # two engines swept side by side (the default, as serve run's)
    served = prof.produced_by["sweep"]["serving"]
    assert [s["load"] for s in served] == list(SERVING[True]["loads"]) and all(s["rate"] > 0 for s in served)
    assert served[0]["requests"] == SERVING[True]["requests"]
    # the router's hop into an engine's batch: timed on idle engines, more than nothing and less than a second
    assert prof.produced_by["sweep"]["admissions"] >= 2 and 0 < prof.admission_s < 1.0
    assert "admission" in printed and "after an engine idled" in printed and prof.after_idle >= 0
    held = prof.produced_by["sweep"]["held_out"]  # the form fitted on one phase, priced against the other
    assert set(held) == {"sweep->serving", "serving->sweep"} and all(h["busy"] > 0 for h in held.values())
    assert "held out (sweep fit, priced against the serving iterations)" in printed
    kinds = {("decode" if all(q == 1 for _, q in b) else "prefill" if len(b) == 1 else "mixed")
             for b, _ in prof.samples}
    assert kinds == {"decode", "prefill", "mixed"}
    timing = ProfiledIterationTiming(prof)
    assert timing.overhead_s > 0
    # the fit follows what it was fitted to (loose: the machine is shared; the bench reports the real error)
    assert prof.error["median"] < 0.5
    # every iteration as measured: both phases, both engines, and the medians the profile holds are theirs
    its = read_iteration_samples(raw)
    assert len(its) == prof.produced_by["sweep"]["iterations"]
    assert {s.phase for s in its} == {"sweep", "serving"} and {s.engine for s in its} == {0, 1}
    assert all(s.wall_s > 0 and s.cpu_s > 0 for s in its)
    # serving behind the router: the engines took requests in and answered them while they iterated, and the
    # profile prices what that costs them (0 where too few iterations did it alone)
    assert sum(s.taken for s in its if s.phase == "serving") > 0 and sum(s.answered for s in its) > 0
    assert 0 <= prof.intake_s < 0.05 and 0 <= prof.answer_s < 0.05 and "per request taken in" in printed
    # the router's and the client's process: measured, a few ms a request at most, on this process's cores
    assert prof.host_cores >= 1 and 0 < prof.host_request_s + 100 * prof.host_token_s + 10 * prof.host_output_s < 0.05
    assert len(prof.produced_by["sweep"]["host"]) == len(prof.produced_by["sweep"]["serving"]) + len(HOST_REPLAYS)
    assert "per output token" in printed
    first = prof.samples[0]
    # exact: a median is one sample or the same two samples' mean
    assert first[1] == statistics.median(s.cpu_s for s in its if sorted(s.batch) == sorted(first[0]))
    # the fit prices more work higher: the batch with the most new tokens against the lone decode with the least
    # context (not the measured extremes: one noisy single decode can be the slowest sample on a shared machine)
    big = max(prof.samples, key=lambda s: (sum(q for _, q in s[0]), len(s[0])))
    small = min((s for s in prof.samples if len(s[0]) == 1 and s[0][0][1] == 1), key=lambda s: s[0][0][0])
    assert sum(q for _, q in big[0]) > 8 and big[1] > small[1]
    assert timing.iteration_s(big[0]) > timing.iteration_s(small[0])
