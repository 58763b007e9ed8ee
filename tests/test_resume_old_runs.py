"""Checkpoints written before the plan types merged resume under their old plan files.

tests/golden/old_runs/ holds runs of `flexmesh train --nproc 2` made by flexmesh at fde2c13
(tests/golden/make_old_runs.py): a version-2 plan (ZeRO-2 over both ranks) and a version-3 plan (two
replicas of one rank), each stopped after a checkpoint at step 2, and the losses of 3 steps straight.
Today's code resumes each from its checkpoint under the same plan file and must train step 3 as the
straight run did (the two ranks from the fork server, as torchrun would start them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import flexmesh_ranks

OLD = Path(__file__).with_name("golden") / "old_runs"


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["v2-zero2", "v3-replicas"])
def test_an_old_checkpoint_resumes_under_its_old_plan(tmp_path, name):
    import os

    folder = tmp_path / name
    shutil.copytree(OLD / name, folder)
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["version"] == int(name[1])  # the file as that commit wrote it
    here = os.getcwd()
    os.chdir(folder)  # the plan names its model by a path relative to its folder
    try:
        proc = flexmesh_ranks(2, "train", "--plan", "plan.json", "--out", "run", "--corpus", "corpus",
                              "--cache-dir", "cache", "--max-steps", "3", "--checkpoint-every", "2", "--no-progress",
                              "--lr", "1e-3", "--min-lr-ratio", "1", timeout=300)
    finally:
        os.chdir(here)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    straight = [json.loads(x) for x in (folder / "straight.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # steps 1-2 from the old run, 3 resumed
    # exact: the old run's rows, kept in the file
    assert rows[:2] == [json.loads(x) for x in (OLD / name / "run" / "metrics.jsonl").read_text().splitlines()]
    assert abs(rows[2]["loss"] - straight[2]["loss"]) <= 1e-6 * straight[2]["loss"], (rows[2]["loss"], straight[2])
    assert rows[2]["tokens"] == straight[2]["tokens"]  # the same documents
