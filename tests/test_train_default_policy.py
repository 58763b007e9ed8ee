"""``train``'s policy without ``--policy``: ``fixed`` on a plan of one replica group (unchanged), and on a plan of
several the dispatch policy the simulator recommends on the run's first batches (flexmesh.commands.train_job.
choose_policy), the planned shares where that cannot be computed; an explicit ``--policy`` wins."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import flexmesh_ranks, tiny_spec, write_inputs
from test_groups_runtime import plan_dict

from flexmesh.commands.simulate import plan_recommendation
from flexmesh.commands.train_job import choose_policy
from flexmesh.job import build_job
from flexmesh.layout.plan import Plan
from flexmesh.sim.groups import RECOMMENDED_AMONG
from flexmesh.spec.cluster import parse_mixed_cluster


def _job(name: str):
    plan = Plan.from_dict(plan_dict(name))
    return build_job(tiny_spec(), 64, plan.global_batch, plan=plan)


def _batches(gb: int, steps: int = 6) -> list[np.ndarray]:
    """Uneven documents: mostly short, now and then one of the whole 64 tokens."""
    rng = np.random.default_rng(3)
    return [np.where(rng.random(gb) < 0.2, 64, rng.integers(3, 16, size=gb)) for _ in range(steps)]


def test_a_mixed_plan_takes_the_dispatch_policy_the_simulator_recommends():
    job = _job("shares+balanced")  # a one-rank group and a two-stage group on H100 + 2 A100s
    batches = _batches(job.global_batch)
    policy, line = choose_policy(job, batches)
    # what `plan` prints for this plan on these batches, by simulate's code
    cluster = parse_mixed_cluster(job.plan.cluster)
    rec = plan_recommendation(job.plan, build_job(job.model, 64, job.global_batch, cluster=cluster, plan=job.plan),
                              batches)
    assert policy == rec.policy and policy in RECOMMENDED_AMONG and rec.speedup > 1.02
    assert line is not None and line.startswith(f"policy {policy} (dispatch+{policy}), as the simulator recommends "
                                                "on this run's first 6 batches:")
    assert f"{rec.speedup:.2f}x the tokens/s of --policy shares; why," in line and "\n" not in line


def test_a_slow_device_weighs_in_the_choice():
    job = _job("shares+balanced")
    batches = _batches(job.global_batch)
    _, nominal = choose_policy(job, batches)
    _, slowed = choose_policy(job, batches, speeds=(0.25, 1.0, 1.0))  # the one-rank group at a quarter speed
    assert nominal != slowed  # the simulated steps, and so the gain over the shares, move with the speeds


def test_one_group_keeps_fixed_and_an_unpriced_cluster_keeps_shares_saying_why():
    from test_goldens import uniform_plans

    plan = uniform_plans()["dp4-z0"]
    assert choose_policy(build_job(tiny_spec(), 256, 8, plan=plan), _batches(8)) == ("fixed", None)
    job = _job("shares")  # cluster "cpu": no presets price the dispatch
    policy, line = choose_policy(job, _batches(job.global_batch))
    assert policy == "shares"
    assert line.startswith("policy shares (each replica group its planned share): the simulator's recommendation "
                           "cannot be computed here (the plan's cluster 'cpu' prices nothing")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_train_runs_the_recommended_policy_unless_policy_is_given(tmp_path):
    """`flexmesh train` on 2 ranks (forked here) on two one-device groups: without --policy every step runs the
    policy its one line names, with --policy shares the shares, and no recommendation is printed."""
    cfg, corpus, _ = write_inputs(tmp_path, world=2)
    plan = tmp_path / "groups.json"
    groups = [{"ranks": [r], "share": 4, "num_microbatches": 2,
               "stages": [{"layers": [0, 2], "strategies": ["tp1-dp1z0"] * 2}]} for r in ("0", "1")]
    plan.write_text(json.dumps({"version": 4, "model": str(cfg), "cluster": "1xH100+1xA100-40GB", "world_size": 2,
                                "seq_len": 128, "global_batch": 8, "pipeline_schedule": "1f1b", "groups": groups}))

    def train(out: str, *flags: str) -> tuple[list[dict], str]:
        proc = flexmesh_ranks(2, "train", "--plan", str(plan), "--corpus", str(corpus), "--out", str(tmp_path / out),
                              "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--max-steps", "1", *flags,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return [json.loads(x) for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()], proc.stderr

    rows, err = train("default")
    said = [line for line in err.splitlines() if "as the simulator recommends on this run's first 8 batches" in line]
    assert len(said) == 1, err[-4000:]
    chosen = said[0].split()[1]
    assert chosen in (*RECOMMENDED_AMONG, "shares") and all(r["policy"] == chosen for r in rows)
    rows, err = train("given", "--policy", "shares")
    assert all(r["policy"] == "shares" for r in rows) and "as the simulator recommends" not in err
