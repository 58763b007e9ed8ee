"""Many LoRA tasks in one run (docs/adapters.md): each adapter after 2 steps equals training it alone on
its own documents (a plain single-process loop, per-adapter matmuls, no flexmesh trainer), under one
process, data parallelism, ZeRO-3/FSDP2, tensor parallelism (alone and with FSDP2), context
parallelism, pipeline stages and replica groups of different layouts (a pipeline beside FSDP2 among
them); and which tasks share a micro-batch changes no adapter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import SEED, spawn, tiny_spec

from flexmesh.runtime.launch import free_port

STEPS = 2  # task 5 trains 1 of them, and is seen to stop at the second (a third and a fourth stopped it again)
RANKS = (4, 8, 16)
TARGET_SETS = (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
               ("o_proj", "down_proj"), ("gate_proj", "up_proj"))


def task_set():
    """8 tasks: ranks 4, 8 and 16, different targets, scalings (one rsLoRA), learning rates; one stops
    after 1 step and one clips its gradient hard."""
    from flexmesh.spec.tasks import Task, TaskSet

    return TaskSet(tuple(
        Task(name=f"task{i}", rank=RANKS[i % 3], alpha=float(8 + 4 * i), targets=TARGET_SETS[i % 4],
             lr=1e-3 * (1 + i % 2), steps=1 if i == 5 else None, clip=1e-3 if i == 6 else None, rslora=i == 3)
        for i in range(8)))


def config():
    from flexmesh.runtime.train.config import TrainConfig

    return TrainConfig(max_steps=STEPS, lr=1e-3, warmup_steps=1, weight_decay=0.1, grad_clip=1.0, seed=SEED,
                       progress=False)


def task_steps(seed: int = SEED) -> list:
    """Per step: every task's documents (2 of 3..40 tokens; task 0's 3 to 60), task 5's for 1 step."""
    rng = np.random.default_rng(seed)
    steps = []
    for s in range(STEPS):
        per_task = []
        for i in range(8):
            n = 0 if (i == 5 and s >= 1) else 2
            per_task.append([rng.integers(1, 256, size=int(k)) for k in rng.integers(3, 60 if i == 0 else 40, size=n)])
        steps.append(per_task)
    return steps


def step_docs(per_task: list):
    from flexmesh.data.tasks import TaskDocuments

    docs = [d for ds in per_task for d in ds]
    return TaskDocuments(docs, [i for i, ds in enumerate(per_task) for _ in ds])


# ---- the reference: one task alone, plain PyTorch around the model -----------------------------------
def alone(slot: int) -> tuple[dict, list[float]]:
    """Task ``slot`` of :func:`task_set` trained alone on its documents of :func:`task_steps`."""
    return train_alone(tiny_spec(), task_set().tasks[slot], [per_task[slot] for per_task in task_steps()], config())


