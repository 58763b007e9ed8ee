"""Restarts and several nodes: `flexmesh train --nproc N` with --max-restarts, --nnodes, --node-rank and
--rdzv-endpoint (torchrun's c10d rendezvous).

Every run is the real command (launcher, torchrun, a 2-layer model on CPU, gloo) with two worker
processes in all. Two "nodes" are two launchers on 127.0.0.1 sharing one output folder, as nodes
share a filesystem. A worker is killed at a fixed step through the trainer's testing hook
(FLEXMESH_TESTING_KILL_AFTER_STEP, flexmesh.commands.train), which fires in the first attempt only.
A worker that dies in a run without --max-restarts ends it, keeping its steps and last checkpoint:
tests/test_failures.py's stopped rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import flexmesh_ranks, unlocked, write_inputs

STEPS = 5
KILL = "FLEXMESH_TESTING_KILL_AFTER_STEP"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("elastic")
    _, corpus, plan = write_inputs(tmp, world=2)
    return {"tmp": tmp, "common": ["train", "--plan", str(plan), "--corpus", str(corpus), "--cache-dir",
                                   str(tmp / "cache"), "--no-progress", "--lr", "1e-3", "--max-steps", str(STEPS),
                                   "--checkpoint-every", "2"]}


@pytest.fixture(scope="module")
def straight(inputs) -> list[float]:
    """Per-step losses of an uninterrupted single-node run of 2 ranks (it also fills the token cache), the
    ranks from the fork server: the launcher's restarts and nodes are what the tests below run."""
    out = inputs["tmp"] / "straight"
    done = flexmesh_ranks(2, *inputs["common"], "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [r["loss"] for r in rows]


def _rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def _nodes(inputs: dict, out: Path, *extra: str, env: dict | None = None, timeout: float = 300) -> list[tuple]:
    """Two launchers, node ranks 0 and 1, one worker each, meeting at one loopback endpoint; their
    (exit code, output) once both are done."""
    from flexmesh.runtime.launch import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    procs, logs = [], []
    for node in (0, 1):
        log = out.parent / f"{out.name}-node{node}.log"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "flexmesh", *inputs["common"], "--nproc", "1", "--nnodes", "2", "--node-rank",
                 str(node), "--rdzv-endpoint", endpoint, "--out", str(out), *extra],
                env=env, stdout=f, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:  # a launcher passes SIGTERM on to torchrun, which stops its workers
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
    return [(c, " ".join(log.read_text().split())) for c, log in zip(codes, logs)]


