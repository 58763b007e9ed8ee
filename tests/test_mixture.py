"""Data mixtures (flexmesh.data.mixture, flexmesh.runtime.train.mixture_training, `flexmesh train --domains`).

What a mixture must keep: the differentiated loss is the plain one (a run with domains, static or moving,
steps exactly as the trainer fed the same documents without them); each domain's loss is its documents'
mean cross-entropy, as a plain single-process forward gives it (a cut document and two data ranks
included); the weights move as DoReMi's and ODM's updates say; and a run killed mid-way resumes with the
same documents, losses and weights, bit for bit. This file is also the worker.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    flexmesh_here,
    flexmesh_ranks,
    launch,
    make_steps,
    tiny_spec,
    train_config,
    write_inputs,
    zero2_plan,
)

from flexmesh.data.mixture import Mixture, MixtureLoader, initial_weights, read_domains, reference_losses
from flexmesh.errors import DataError

NAMES = ["code", "prose", "lists"]


# ---- the mixtures' updates --------------------------------------------------------------------------------
def test_doremi_moves_weight_to_the_domains_above_their_reference():
    """One step of DoReMi's exponentiated gradient (its Alg. 1), by hand."""
    m = Mixture("doremi", NAMES, [0.5, 0.3, 0.2], reference=[2.0, 3.0, 1.0])
    m.update(1, [2.5, 2.0, 1.0], [10, 10, 0])  # excess 0.5, 0 (below its reference), 0 (no tokens)
    w = np.array([0.5 * math.exp(0.5), 0.3, 0.2])
    want = (1 - 1e-3) * w / w.sum() + 1e-3 / 3
    assert m.weights.tolist() == pytest.approx(want.tolist(), rel=1e-12)
    assert m.weights.sum() == pytest.approx(1.0, rel=1e-12)


def test_odm_rewards_each_domain_by_its_loss_over_the_chance_it_was_drawn():
    """ODM's EXP3 (its Alg. 1): smoothed importance-weighted rewards, exploration eps = min(1/K, sqrt(ln K/(K t)))."""
    m = Mixture("odm", NAMES, [0.5, 0.25, 0.25])
    for t in range(1, 30):
        m.update(t, [3.0, 1.0, 1.0], [5, 5, 5])
    assert m.weights.sum() == pytest.approx(1.0, rel=1e-12)
    assert m.weights[0] > m.weights[1] == pytest.approx(m.weights[2], rel=1e-12)  # the lossier domain, more
    eps = min(1 / 3, math.sqrt(math.log(3) / (3 * 29)))
    assert m.weights.min() >= eps * (1 - 1e-12)  # every domain explored
    rewards = m.rewards.tolist()
    m.update(30, [9.0, 9.0, 9.0], [0, 0, 0])  # no domain drawn: no reward moves
    assert m.rewards.tolist() == rewards  # exact: the same values, kept


def test_static_never_moves_and_the_lag_is_two_steps():
    m = Mixture("static", NAMES, [0.5, 0.3, 0.2])
    m.update(1, [9.0, 1.0, 1.0], [1, 1, 1])
    assert m.weights.tolist() == [0.5, 0.3, 0.2]
    odm = Mixture("odm", NAMES, [0.6, 0.2, 0.2])
    seen = [odm.weights.copy()]
    for t in range(1, 6):
        odm.update(t, [t, 1.0, 2.0], [5, 5, 5])
        seen.append(odm.weights.copy())
    # batch b (0-based) is drawn with the weights after step b - 1: the step source reads batch b as step b
    # starts (step b - 1 done), and a resume after step 5 reads batch 5 again, then batch 6
    assert odm.weights_for(6).tolist() == seen[5].tolist()  # exact: the stored weights themselves
    assert odm.weights_for(5).tolist() == seen[4].tolist()  # exact: the stored weights themselves
    assert seen[4].tolist() != seen[5].tolist()


