"""Sizes are bounded before any work: each absurd value is one line and exit code 2, at once, never an
allocation or a loop that runs until the machine gives up (flexmesh.spec.limits)."""

from __future__ import annotations

import gzip
import json
import re
import time

import pytest

from flexmesh.cli import main


@pytest.mark.parametrize("argv, said", [
    (["simulate", "--global-batch", "1000000000"], "argument --global-batch: must be at most 4,194,304"),
    (["simulate", "--tokens-per-batch", "99999999999999"], "argument --tokens-per-batch: must be at most"),
    (["simulate", "--steps", "100000000"], "argument --steps: must be at most"),
    (["plan", "--seq-len", "999999999999"], "argument --seq-len: must be at most"),
    (["plan", "--global-batch", "999999937"], "argument --global-batch: must be at most"),
    (["train", "--plan", "p", "--corpus", "c", "--out", "o", "--max-steps", "1", "--global-batch", "1e9"],
     "argument --global-batch"),
])
def test_absurd_flags_are_one_usage_line(argv, said, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["plan", "--model", "gpt:2147483000:64:4"], "num_layers 2147483000 is beyond flexmesh's bound"),
    (["plan", "--model", "gpt:4:64:4:2147483000"], "vocab 2147483000 is beyond flexmesh's bound"),
    (["plan", "--model", "tiny", "--cluster", "999999937xH100"], "devices 999999937 is beyond flexmesh's bound"),
    (["simulate", "--model", "gpt:2000000000:64:4"], "num_layers 2000000000 is beyond"),
])
def test_absurd_models_and_clusters_are_refused_at_once(argv, said, capsys):
    t0 = time.monotonic()
    assert main(argv) == 2
    assert said in " ".join(capsys.readouterr().err.split())
    assert time.monotonic() - t0 < 30  # before any search (a bound, not a benchmark: it was minutes or never)


def test_a_plan_file_cannot_name_a_billion_ranks(tmp_path, capsys):
    plan = {"version": 4, "model": "tiny", "cluster": "2xA100-80GB", "world_size": 2, "seq_len": 128,
            "global_batch": 2, "pipeline_schedule": "1f1b",
            "groups": [{"ranks": ["0-999999999999"], "share": 2,
                        "stages": [{"layers": [0, 4], "strategies": ["tp1-dp2z0"] * 4}]}]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    assert main(["plan", "--check", str(path), "--model", "tiny"]) == 2
    assert "is not a run of ranks" in " ".join(capsys.readouterr().err.split())


def test_a_small_length_file_that_expands_to_gigabytes_is_refused(tmp_path, capsys):
    bomb = tmp_path / "lengths.txt.gz"
    with gzip.open(bomb, "wb") as f:
        for _ in range(300):  # 300 MiB of "1\n", a few hundred KiB compressed
            f.write(b"1\n" * (1 << 19))
    assert bomb.stat().st_size < 2 << 20
    assert main(["simulate", "--model", "tiny", "--cluster", "2xA100-80GB", "--lengths", str(bomb)]) == 2
    assert "expands beyond" in " ".join(capsys.readouterr().err.split())


def test_divisors_of_a_large_prime_take_square_root_time():
    from flexmesh.search.space import divisors

    assert divisors(999_999_937) == [1, 999_999_937]
    assert divisors(720) == [d for d in range(1, 721) if 720 % d == 0]


@pytest.mark.parametrize("world", [1, 2])
def test_train_refuses_a_plan_that_needs_more_memory_than_the_machine_has(tmp_path, world):
    """The check prices the plan and model again: a hand-written plan for a 70 B model recording a
    small peak is refused before anything is allocated, in one process or under the launcher."""
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    s = LayerStrategy.parse(f"tp1-dp{world}z0")
    plan = Plan.uniform(model="llama2-70b", cluster=f"{world}xA100-80GB", world_size=world, pp=1,
                        pipeline_schedule="1f1b", num_microbatches=1, seq_len=128, global_batch=world,
                        stages=(StagePlan(0, 80, (s,) * 80),), predicted={"peak_memory_gib": [0.5] * world})
    path = tmp_path / "plan.json"
    plan.save(path)
    launch = ["--nproc", "2"] if world == 2 else []
    from helpers import flexmesh_here  # in this process, its environment restored after (a world of one sets it)

    done = flexmesh_here("train", "--plan", str(path), "--corpus", "stdlib", "--max-steps", "1", "--out",
                         str(tmp_path / "run"), *launch, "--device", "cpu")
    code, said = done.returncode, " ".join(done.stderr.split())
    needs = r"the plan needs a peak of \d{4,}\.\d GiB per rank \(the cost model's estimate"
    assert code == 2 and re.search(needs, said), said
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_memory_check_ignores_a_recorded_peak_the_plan_does_not_need():
    """A plan file recording an absurd peak for a small model is priced by what it needs."""
    from flexmesh.commands.train_job import estimated_peak
    from flexmesh.cost import CostModel
    from flexmesh.job import build_job
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.spec.cluster import parse_cluster
    from flexmesh.spec.model import parse_model

    s = LayerStrategy.parse("tp1-dp2z0")
    plan = Plan.uniform(model="tiny", cluster="2xA100-80GB", world_size=2, pp=1, pipeline_schedule="1f1b",
                        num_microbatches=1, seq_len=128, global_batch=2, stages=(StagePlan(0, 4, (s,) * 4),),
                        predicted={"peak_memory_gib": [1e6, 1e6]})
    spec = parse_model("tiny")
    job = build_job(spec, 128, 2, base=CostModel(spec, parse_cluster("2xA100-80GB")), plan=plan)
    assert 0 < estimated_peak(job) < 10


def test_an_output_that_cannot_be_written_is_one_line_naming_it(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "plan.json"  # a folder that is a file: nothing can be written under it
    assert main(["plan", "--model", "tiny", "--cluster", "2xA100-80GB", "--seq-len", "512", "--global-batch", "4",
                 "--top", "1", "--out", str(target)]) == 2
    said = capsys.readouterr().err
    assert len(said.strip().splitlines()) == 1 and f"cannot write {target}" in said and ".plan.json." not in said
