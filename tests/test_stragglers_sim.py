"""Simulated stragglers (flexmesh.sim.stragglers) and `flexmesh simulate`'s static comparison."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from flexmesh.cli import main
from flexmesh.cost import CostModel
from flexmesh.data.lengths import BatchSampler, load_lengths
from flexmesh.errors import ScheduleError
from flexmesh.sim.stragglers import device_speeds, straggler_context, straggler_run
from flexmesh.spec import parse_cluster, parse_model


@pytest.fixture(scope="module")
def cost():
    return CostModel(parse_model("llama2-7b"), parse_cluster("2x8xA100-80GB"))


@pytest.fixture(scope="module")
def batches():
    return list(itertools.islice(BatchSampler(load_lengths("wikipedia"), 0, tokens_per_batch=300_000,
                                              max_len=4096), 2))


def test_nominal_speeds_give_the_same_plan_three_ways(cost, batches):
    r = straggler_run(cost, batches, {}, tp=2)
    assert r.static_seconds == pytest.approx(r.replanned_seconds) == pytest.approx(r.nominal_seconds)
    assert r.capacity_seconds <= r.replanned_seconds
    assert r.capacity_seconds == pytest.approx(r.device_bound_seconds)


@pytest.mark.parametrize("factor", [0.5, 0.25])
def test_replanning_recovers_most_of_the_remaining_speed(cost, batches, factor):
    r = straggler_run(cost, batches, {5: factor}, tp=2)
    # Device 5 slows data rank 2 (devices 4 and 5) to `factor`; the others keep nominal speed.
    assert r.data_rank_speeds == tuple(factor if d == 2 else 1.0 for d in range(8))
    # Blind schedules give the slow rank a full share: the step waits about 1 / factor as long.
    assert r.static_tokens_per_s < 1.2 * factor * r.nominal_tokens_per_s
    assert r.replanned_tokens_per_s > 1.5 * r.static_tokens_per_s
    assert r.replanned_tokens_per_s <= r.capacity_tokens_per_s * (1 + 1e-9)
    assert r.replanned_tokens_per_s >= 0.9 * r.capacity_tokens_per_s
    # The slow device's fast tensor-parallel peer is idle capacity only a new layout could use.
    assert r.device_bound_tokens_per_s >= r.capacity_tokens_per_s * (1 - 1e-9)


def test_a_slow_stage_slows_its_pipeline(cost, batches):
    nominal = straggler_context(cost, tp=2, pp=2, zero=1, lockstep=False, microbatch_tokens=8192)
    r = straggler_run(cost, batches, {13: 0.5}, nominal=nominal)
    # Devices 8..15 are stage 1; device 13 is in data rank (13 - 8) // 2 = 2 of 4.
    assert r.data_rank_speeds == (1.0, 1.0, 0.5, 1.0)
    assert r.replanned_tokens_per_s > r.static_tokens_per_s


def test_device_speeds_are_checked():
    assert device_speeds(3, {2: 0.5}) == (1.0, 1.0, 0.5)
    with pytest.raises(ScheduleError, match="do not exist"):
        device_speeds(4, {4: 0.5})
    with pytest.raises(ScheduleError, match="positive"):
        device_speeds(4, {1: 0.0})


def _simulate_json(capsys, *extra):
    assert main(["simulate", "--model", "llama2-7b", "--cluster", "1x8xA100-80GB", "--context", "4096",
                 "--tokens-per-batch", "100000", "--steps", "2", "--tp", "2", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_with_slow_devices_compares_with_static_schedules(capsys):
    plain = _simulate_json(capsys)
    assert all(p["static_tokens_per_s"] is None for p in plain["policies"])
    slow = _simulate_json(capsys, "--speed", "1=0.25")
    for p in slow["policies"]:
        # Told the speeds, every policy beats its own blind schedules on the same batches.
        assert p["tokens_per_s"] > 1.5 * p["static_tokens_per_s"], p["label"]
        assert p["static_tokens_per_s"] < p["tokens_per_s"]


def test_simulate_table_shows_the_static_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["simulate", "--model", "llama2-7b", "--cluster", "1x8xA100-80GB", "--context", "4096",
                 "--tokens-per-batch", "100000", "--steps", "1", "--tp", "2", "--slow", "1=0.5"]) == 0
    out = capsys.readouterr().out
    assert "static tokens/s" in out and "vs static" in out and "schedules made for nominal speed" in out
    rows = [line for line in out.splitlines() if line.startswith("│ hdp")]
    assert len(rows) == 1 and float(rows[0].split("│")[-2].strip().rstrip("x")) > 1.2
    assert np.isfinite(float(rows[0].split("│")[4].strip().replace(",", "")))
