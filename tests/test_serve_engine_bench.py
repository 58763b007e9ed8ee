"""bench/serve_engine.py: the measured knee, the rates measured past the planned ones until it is crossed, a
figure over the passes, the iteration figures and what the machine allows them, and the figures re-priced from a
run's folder."""

from __future__ import annotations

import pytest

from bench.serve_engine import MORE_RATES, RATE_STEP, TWIN_RATES, knee, median_spread, next_rate, twin_knee
from flexmesh.cost.inference.timing import EngineLoop


def test_knee_is_read_between_the_rates_that_cross_it():
    assert knee([1.0, 2.0, 3.0], [0.1, 0.2, 0.7]) == pytest.approx(2.4)
    assert knee([1.0, 2.0, 3.0], [0.1, 0.2, 0.3]) is None


def _curve(rate: float, knee_at: float) -> float:
    """A p90 TTFT that stays flat below ``knee_at`` and grows tenfold past it."""
    return 0.05 if rate < knee_at else 0.05 * 10 * rate / knee_at


@pytest.mark.parametrize("knee_at", [12.0, 20.0, 35.0, 60.0])
def test_rates_grow_until_the_measured_knee_is_crossed_and_no_further(knee_at):
    planned = [4.0, 7.0, 10.0, 14.0]
    rates = list(planned)
    while (more := next_rate(rates, [_curve(r, knee_at) for r in rates], len(planned))) is not None:
        assert more == pytest.approx(rates[-1] * RATE_STEP, abs=0.01)
        rates.append(more)
    assert len(rates) - len(planned) <= MORE_RATES
    crossed = knee(rates, [_curve(r, knee_at) for r in rates])
    if knee_at <= planned[-1] * RATE_STEP ** MORE_RATES:  # reachable within the extra rates: found, and one past
        assert crossed is not None and rates[-2] < knee_at <= rates[-1]
    else:  # bounded: the extra rates are spent, the knee is not a number
        assert crossed is None and len(rates) - len(planned) == MORE_RATES


@pytest.mark.parametrize("knee_at", [12.0, 35.0, 60.0])
def test_the_twins_knee_is_found_past_the_rates_measured(knee_at):
    # the engine was measured at 4 to 14/s; the twin's knee is found wherever it lies within TWIN_RATES steps
    planned = [4.0, 7.0, 10.0, 14.0]
    asked = []

    def p90_at(rate: float) -> float:
        asked.append(rate)
        return _curve(rate, knee_at)

    found = twin_knee(planned, [_curve(r, knee_at) for r in planned], p90_at)
    exact = knee(planned, [_curve(r, knee_at) for r in planned])
    if exact is not None:  # crossed where measured: nothing more simulated, the same knee
        assert asked == [] and found == exact
    else:
        ran = planned + asked  # the twin ran on until the step that crossed its knee, and no further
        assert found is not None and 0 < len(asked) <= TWIN_RATES
        assert ran[-2] < knee_at <= ran[-1] and ran[-2] < found <= ran[-1]
        assert asked == [pytest.approx(ran[k - 1] * RATE_STEP, abs=0.01) for k in range(len(planned), len(ran))]
    assert twin_knee(planned, [0.05] * 4, lambda r: 0.05) is None  # a twin that never queues: bounded, no knee


def test_a_knee_crossed_by_the_planned_rates_adds_none():
    assert next_rate([4.0, 7.0, 10.0, 14.0], [0.05, 0.06, 0.3, 0.9], 4) is None


def test_a_figure_over_passes_is_their_median_and_its_spread_their_range_over_it():
    # one pass met the machine's slow speed: the median keeps the two that agree, the spread says how far it was
    assert median_spread([0.020, 0.031, 0.021]) == pytest.approx((0.021, 0.011 / 0.021))
    assert median_spread([0.05]) == (0.05, 0.0)
    assert median_spread([0.0, 0.0]) == (0.0, 0.0)


def _engine(speeds, price=0.005):
    """One engine's back-to-back decode iterations, each ``price`` seconds by the timing below times its speed."""
    out, t = [], 0.0
    for s in speeds:
        out.append({"batch": [[64, 1]], "start_s": t, "end_s": t + price * s, "cpu_s": price * s})
        t += price * s
    return out


