"""One vocabulary across the commands: the same flag for the same concept, old spellings still read,
every flag with help, an example per command that parses, and `flexmesh --version`."""

from __future__ import annotations

import argparse
import shlex

import pytest

from flexmesh.cli import COMMANDS, EXAMPLES, build_parser, main


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_flag_has_help_no_empty_default_and_the_examples_parse(name, capsys):
    p = _commands()[name]
    undocumented = [a.option_strings[0] for a in p._actions if a.option_strings and not a.help]
    assert undocumented == []
    text = p.format_help()
    assert "(default: None)" not in text and "examples:" in text
    for line in EXAMPLES[name]:
        words = shlex.split(line)
        argv = words[words.index("flexmesh") + 1:] if words[0] != "flexmesh" else words[1:]
        assert argv[0] == name
        build_parser().parse_args(argv)  # argparse exits (SystemExit) on a flag it does not know


def test_the_shared_concepts_have_one_flag_and_old_spellings_are_hidden_aliases(capsys):
    cmds = _commands()
    for name in ("plan", "simulate", "train", "demo"):
        assert "--seq-len" in _flags(cmds[name]), name
    for name in ("plan", "simulate", "train"):
        assert "--slow" in _flags(cmds[name]), name
    hidden = {"simulate": ("--context", "--speed"), "train": ("--max-len", "--emulate-speed"), "demo": ("--max-len",)}
    for name, olds in hidden.items():
        text = cmds[name].format_help()
        for old in olds:
            assert old in _flags(cmds[name]) and old not in text, (name, old)
    parse = build_parser().parse_args
    base = ["train", "--plan", "p.json", "--corpus", "c", "--max-steps", "1", "--out", "o"]
    new, old = parse([*base, "--seq-len", "64", "--slow", "1=0.5"]), parse([*base, "--max-len", "64",
                                                                                "--emulate-speed", "1=0.5"])
    assert (new.seq_len, new.emulate_speed) == (old.seq_len, old.emulate_speed) == (64, [(1, 0.5)])
    assert parse(["simulate", "--context", "512"]).seq_len == parse(["simulate", "--seq-len", "512"]).seq_len == 512
    assert parse(["simulate", "--speed", "3=0.5"]).slow == parse(["simulate", "--slow", "3=0.5"]).slow == [(3, 0.5)]


def test_simulate_and_plan_share_their_defaults(capsys):
    from flexmesh.commands.args import DEFAULT_GLOBAL_BATCH, DEFAULT_MODEL, DEFAULT_SEQ_LEN

    plan = build_parser().parse_args(["plan"])
    assert plan.model is None and plan.seq_len == DEFAULT_SEQ_LEN  # no --model: DEFAULT_MODEL, or --check's plan's
    assert main(["simulate", "--steps", "1", "--json", "--policies", "hdp"]) == 0  # no --model, --cluster needed
    import json

    setup = json.loads(capsys.readouterr().out)["setup"]
    assert (setup["model"], setup["context"], setup["mean_sequences_per_step"]) == (DEFAULT_MODEL, DEFAULT_SEQ_LEN,
                                                                                    DEFAULT_GLOBAL_BATCH)


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("flexmesh ")


def test_plan_for_the_runtime_prices_only_the_overlap_it_runs(tmp_path, capsys, no_recommendation):
    import json

    from flexmesh.layout.overlap import RUNTIME
    from flexmesh.layout.plan import load_plan

    steps = {}
    for overlap in ("search", "runtime"):
        out = tmp_path / f"{overlap}.json"
        assert main(["plan", "--model", "llama2-13b", "--cluster", "8x8xA100-40GB", "--seq-len", "8192", "--top", "1",
                     "--overlap", overlap, "--out", str(out), "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        steps[overlap] = result["best"]["step_time_s"]
        plan = load_plan(out)
        if overlap == "runtime":  # the plan and every baseline it was ranked against
            assert plan.overlap == RUNTIME
            assert all(b is None or b["step_time_s"] >= steps[overlap] for b in result["baselines"].values())
        assert result["workload"]["global_batch"] == 128  # the shared default (flexmesh.commands.args)
    assert steps["search"] < steps["runtime"]  # TP overlap hides communication the runtime exposes