def test_loader_draws_the_same_batches_after_a_resume():
    corpora = [[np.arange(2, 2 + n) for n in (5, 9, 14, 3, 7)] for _ in NAMES]
    a = MixtureLoader(corpora, Mixture("odm", NAMES, [0.2, 0.3, 0.5]), global_batch=6, max_len=64, seed=3)
    batches, states = [], []
    for t in range(8):
        states.append((a.state_dict(), a.mixture.state_dict()))
        b = next(a)
        batches.append(([d.tolist() for d in b], b.tasks.tolist()))
        a.mixture.update(t + 1, [1.0 + t % 3, 2.0, 0.5], [1, 1, 1])
        assert len(b) == 6
    b_loader = MixtureLoader(corpora, Mixture("odm", NAMES, [0.2, 0.3, 0.5]), global_batch=6, max_len=64, seed=3)
    b_loader.load_state_dict(json.loads(json.dumps(states[4][0])))
    b_loader.mixture.load_state_dict(json.loads(json.dumps(states[4][1])))
    for t in range(4, 8):
        b = next(b_loader)
        assert ([d.tolist() for d in b], b.tasks.tolist()) == batches[t]
        b_loader.mixture.update(t + 1, [1.0 + t % 3, 2.0, 0.5], [1, 1, 1])


def test_manifests_and_their_one_line_errors(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    assert [d.name for d in read_domains(tmp_path)] == ["x", "y"]
    assert initial_weights(read_domains(tmp_path), [30, 10]).tolist() == [0.75, 0.25]
    bad = {"weights": '{"domains": [{"name": "a", "corpus": "x", "weight": -1}, {"name": "b", "corpus": "y"}]}',
           "repeat": '{"domains": [{"name": "a", "corpus": "x"}, {"name": "a", "corpus": "y"}]}',
           "one": '{"domains": [{"name": "a", "corpus": "x"}]}',
           "field": '{"domains": [{"name": "a", "corpus": "x", "wieght": 2}, {"name": "b", "corpus": "y"}]}'}
    said = {"weights": "positive number", "repeat": "own name", "one": "two domains", "field": "unknown field"}
    for key, text in bad.items():
        path = tmp_path / f"{key}.json"
        path.write_text(text)
        with pytest.raises(DataError, match=said[key]):
            read_domains(path)
    with pytest.raises(DataError, match="every domain a weight, or none"):
        initial_weights([read_domains(tmp_path)[0], read_domains(tmp_path)[1].__class__("z", "q", 2.0)], [1, 1])
    with pytest.raises(DataError, match="--mixture-reference"):
        Mixture("doremi", NAMES, [1, 1, 1])
    with pytest.raises(DataError, match="no per-domain losses"):
        reference_losses([{"loss": 1.0}], NAMES, "run/metrics.jsonl")


# ---- in the trainer ---------------------------------------------------------------------------------------
def worker(out: Path, kind: str) -> None:
    import torch
    import torch.distributed as dist

    from flexmesh.data.tasks import TaskDocuments
    from flexmesh.layout.step import Piece
    from flexmesh.runtime.model.loss import summed_cross_entropy
    from flexmesh.runtime.model.packing import pack_microbatch
    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=60)
    world = dist.get_world_size()
    try:
        plan = zero2_plan(world)
        steps = [(TaskDocuments(docs, [i % 3 for i in range(len(docs))]), s) for docs, s in make_steps(world, 1, 3)]
        model = build_model(tiny_spec(), device="cpu")
        model.init_weights(train_config().seed)
        docs = steps[0][0]
        with torch.no_grad():  # each document alone, whole: its summed cross-entropy and label tokens
            alone = [float(summed_cross_entropy(model(b.tokens, b), b.labels)) for b in
                     (pack_microbatch(docs, [Piece(i, 0, len(d))]) for i, d in enumerate(docs))]
        want = [sum(x for x, s in zip(alone, docs.tasks) if s == k) / sum(len(d) - 1 for d, s in zip(docs, docs.tasks)
                                                                          if s == k) for k in range(3)]
        mixed = Trainer(plan, tiny_spec(), train_config(), mixture=Mixture(kind, NAMES, [0.4, 0.4, 0.2],
                                                                            reference=[5.0, 5.0, 5.0]))
        plain = Trainer(plan, tiny_spec(), train_config())
        rows = []
        for d, s in steps:
            m, n = mixed.step(d, s), plain.step(d, s)
            rows.append(dict(loss=m.loss, plain=n.loss, norm=m.grad_norm, plain_norm=n.grad_norm,
                             domain_loss=m.domain_loss, tokens=m.domain_tokens, label_tokens=m.label_tokens,
                             weight=m.domain_weight))
        (out / f"report_{dist.get_rank()}.json").write_text(json.dumps({"rows": rows, "want": want}))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,kind", [(1, "doremi"), (2, "odm")])
