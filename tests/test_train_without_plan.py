"""`flexmesh train` without --plan: the run plans for the devices it trains on (a CPU by its saved profile,
measured once when there is none), within --tp/--pp/--cp/--zero, writes the plan beside the run and resumes on
it; --tokens-per-step counts a step in tokens."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from flexmesh.commands import train as train_command
from flexmesh.commands.train_plan import check_flags, plan_run
from flexmesh.errors import PlanError
from flexmesh.profile.use import local_profile

# The package that stands in for the standard library as `--corpus stdlib` in a run here: the name resolves as
# ever (flexmesh.data.corpus.stdlib_corpus, its files: tests/test_corpus.py), on some thirty real files whose
# BPE and tokens take a second, where the whole library's take tens of CPU-seconds.
STDLIB_STAND_IN = "email"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["train", "--max-steps", "1", "--out", "OUT", *argv])


@pytest.fixture
def profiled(tmp_path, monkeypatch):
    """This machine's saved hardware profile (a synthetic 2-process CPU), in a cache of the test's own."""
    from test_profile import hardware_profile

    monkeypatch.setenv("FLEXMESH_CACHE", str(tmp_path / "cache"))
    path = local_profile("hardware")
    path.parent.mkdir(parents=True)
    hardware_profile().save(path)
    return path


def test_a_cpu_run_plans_on_the_machines_profile_within_the_flags(profiled):
    got = plan_run(_args("--model", "tiny", "--nproc", "2", "--device", "cpu"))
    assert got.plan.cluster == "2xlocal" and got.plan.world_size == 2 and got.plan.model == "tiny"
    assert str(profiled) in got.how and got.plan.layout in got.how
    for flags, want in ((("--tp", "2"), lambda s: s.tp == 2), (("--zero", "3"), lambda s: s.zero == 3),
                        (("--cp", "1", "--zero", "0"), lambda s: s.cp == 1 and s.zero == 0)):
        plan = plan_run(_args("--model", "tiny", "--nproc", "2", "--device", "cpu", *flags)).plan
        assert all(want(s) for s in plan.layer_strategies()), (flags, plan.layout)


def test_a_preset_cluster_and_a_step_in_tokens(profiled):
    got = plan_run(_args("--model", "llama3-8b", "--cluster", "8xH100", "--seq-len", "8192", "--tokens-per-step",
                         "1048576"))
    assert got.plan.world_size == 8 and got.plan.global_batch == 128  # 2^20 tokens as 8192-token documents
    assert "1,048,576 tokens per step" in got.how
    with pytest.raises(PlanError, match="no plan of llama3-70b fits on 1xH100-80GB"):
        plan_run(_args("--model", "llama3-70b", "--cluster", "1xH100", "--seq-len", "8192"))


def test_a_batch_the_constrained_layouts_cannot_split_names_the_nearest(profiled):
    """--tp 1 --pp 1 --cp 1 on 8 devices leaves dp 8, which splits no 1,953 documents: the error is the batch's
    (the model fits many times over), with the nearest count that splits, not memory."""
    flags = ("--model", "tiny", "--cluster", "8xA100-80GB", "--nproc", "8", "--tp", "1", "--pp", "1", "--cp", "1",
             "--seq-len", "512")
    with pytest.raises(PlanError) as refused:
        plan_run(_args(*flags, "--global-batch", "1953"))
    said = str(refused.value)
    assert said.startswith("global batch 1953 divides over no data-parallel degree that 8 devices leave for tiny")
    assert said.endswith("try --global-batch 1952") and "memory" not in said and "GiB" not in said
    assert plan_run(_args(*flags, "--global-batch", "1952")).plan.global_batch == 1952


def test_planning_flags_beside_a_plan_are_one_line():
    for flag in (("--tp", "2"), ("--pp", "2"), ("--zero", "1"), ("--cluster", "8xH100")):
        with pytest.raises(PlanError, match=f"{flag[0]} constrains the plan a run makes without --plan"):
            check_flags(_args("--plan", "p.json", *flag))
    with pytest.raises(SystemExit):  # argparse: documents or tokens per step, not both
        _args("--global-batch", "4", "--tokens-per-step", "4096")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_without_a_plan_writes_its_plan_and_resumes_on_it(profiled, tmp_path, capsys):
    out = tmp_path / "run"
    base = ["train", "--model", "tiny", "--corpus", "stdlib", "--out", str(out), "--no-progress", "--seq-len", "256",
            "--tokens-per-step", "1024", "--cache-dir", str(tmp_path / "cache")]
    _train_alone(*base, "--max-steps", "2", "--checkpoint-every", "2")
    assert "planned for 1 CPU process" in " ".join(capsys.readouterr().err.split())
    plan = json.loads((out / "plan.json").read_text())
    assert plan["cluster"] == "1xlocal" and plan["seq_len"] == 256
    _train_alone(*base, "--max-steps", "3")  # the same command, one step further: a resume
    assert "resuming on the plan this run chose" in " ".join(capsys.readouterr().err.split())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(512 < r["tokens"] <= 1024 for r in rows)  # whole documents up to 256 tokens until 1,024


def _train_alone(*argv: str) -> None:
    """`flexmesh *argv` succeeds in a plain process, no launcher's variables (a run without --plan plans in its own
    launcher), forked from the fork server (torch imported once) with this process's environment, `--corpus
    stdlib` the standard library's STDLIB_STAND_IN package; what it printed is printed here."""
    from helpers import spawn

    spawn(_main, (list(argv), dict(os.environ)), 1)


def _main(rank: int, argv: list[str], env: dict[str, str]) -> None:
    from flexmesh.cli import main
    from flexmesh.data import corpus

    os.environ.clear()
    os.environ.update(env)
    stand_in = corpus.read_corpus(corpus.stdlib_corpus_dir() / STDLIB_STAND_IN, extensions=(".py",))
    corpus.stdlib_corpus = lambda: stand_in  # this forked process's own module
    code = main(argv)
    assert code == 0, f"flexmesh {' '.join(argv)}: exit {code}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_weights_train_under_the_tokenizer_beside_them(tmp_path):
    """An export's weights, fine-tuned without --tokenizer: the run encodes with the export's tokenizer (the ids
    transformers' tokenizer of the export gives), never a BPE trained on the new corpus; weights with no
    tokenizer beside them are one line."""
    transformers = pytest.importorskip("transformers")
    from helpers import flexmesh_here, flexmesh_ranks, write_inputs

    from flexmesh.data.tokenizer import load_tokenizer

    config, corpus, plan = write_inputs(tmp_path, world=1)
    first = tmp_path / "first"
    # the trainings in one process each from the fork server (torch imported once), the export (nothing trains or
    # launches) and the refusal in this one
    r = flexmesh_ranks(1, "train", "--plan", str(plan), "--corpus", str(corpus), "--max-steps", "1", "--out",
                       str(first), "--cache-dir", str(tmp_path / "cache"), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    export = tmp_path / "export"
    exported = flexmesh_here("export", "--checkpoint", str(first), "--out", str(export))
    assert exported.returncode == 0, exported.stderr[-3000:]
    other = tmp_path / "other"  # another corpus: a BPE trained on it would differ
    other.mkdir()
    for i in range(12):
        (other / f"d{i}.txt").write_text(f"zebra quokka {i} " * (20 + i))
    tuned = tmp_path / "tuned"
    r = flexmesh_ranks(1, "train", "--plan", str(plan), "--corpus", str(other), "--weights", str(export),
                       "--max-steps", "1", "--out", str(tuned), "--cache-dir", str(tmp_path / "cache"), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the one beside --weights" in " ".join(r.stderr.split())
    text = "zebra quokka 7 the quick brown fox"
    want = transformers.AutoTokenizer.from_pretrained(export)(text)["input_ids"]
    assert load_tokenizer(tuned / "tokenizer").encode(text, add_special_tokens=False).ids == want
    (export / "tokenizer.json").unlink()
    r = flexmesh_here("train", "--plan", str(plan), "--corpus", str(other), "--weights", str(export),
                      "--max-steps", "1", "--out", str(tmp_path / "refused"), "--cache-dir", str(tmp_path / "cache"))
    assert r.returncode == 2 and "no tokenizer.json beside it" in r.stderr and "Traceback" not in r.stderr


def test_the_default_dtype_follows_the_device(monkeypatch):
    """bf16 where the ranks compute on GPUs (as torchtitan), fp32 on the CPU; --dtype always wins."""
    from flexmesh.commands.train_args import run_dtype
    from flexmesh.runtime.parallel import device as D

    for gpus, nproc, want in ((0, 2, "fp32"), (2, 2, "bf16"), (4, None, "bf16")):
        monkeypatch.setattr(D, "visible_gpus", lambda g=gpus: g)
        argv = ["--nproc", str(nproc)] if nproc else []
        assert run_dtype(_args(*argv)) == want, (gpus, nproc)
        assert run_dtype(_args(*argv, "--dtype", "fp32")) == "fp32"
        assert run_dtype(_args(*argv, "--device", "cpu")) == "fp32"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cpu_without_a_profile_is_measured_once_and_kept(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setenv("FLEXMESH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    got = plan_run(_args("--model", "tiny", "--device", "cpu"))
    assert local_profile("hardware").is_file() and got.plan.cluster == "1xlocal"
    assert not any((tmp_path / "tmp").iterdir())  # the profile's own --out copy is not left behind