def _close(losses: list[float], expected: list[float]) -> bool:
    return len(losses) == len(expected) and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, expected))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_train_like_one_node_and_restart_together_after_a_killed_worker(inputs, straight):
    """Two launchers of one worker each: the run trains as one node of two ranks, and when a worker dies
    both nodes restart and resume. (A first attempt that failed on its own would spend the one restart
    before the kill at step 3, whose line the test asks for, and a second attempt that failed has none
    left: the restart hides no failure of two nodes training.) --no-resume --overwrite apply to the run,
    not to each attempt: node 0's launcher moves the earlier run in the folder aside once, and the restart
    neither refuses the folder (it holds the first attempt's checkpoint) nor moves that checkpoint aside.
    (One launch for both: a single node's restart takes the same path, node 0's launcher
    (flexmesh.commands.train._launch) under torchrun's c10d rendezvous, whose flags for one node
    test_torchrun_gets_c10d_only_for_restarts_nodes_or_an_endpoint checks.)"""
    out = inputs["tmp"] / "two-nodes-restarted"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # an earlier run, to be moved aside
    done = _nodes(inputs, out, "--max-restarts", "1", "--no-resume", "--overwrite", env={KILL: "1:3"})
    assert [c for c, _ in done] == [0, 0], "\n".join(text[-3000:] for _, text in done)
    # it did die, after the checkpoint of step 2
    assert any(f"{KILL}: rank 1 kills itself after step 3" in text for _, text in done)
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one writer: global rank 0; step 3 logged once
    assert _close([r["loss"] for r in rows], straight), ([r["loss"] for r in rows], straight)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000004",
                                                                       "step_000005"]
    (previous,) = out.glob("previous-*")
    assert (previous / "metrics.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    assert unlocked(out)


@pytest.mark.parametrize("flags, message", [
    (["--max-restarts", "-1"], "--max-restarts must be 0 or more, got -1"),
    (["--nnodes", "0"], "--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX (torchrun's form), got '0'"),
    (["--nnodes", "3:2"], "got '3:2'"),
    (["--nnodes", "two"], "got 'two'"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:29400"], "--nnodes 2 needs --node-rank: 0 on the node whose launcher"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:29400"],
     "--node-rank must be from 0 to 1 with --nnodes 2, got 2"),
    (["--nnodes", "2", "--node-rank", "0"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--rdzv-endpoint", "node0"], "--rdzv-endpoint must be HOST:PORT with a port from 1 to 65535"),
    (["--rdzv-endpoint", "node0:99999"], "got 'node0:99999'"),
    (["--rdzv-endpoint", ":29400"], "got ':29400'"),
    (["--rdzv-endpoint", "h:1", "--rdzv-id", "a b"], "--rdzv-id must be a word without spaces"),
])
def test_bad_launch_flags_are_one_line_errors(tmp_path, capsys, flags, message):
    from flexmesh.cli import main

    rc = main(["train", "--plan", "p.json", "--corpus", "c", "--max-steps", "1", "--out", str(tmp_path / "o"),
               "--nproc", "2", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in " ".join(err.split()), err
    assert len(err.strip().splitlines()) <= 3 and "Traceback" not in err  # one message (rich may wrap it)
    assert not (tmp_path / "o").exists()  # refused before taking the output folder


def test_launch_flags_without_nproc_are_refused(tmp_path, capsys):
    from flexmesh.cli import main

    rc = main(["train", "--plan", "p.json", "--corpus", "c", "--max-steps", "1", "--out", str(tmp_path / "o"),
               "--max-restarts", "1"])
    assert rc == 2 and "--max-restarts is a flag of the launcher: add --nproc N" in " ".join(capsys.readouterr().err
                                                                                              .split())


def test_torchrun_gets_c10d_only_for_restarts_nodes_or_an_endpoint():
    from flexmesh.runtime.launch import parse_rendezvous, torchrun_command

    def flags(**kw) -> list[str]:
        return torchrun_command(2, ["-m", "flexmesh", "train"], port=29555, rendezvous=parse_rendezvous(**kw))[5:-3]

    assert flags() == ["--master-addr", "127.0.0.1", "--master-port", "29555"]  # as before: loopback, one node
    one = flags(max_restarts=2)
    assert one[:8] == ["--nnodes", "1", "--max-restarts", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       "127.0.0.1:29555"]
    assert one[8] == "--rdzv-id" and one[9].startswith("flexmesh-")  # a fresh id: launches never meet
    assert flags(nnodes="1:2", node_rank=1, endpoint="n0:29400") == [
        "--nnodes", "1:2", "--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n0:29400",
        "--rdzv-id", "flexmesh"]  # the same default id on every node


def test_ranks_are_not_given_the_launchers_flags(monkeypatch):
    from flexmesh.runtime import launch

    seen = {}
    monkeypatch.setattr(launch, "run_supervised", lambda command, env=None: seen.update(cmd=command, env=env) or 0)
    rdzv = launch.parse_rendezvous("2", 0, "h:29400", None, 1)
    assert launch.relaunch_flexmesh(1, ["train", "--nproc", "1", "--nnodes", "2", "--node-rank=0", "--rdzv-endpoint",
                                        "h:29400", "--max-restarts", "1", "--plan", "p.json"], rendezvous=rdzv) == 0
    assert seen["cmd"][seen["cmd"].index("-m", 2):] == ["-m", "flexmesh", "train", "--plan", "p.json"]
    assert seen["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