class _Flat:
    """A timing that prices every batch at 5 ms, nothing after idling, no request or host costs."""

    loop = EngineLoop()
    host_cores, host_request_s = 0, 0.0

    def iteration_s(self, batch):
        return 0.005


def test_iteration_figures_tell_a_machine_of_two_speeds_from_a_wrong_price():
    from bench.serve_engine import RateRun, iteration_figures

    # spells of 40 iterations at 0.75x and 1.25x the price: every iteration a fifth or a third off, none off its spell
    spells = [0.75] * 40 + [1.25] * 40
    rotated = spells[40:] + spells * 2 + spells[:40]
    two = iteration_figures([[RateRun(1.0, [], [_engine(spells * 3), _engine(rotated)])]], _Flat())
    assert two["median"] == pytest.approx((0.2 + 1 / 3) / 2) and two["known_speed"] < 0.01
    assert two["speed_p10"] == pytest.approx(0.75) and two["speed_p90"] == pytest.approx(1.25)
    assert two["best_scale_median"] > 0.19  # as many iterations in each spell: no one factor brings it near 0
    # one speed, 1.2x the price: one factor after the fact would do, and the local speed knows it too
    slow = iteration_figures([[RateRun(1.0, [], [_engine([1.2] * 200)])], [RateRun(1.0, [], [_engine([1.2] * 50)])]],
                             _Flat())
    assert slow["median"] == pytest.approx(1 - 1 / 1.2)
    assert slow["best_scale"] == pytest.approx(1.2, rel=0.005) and slow["best_scale_median"] < 0.005
    assert slow["per_pass"] == pytest.approx([1 - 1 / 1.2] * 2) and slow["busy_measured"] == pytest.approx(1.5)
    # exact: decode is the median of the same figures
    assert slow["known_speed"] < 1e-9 and slow["decode"] == slow["median"]


def test_a_runs_kept_replays_read_back_by_pass_and_rate(tmp_path):
    from bench.serve_engine import RateRun, load_saved, save
    from flexmesh.serve.metrics import RequestRecord

    rec = RequestRecord(3, 1, arrival_s=0.5, first_token_s=0.6, finish_s=0.9, prompt_tokens=40, output_tokens=4)
    save(tmp_path, [[RateRun(12.5, [rec], [_engine([1.0] * 3), []]), RateRun(3.0, [], [[], []])]] * 2)
    (tmp_path / "iterations-7.json").write_text("[[], []]")  # an older run's single pass, unnumbered
    passes = load_saved(tmp_path)
    assert [[r.rate for r in runs] for runs in passes] == [[3.0, 7.0, 12.5], [3.0, 12.5]]
    assert passes[1][1].records == [rec] and passes[1][1].iterations[0][2]["end_s"] == pytest.approx(0.015)
    with pytest.raises(SystemExit, match="no iterations"):
        load_saved(tmp_path / "none")


def test_reprice_prints_the_three_figures_from_a_folder_without_an_engine(tmp_path, monkeypatch, capsys):
    from bench.serve_engine import RateRun, main, save
    from flexmesh.profile.iteration import TERMS, EngineProfile
    from flexmesh.serve.metrics import RequestRecord

    EngineProfile({}, {}, dict(zip(TERMS, (5e-3, 0, 0, 0, 0, 0))), samples=[([(64, 1)], 5e-3)] * 6).save(
        tmp_path / "engine-tiny.json")
    recs = [RequestRecord(i, i % 2, arrival_s=0.1 * i, first_token_s=0.1 * i + 0.02, finish_s=0.1 * i + 0.2,
                          prompt_tokens=64, output_tokens=5) for i in range(10)]
    save(tmp_path, [[RateRun(rate, recs, [_engine([1.1] * 30), _engine([0.9] * 30)]) for rate in (2.0, 5.0)]])
    monkeypatch.setattr("sys.argv", ["serve_engine", "--reprice", str(tmp_path), "--requests", "10"])
    assert main() == 0
    out = capsys.readouterr().out
    assert f"Re-priced offline from {tmp_path}" in out and "| 2 | 10 |" in out and "| 5 | 10 |" in out
    assert "120 engine iterations priced by the profile" in out and "busy time 0.6 s predicted / 0.6 s" in out
    monkeypatch.setattr("sys.argv", ["serve_engine", "--reprice", str(tmp_path), "--refit"])
    with pytest.raises(SystemExit, match="no samples.jsonl"):
        main()