def test_domain_losses_are_the_single_process_forward_and_change_no_step(tmp_path, world, kind):
    proc = launch(world, ["worker", str(tmp_path), kind], script=__file__)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads((tmp_path / "report_0.json").read_text())
    rows = report["rows"]
    assert rows[0]["domain_loss"] == pytest.approx(report["want"], rel=1e-5)  # a cut document's pieces summed
    for r in rows:
        assert r["loss"] == r["plain"] and r["norm"] == r["plain_norm"]  # exact: the same steps, observed or not
        assert sum(r["tokens"]) == r["label_tokens"]
        mean = sum(x * n for x, n in zip(r["domain_loss"], r["tokens"]) if n) / r["label_tokens"]
        assert mean == pytest.approx(r["loss"], rel=1e-6)
    assert rows[-1]["weight"] != [0.4, 0.4, 0.2]  # the weights moved


# ---- through `flexmesh train` -----------------------------------------------------------------------------
def _domains(tmp: Path) -> Path:
    words = {"code": "def return self import class for in if else".split(),
             "prose": "the quick brown fox jumps over a lazy dog".split(), "lists": "one two three".split()}
    rows = []
    for name, ws in words.items():
        for split, count in (("train", 10), ("eval", 3)):
            d = tmp / name / split
            d.mkdir(parents=True)
            for i in range(count):
                n = 5 + (i * 29 + len(name)) % 60
                (d / f"{i}.txt").write_text(" ".join(ws[(i + j) % len(ws)] for j in range(n)))
        rows.append({"name": name, "corpus": f"{name}/train", "eval": f"{name}/eval"})
    (tmp / "domains.json").write_text(json.dumps({"domains": rows}))
    return tmp / "domains.json"


def _rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_mixture_run_killed_mid_way_resumes_bit_for_bit(tmp_path):
    """Two ranks, ODM moving the weights; killed after step 5 with a checkpoint at 4, resumed: the same
    documents per domain, losses, domain losses, weights and held-out losses as the run never stopped."""
    cfg, _, plan = write_inputs(tmp_path, 2)
    manifest = _domains(tmp_path)
    common = ["train", "--plan", str(plan), "--model", str(cfg), "--domains", str(manifest), "--mixture", "odm",
              "--max-steps", "8", "--checkpoint-every", "4", "--eval-every", "4", "--eval-docs", "2", "--no-progress",
              "--cache-dir", str(tmp_path / "cache"), "--tensorboard"]
    whole = flexmesh_ranks(2, *common, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = flexmesh_ranks(2, *common, "--out", str(tmp_path / "cut"),
                            env={"FLEXMESH_TESTING_KILL_AFTER_STEP": "1:5"})
    assert killed.returncode != 0
    resumed = flexmesh_ranks(2, *common, "--out", str(tmp_path / "cut"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr
    want, got = _rows(tmp_path / "whole"), _rows(tmp_path / "cut")
    keys = ("loss", "grad_norm", "domain_loss", "domain_tokens", "domain_weight", "eval_loss", "eval_domain_loss")
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]  # exact: the same steps
    assert want[-1]["domain_weight"] != want[0]["domain_weight"]
    assert [r["step"] for r in want if r["eval_domain_loss"]] == [4, 8] and len(want[-1]["eval_domain_loss"]) == 3
    assert "held-out loss" in whole.stderr and "prose" in whole.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "whole" / "tensorboard")).Reload()
    assert {"domain_weight/code", "domain_loss/prose", "eval_domain_loss/lists"} <= set(events.Tags()["scalars"])


def test_doremi_without_its_reference_and_other_bad_flags_are_refused_in_one_line(tmp_path):
    cfg, corpus, plan = write_inputs(tmp_path, 1)
    manifest = _domains(tmp_path)
    base = ["train", "--plan", str(plan), "--model", str(cfg), "--max-steps", "1", "--out", str(tmp_path / "o")]
    cases = [(["--domains", str(manifest), "--mixture", "doremi"], "--mixture-reference RUN"),
             (["--domains", str(manifest), "--corpus", str(corpus)], "drop --corpus"),
             (["--corpus", str(corpus), "--mixture", "odm"], "give --domains"),
             (["--domains", str(manifest), "--eval-corpus", str(corpus)], "drop --eval-corpus"),
             (["--domains", str(manifest), "--mixture", "doremi", "--mixture-reference", str(tmp_path)],
              "no metrics.jsonl")]
    for extra, said in cases:
        proc = flexmesh_here(*base, *extra)
        assert proc.returncode != 0 and said in proc.stderr, (extra, proc.stderr[-2000:])
        assert len([ln for ln in proc.stderr.splitlines() if ln.startswith("error")]) == 1


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker(Path(sys.argv[2]), sys.argv[3])