def train_alone(spec, task, steps: list, cfg) -> tuple[dict, list[float]]:  # noqa: ANN001
    """``task``'s adapters (keyed by :func:`_key`) and losses after training it alone on ``steps`` (its
    documents per step, until the first empty one): one process, one document per forward, per-adapter
    matmuls, torch's AdamW, LambdaLR and clip_grad_norm_ (``cfg``: the run's TrainConfig)."""
    import torch
    import torch.nn.functional as F

    from flexmesh.layout.step import Piece
    from flexmesh.runtime.model.lora import Adapters, attach_adapters, init_adapters
    from flexmesh.runtime.model.packing import pack_microbatch
    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.train.config import lr_schedule_factor
    from flexmesh.spec.tasks import TaskSet

    one = TaskSet((task,))
    model = build_model(spec, device="cpu")
    model.init_weights(cfg.seed)
    attach_adapters(model, spec, one)
    init_adapters(model, one, cfg.seed)
    for m in model.modules():
        if isinstance(m, Adapters):
            m.loop = True
    params = [p for p in model.parameters() if p.requires_grad]
    count = task.steps or cfg.max_steps
    opt = torch.optim.AdamW(params, lr=task.lr if task.lr is not None else cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_schedule_factor(s, cfg.warmup_steps, count, cfg.min_lr_ratio) if s < count else 0.0)
    losses = []
    for docs in steps:
        if not docs:
            break
        opt.zero_grad()
        total = sum(len(d) - 1 for d in docs)
        losses.append(0.0)
        for i in range(len(docs)):
            b = pack_microbatch(docs, (Piece(i, 0, len(docs[i])),), [0] * len(docs))
            logits = model(b.tokens, b)
            loss = F.cross_entropy(logits[0], b.labels[0], ignore_index=-100, reduction="sum") / total
            loss.backward()
            losses[-1] += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, task.clip if task.clip is not None else cfg.grad_clip)
        opt.step()
        sched.step()
    trained = {_key(n, task.name): p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return trained, losses


def _key(name: str, task: str) -> str:
    """An adapter tensor's place with its task's name instead of its slot."""
    return f"{name.rsplit('.', 1)[0]}.{task}"


# ---- the distributed runs ---------------------------------------------------------------------------
def _group(ranks: list[str], share: int, m: int, strategy: str) -> dict:
    return {"ranks": ranks, "share": share, "num_microbatches": m, "virtual_stages": 1,
            "stages": [{"layers": [0, 4], "strategies": [strategy] * 4}]}


def _pipeline(blocks: list[str], share: int, m: int, strategy: str) -> dict:
    """A group of one pipeline, a stage of two layers on each of ``blocks``."""
    return {"ranks": blocks, "share": share, "num_microbatches": m, "virtual_stages": 1,
            "stages": [{"layers": [a, a + 2], "strategies": [strategy] * 2} for a in (0, 2)]}


# name -> (world, groups)
LAYOUTS = {
    "one": (1, [_group(["0"], 16, 4, "tp1-dp1z0")]),
    "dp": (2, [_group(["0-1"], 16, 2, "tp1-dp2z0")]),
    "fsdp": (2, [_group(["0-1"], 16, 2, "tp1-dp2z3")]),
    "pair": (2, [_group(["0"], 8, 2, "tp1-dp1z0"), _group(["1"], 8, 1, "tp1-dp1z0-ac")]),
    "tp": (2, [_group(["0-1"], 16, 2, "tp2-dp1z0")]),
    "tp_x_fsdp": (4, [_group(["0-3"], 16, 2, "tp2-dp2z3")]),
    "pair4": (4, [_group(["0-1"], 8, 1, "tp1-dp2z3"), _group(["2-3"], 8, 2, "tp1-u2-dp1z3")]),
    "pp": (2, [_pipeline(["0", "1"], 16, 4, "tp1-dp1z0")]),
    "pp_pair4": (4, [_pipeline(["0", "1"], 8, 2, "tp1-dp1z0-ac"), _group(["2-3"], 8, 2, "tp1-dp2z3")]),
}


def make_plan(name: str):
    from flexmesh.layout.plan import Plan

    world, groups = LAYOUTS[name]
    return Plan.from_dict({"version": 4, "model": "test-tiny", "cluster": f"{world}xA100-80GB", "world_size": world,
                           "seq_len": 64, "global_batch": sum(g["share"] for g in groups), "pipeline_schedule": "1f1b",
                           "groups": groups})


def schedules(plan, policy: str = "balanced") -> list:
    from flexmesh.schedule.scheduler import Scheduler
    from flexmesh.sim.predict import simulated_scheduler

    schedule = simulated_scheduler(Scheduler(plan, tiny_spec(), policy, 64))
    return [schedule([len(d) for d in step_docs(s)]) for s in task_steps()]


def swapped(docs) -> object:
    """A one-rank schedule pairing other tasks in each micro-batch: documents dealt round-robin over 5
    micro-batches in reverse order."""
    from flexmesh.layout.step import Group, Piece, StepSchedule

    mbs: list[list] = [[] for _ in range(5)]
    for k, i in enumerate(reversed(range(len(docs)))):
        mbs[k % 5].append(Piece(i, 0, len(docs[i])))
    return StepSchedule(lengths=tuple(len(d) for d in docs),
                        groups=(Group((0,), tuple(tuple(mb) for mb in mbs if mb)),), policy="test")


def _worker(rank: int, world: int, port: int, out: str, names: list[str]) -> None:
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.state.weights import canonical_name
    from flexmesh.runtime.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed(timeout_s=120)
    tasks = task_set()
    try:
        for name in names:
            plan = make_plan(name.removesuffix("+swapped"))
            trainer = Trainer(plan, tiny_spec(), config(), tasks=tasks)
            scheds = schedules(plan) if not name.endswith("+swapped") else [swapped(step_docs(s)) for s in task_steps()]
            metrics = [trainer.step(step_docs(s), sched) for s, sched in zip(task_steps(), scheds)]
            adapters = {}
            for m in trainer.inner_models():
                sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
                for k, v in sd.items():
                    k = canonical_name(k)
                    if ".adapters." in k:
                        adapters[_key(k, tasks.tasks[int(k.rsplit('.', 1)[1])].name)] = v.detach().cpu().clone()
                    elif k in BASE_KEYS:
                        adapters[f"base:{k}"] = v.detach().cpu().clone()
            held: list = [None] * world  # pipeline stages hold their own layers' adapters
            dist.all_gather_object(held, adapters)
            if rank == 0:
                torch.save({k: v for part in held for k, v in part.items()}, Path(out) / f"{name}.pt")
                (Path(out) / f"{name}.json").write_text(json.dumps([m.to_dict() for m in metrics]))
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def references() -> tuple[dict, list]:
    """Every task's adapters after training alone, and its losses per step."""
    params: dict = {}
    losses = []
    for slot in range(8):
        p, loss = alone(slot)
        params.update(p)
        losses.append(loss)
    return params, losses


def _run(tmp_path: Path, world: int, names: list[str]) -> None:
    spawn(_worker, (world, free_port(), str(tmp_path), names), world)


BASE_KEYS = ("layers.0.attention.wq.weight", "layers.3.feed_forward.w2.weight", "norm.weight", "output.weight")


def _check(tmp_path: Path, name: str, refs: tuple[dict, list]) -> None:
    import torch

    from flexmesh.runtime.model.transformer import build_model

    references, losses = refs
    got = torch.load(tmp_path / f"{name}.pt")
    fresh = build_model(tiny_spec(), device="cpu")
    fresh.init_weights(SEED)
    for k in BASE_KEYS:  # the base stays as initialised (no weight decay, no update)
        # exact: the base is never updated
        assert torch.equal(got.pop(f"base:{k}"), fresh.state_dict()[k]), f"{name}: base {k} changed"
    assert sorted(got) == sorted(references)
    # Tensor parallelism sums each projection's products over head shards in another order; AdamW's
    # first steps on near-zero gradients of A (B starts at 0) turn that into a few 1e-5 (measured 1.6e-5)
    atol = 3e-5 if name.startswith("tp") else 1e-5
    for k, ref in references.items():
        diff = float((got[k] - ref).abs().max())
        assert diff <= atol, f"{name}: {k} differs by {diff:.2e} (> {atol:g})"
    metrics = json.loads((tmp_path / f"{name}.json").read_text())
    assert [m["task_tokens"][5] > 0 for m in metrics] == [True, False]  # task 5 stops after 1
    # each task's adapters step with their own schedule's rate: task 5's is 0 once its one step is done
    assert all(len(m["task_lr"]) == 8 and m["task_lr"][0] == m["lr"] > 0 for m in metrics)  # exact: the same float
    assert metrics[0]["task_lr"][5] > 0 and metrics[1]["task_lr"][5] == 0.0
    assert all(len(m["task_loss"]) == 8 and m["tasks"][0] == "task0" for m in metrics)
    for slot, want in enumerate(losses):  # each task's reported loss is its own mean, counted once
        assert [m["task_loss"][slot] for m in metrics[:len(want)]] == pytest.approx(want, rel=1e-5)


def test_adapters_move(references):
    """The reference itself: after STEPS steps every B has left its zero start."""

    b = [v for k, v in references[0].items() if ".lora_B." in k]
    assert b and all(float(v.abs().max()) > 1e-4 for v in b)


@pytest.mark.slow
def test_one_process_and_swapped_micro_batches(tmp_path, references):
    _run(tmp_path, 1, ["one", "one+swapped"])
    _check(tmp_path, "one", references)
    _check(tmp_path, "one+swapped", references)


@pytest.mark.slow
@pytest.mark.parametrize("names", [["dp", "fsdp", "pair", "tp", "pp"]])
def test_two_ranks(tmp_path, references, names):
    _run(tmp_path, 2, names)
    for name in names:
        _check(tmp_path, name, references)


@pytest.mark.slow
def test_four_ranks(tmp_path, references):
    _run(tmp_path, 4, ["pair4", "tp_x_fsdp", "pp_pair4"])
    for name in ("pair4", "tp_x_fsdp", "pp_pair4"):
        _check(tmp_path, name, references)


# ---- a LoRA mix through the command line ---------------------------------------------------------------
MIX_JOB = """
[[task]]
name = "wide"
corpus = "corpus"
rank = 4
alpha = 8
targets = ["q_proj", "v_proj", "gate_proj"]
batch = 3
lr = 2e-3

[[task]]
name = "narrow"
corpus = "narrow"
rank = 8
alpha = 16
targets = ["o_proj", "down_proj"]
batch = 1
clip = 0.01
"""


def _mix_plan(cfg: Path) -> dict:
    """Two replica groups of one rank each and different layouts: rank 0 one micro-batch, no recomputation;
    rank 1 two micro-batches, full recomputation of its first layer, selective of its second."""
    groups = [{"ranks": ["0"], "share": 2, "num_microbatches": 1, "virtual_stages": 1,
               "stages": [{"layers": [0, 2], "strategies": ["tp1-dp1z0", "tp1-dp1z0"]}]},
              {"ranks": ["1"], "share": 2, "num_microbatches": 2, "virtual_stages": 1,
               "stages": [{"layers": [0, 2], "strategies": ["tp1-dp1z0-ac", "tp1-dp1z0-sac"]}]}]
    return {"version": 4, "model": str(cfg), "cluster": "2xA100-80GB", "world_size": 2, "seq_len": 96,
            "global_batch": 4, "pipeline_schedule": "1f1b", "groups": groups}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_lora_mix_of_two_layouts_trains_each_adapter_as_alone(tmp_path):
    """`flexmesh train --tasks --plan P` on 2 ranks (from the fork server, as torchrun starts them; the
    ``--nproc`` launcher has tests of its own), P a version-4 plan of two replica groups of different
    layouts: each adapter ends as training its task alone (on the documents the run's loader dealt it).
    The groups take 2 documents each, so "wide" (3 a step) trains on both and shares rank 1 with "narrow"."""
    import torch
    from helpers import flexmesh_ranks, write_inputs

    from flexmesh.data.loader import load_corpus_tokens
    from flexmesh.data.tasks import TaskLoader
    from flexmesh.layout.plan import Plan
    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.state.checkpoint import manifest_tasks
    from flexmesh.runtime.state.export import _model_keys, find_checkpoint, read_full_tensors
    from flexmesh.runtime.train.config import TrainConfig
    from flexmesh.spec.model import parse_model
    from flexmesh.spec.tasks import load_tasks

    cfg, _, _ = write_inputs(tmp_path, 2)
    (tmp_path / "narrow").mkdir()
    for i in range(6):  # short documents of their own
        words = ["lazy dog jumps", "quick fox"][i % 2]
        (tmp_path / "narrow" / f"n{i}.txt").write_text(" ".join(words for _ in range(3 + i)))
    (tmp_path / "jobs.toml").write_text(MIX_JOB)
    plan = tmp_path / "mix.json"
    plan.write_text(json.dumps(_mix_plan(cfg)))
    assert len({g.stages for g in Plan.load(plan).groups}) == 2  # two layouts
    out = tmp_path / "run"
    steps, seed = 3, 0
    train = TrainConfig(max_steps=steps, lr=1e-3, warmup_steps=1, weight_decay=0.1, grad_clip=1.0, seed=seed)
    proc = flexmesh_ranks(2, "train", "--plan", str(plan), "--model", str(cfg), "--tasks", str(tmp_path / "jobs.toml"),
                          "--max-steps", str(steps), "--out", str(out), "--no-progress",
                          "--lr", str(train.lr), "--warmup", str(train.warmup_steps), "--seed", str(seed),
                          "--weight-decay", str(train.weight_decay), "--grad-clip", str(train.grad_clip), timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [all(n > 0 for n in r["task_tokens"]) for r in rows] == [True] * steps

    # the documents the run's loader dealt each task, under the tokenizer the run recorded
    spec = parse_model(str(cfg))
    tasks = load_tasks(tmp_path / "jobs.toml")
    corpora = [load_corpus_tokens(tmp_path / t.corpus, out / "tokenizer")[0] for t in tasks]
    loader = TaskLoader(tasks.names, corpora, [t.batch for t in tasks], [t.steps or steps for t in tasks], 96,
                        seed=seed)
    dealt = [next(loader) for _ in range(steps)]
    path = find_checkpoint(out)
    held = manifest_tasks(json.loads((path / "manifest.json").read_text()), path)
    state = read_full_tensors(path, _model_keys(path))
    fresh = build_model(spec, device="cpu")
    fresh.init_weights(seed)
    for k, v in fresh.state_dict().items():  # the base stays as initialised
        assert torch.equal(state[k], v), f"base {k} changed"  # exact: the base is never updated
    for slot, task in enumerate(tasks):
        docs = [[d for d, s in zip(step, step.tasks) if s == slot] for step in dealt]
        want, losses = train_alone(spec, task, docs, train)
        got = {_key(k, held.tasks[int(k.rsplit(".", 1)[1])].name): v for k, v in state.items() if ".adapters." in k}
        got = {k: v for k, v in got.items() if k.endswith(f".{task.name}")}
        assert sorted(got) == sorted(want) and want
        for k, ref in want.items():
            diff = float((got[k] - ref).abs().max())
            assert diff <= 1e-5, f"{k} differs from training {task.name} alone by {diff:.2e}"
        assert [r["task_loss"][slot] for r in rows[:len(losses)]] == pytest.approx(losses, rel=1e-5)
    assert any(float(v.abs().max()) > 1e-4 for k, v in state.items() if ".lora_B." in k)  # the adapters moved


@pytest.mark.parametrize("ranks", [(1,), (3,), (2, 5), (6, 4), (8, 3)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_at_any_rank_runs_and_matches_the_per_run_path(ranks, dtype):
    """Ranks whose rows are not 16-byte aligned (3 in fp32, 5 in bf16) take the per-run path instead
    of the grouped kernel (which refuses them: "strides should be multiple of 16 bytes"); every rank
    gives what the per-run reference gives."""
    import torch

    from flexmesh.runtime.model.lora import AdapterRow, Adapters
    from flexmesh.spec.tasks import Task, TaskSet

    dtype = getattr(torch, dtype)
    tasks = TaskSet(tuple(Task.from_dict({"name": f"t{i}", "corpus": "docs", "rank": r, "alpha": 2 * r,
                                          "targets": ["wq"]}) for i, r in enumerate(ranks)))
    ad = Adapters(16, 12, tasks, "wq")
    gen = torch.Generator().manual_seed(0)
    for p in ad.parameters():
        p.data = torch.randn(p.shape, generator=gen)
    x = torch.randn(1, 7, 16, generator=gen).to(dtype)
    row = AdapterRow.of([(i % len(ranks), n) for i, n in enumerate((3, 4))], x.device)
    grouped = ad(x, row)
    ad.loop = True
    # grouped GEMMs and the loop may sum in other orders: within bf16's resolution
    assert torch.allclose(grouped.float(), ad(x, row).float(), atol=1e-2)
