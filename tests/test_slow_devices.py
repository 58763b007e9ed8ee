"""One vocabulary for slow devices: ``--slow RANK=FACTOR,...`` parsed by one function, with one help text, in
``plan``, ``simulate`` and ``train``, checked against the devices by one function; ``plan`` prices the slow
devices through the cost model (docs/cli.md#slow-devices)."""

from __future__ import annotations

import json

import pytest
from helpers import flexmesh_here

from flexmesh.cli import build_parser

SLOW = ["--slow", "1=0.5,3=0.25", "--slow", "2=1"]
PAIRS = [(1, 0.5), (3, 0.25), (2, 1.0)]
TRAIN = ["train", "--plan", "p.json", "--corpus", "c", "--max-steps", "1", "--out", "o"]
PLAN = ["plan", "--model", "tiny", "--cluster", "4xA100-80GB", "--seq-len", "2048", "--global-batch", "16"]


def _slow_action(command: str):
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return next(a for a in sub._actions if "--slow" in a.option_strings)


def test_the_same_string_means_the_same_in_plan_simulate_and_train():
    parse = build_parser().parse_args
    assert parse(["plan", *SLOW]).slow == parse(["simulate", *SLOW]).slow == PAIRS
    assert parse([*TRAIN, *SLOW]).emulate_speed == PAIRS
    actions = [_slow_action(c) for c in ("plan", "simulate", "train")]
    assert len({a.help for a in actions}) == 1 and len({a.type for a in actions}) == 1  # one text, one parser
    assert len({a.metavar for a in actions}) == 1


@pytest.mark.parametrize("command", [["plan"], ["simulate"], TRAIN])
@pytest.mark.parametrize("value", ["3=1.5", "3", "x=0.5", "3=0"])
def test_a_bad_value_is_one_line_naming_the_flag_with_exit_2(command, value):
    proc = flexmesh_here(*command, "--slow", value)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "argument --slow:" in errors[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", [PLAN, ["simulate", "--model", "tiny", "--cluster", "4xA100-80GB", "--steps", "1"],
                                     [*TRAIN, "--nproc", "4"]])
def test_a_device_outside_the_run_is_the_same_one_line_error_in_all_three(command):
    proc = flexmesh_here(*command, "--slow", "4=0.5")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error: --slow names rank 4, but there are ranks 0 to 3 (one per device); name one " \
                                  "of them"


def _plan(capsys, *flags: str) -> dict:
    from flexmesh.cli import main

    assert main([*PLAN, "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_gives_a_slow_device_less_work_and_predicts_a_slower_step(capsys):
    nominal, slowed = _plan(capsys), _plan(capsys, "--slow", "3=0.5")
    assert slowed["best"]["step_time_s"] > nominal["best"]["step_time_s"]
    shares = {tuple(g["ranks"]): g["share"] for g in slowed["best"]["plan"]["groups"]}
    slow_share = next(share for ranks, share in shares.items() if "3" in ranks)
    assert slow_share < max(shares.values())  # the half-speed device's group takes fewer sequences


def test_plan_with_every_device_slowed_prices_the_uniform_plan_at_that_speed(capsys):
    nominal, slowed = _plan(capsys), _plan(capsys, "--slow", "0=0.5,1=0.5,2=0.5,3=0.5")
    assert slowed["best"]["plan"]["cluster"] == nominal["best"]["plan"]["cluster"]  # one layout over all four
    assert slowed["best"]["step_time_s"] > nominal["best"]["step_time_s"]


@pytest.mark.parametrize(("flags", "words"), [
    (["--hardware-profile", "hw.json"], "--slow prices devices of different speeds from the cluster's device presets"),
    (["--check", "p.json"], "--check and --replicas do not search one"),
])
def test_plan_refuses_slow_where_it_cannot_price_it(flags, words):
    proc = flexmesh_here(*PLAN, "--slow", "1=0.5", *flags)
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1, proc.stderr
    assert words in " ".join(proc.stderr.split())


def test_plan_recommends_a_policy_for_one_group_planned_over_unequal_devices(capsys):
    from flexmesh.cli import main

    # a mildly slow device: the mixed search keeps one layout over all eight, which the recommendation prices as
    # `simulate --plan` does (it failed on a cost model only a one-type cluster has)
    cluster = ["--cluster", "2x4xA100-80GB", "--slow", "3=0.7"]
    assert main([*PLAN[:3], *cluster, *PLAN[5:], "--json", "--recommend"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["best"]["plan"]["groups"]) == 1
    assert out["recommendation"]["policy"]
