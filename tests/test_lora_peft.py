"""LoRA tasks through the command line and PEFT (docs/adapters.md): `flexmesh train --tasks` trains three
adapters, `flexmesh export` writes one PEFT folder each, and transformers + PEFT loading them give
flexmesh's logits; a PEFT adapter imported into a task and trained one step equals PEFT's own step;
bad job files and foreign adapters are refused in one line."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import flexmesh_here, flexmesh_ranks, spawn, write_inputs

from flexmesh.runtime.launch import free_port

# Whether PEFT is installed, without importing it (2 s of CPU): only the tests that load an adapter into it do
if importlib.util.find_spec("peft") is None:
    pytest.skip("PEFT is the reference; pip install -e .[dev]", allow_module_level=True)
transformers = pytest.importorskip("transformers")

JOB = """
[[task]]
name = "short"
corpus = "short"
rank = 4
alpha = 8
targets = ["q_proj", "v_proj"]
batch = 3

[[task]]
name = "long"
corpus = "long"
rank = 8
alpha = 16
rslora = true
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
batch = 1
lr = 2e-3

[[task]]
name = "mid"
corpus = "mid"
rank = 2
alpha = 4
targets = ["down_proj"]
steps = 2
"""


def write_tasks(tmp: Path) -> Path:
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly boxing".split()
    for name, n_docs, length in (("short", 12, 8), ("long", 4, 64), ("mid", 8, 20)):
        folder = tmp / name
        folder.mkdir()
        for i in range(n_docs):
            n = length + (i * 5) % length
            (folder / f"d{i}.txt").write_text(" ".join(words[(i + j * 7) % len(words)] for j in range(n)))
    job = tmp / "jobs.toml"
    job.write_text(JOB)
    return job


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("lora")
    cfg, _, plan = write_inputs(tmp, 1)
    job = write_tasks(tmp)
    out = tmp / "run"
    proc = flexmesh_ranks(1, "train", "--plan", str(plan), "--model", str(cfg), "--tasks", str(job), "--max-steps",
                          "3", "--out", str(out), "--no-progress", "--seq-len", "96", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "latest loss" in " ".join(proc.stdout.split()) and "long" in proc.stdout  # the per-task table
    exported = tmp / "export"
    here = os.getcwd()
    os.chdir(tmp)  # --out as a user types it, relative to where they are
    try:
        proc = flexmesh_here("export", "--checkpoint", str(out), "--out", "export", "--model", str(cfg))
    finally:
        os.chdir(here)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"tmp": tmp, "cfg": cfg, "plan": plan, "job": job, "out": out, "export": exported,
            "export_line": proc.stdout}


@pytest.mark.slow
def test_train_reports_every_task(run):
    rows = [json.loads(x) for x in (run["out"] / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "task_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["tasks"] == ["short", "long", "mid"] for r in steps)
    assert [r["task_tokens"][2] > 0 for r in steps] == [True, True, False]  # "mid" trains 2 steps
    assert all(r["task_tokens"][0] > 0 and r["task_tokens"][1] > 0 for r in steps)
    assert all(np.isfinite(r["task_loss"]).all() and r["task_loss"][0] > 0 for r in steps)
    assert "3 PEFT adapters" in " ".join(run["export_line"].split())


def _flexmesh_logits(run: dict, slot: int, tokens: torch.Tensor) -> torch.Tensor:
    """flexmesh's logits with task ``slot``'s adapter on every token: the trained checkpoint read back."""
    from flexmesh.layout.step import Piece
    from flexmesh.runtime.model.lora import attach_adapters
    from flexmesh.runtime.model.packing import pack_microbatch
    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.state.checkpoint import manifest_tasks
    from flexmesh.runtime.state.export import _model_keys, find_checkpoint, read_full_tensors
    from flexmesh.spec.model import parse_model

    spec = parse_model(str(run["cfg"]))
    path = find_checkpoint(run["out"])
    tasks = manifest_tasks(json.loads((path / "manifest.json").read_text()), path)
    model = build_model(spec, device="cpu")
    attach_adapters(model, spec, tasks)
    state = read_full_tensors(path, _model_keys(path))
    model.load_state_dict(state, strict=True)
    doc = tokens.numpy()
    b = pack_microbatch([doc], (Piece(0, 0, len(doc)),), [slot])
    with torch.no_grad():
        return model(b.tokens, b)[0]


@pytest.mark.slow
@pytest.mark.parametrize("slot,name", [(0, "short"), (1, "long"), (2, "mid")])
def test_peft_loads_the_export(run, slot, name):
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(run["export"], torch_dtype=torch.float32)
    plain = base(torch.arange(5, 45)[None]).logits[0].detach()
    config = json.loads((run["export"] / "adapters" / name / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(run["export"].resolve())  # absolute, whatever --out said
    model = PeftModel.from_pretrained(base, run["export"] / "adapters" / name).eval()
    tokens = torch.arange(5, 45)
    with torch.no_grad():
        got = model(tokens[None]).logits[0]
    want = _flexmesh_logits(run, slot, tokens)
    assert float((got - plain).abs().max()) > 1e-4  # the adapter changes the output (so the check can fail)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ---- import: a PEFT adapter trained one step by flexmesh equals PEFT's own step ----------------------
def _hf_base(tmp: Path):
    from flexmesh.runtime.model.transformer import build_model
    from flexmesh.runtime.state.weights import save_hf_safetensors
    from flexmesh.spec.hf import to_hf_config
    from flexmesh.spec.model import parse_model

    spec = parse_model(str(write_inputs(tmp, 1)[0]))
    model = build_model(spec, device="cpu")
    model.init_weights(3)
    folder = tmp / "base"
    folder.mkdir()
    save_hf_safetensors(model, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(to_hf_config(spec)))
    return spec, folder


def _import_worker(rank: int, port: int, tmp: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from flexmesh.data.tasks import TaskDocuments
    from flexmesh.layout.plan import load_plan
    from flexmesh.layout.step import Group, Piece, StepSchedule
    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.state.peft import peft_key
    from flexmesh.runtime.train.config import TrainConfig
    from flexmesh.runtime.train.trainer import Trainer
    from flexmesh.spec.model import parse_model
    from flexmesh.spec.tasks import load_tasks

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed(timeout_s=120)
    root = Path(tmp)
    spec = parse_model(str(root / "config.json"))
    cfg = TrainConfig(max_steps=1, lr=1e-3, warmup_steps=0, weight_decay=0.1, grad_clip=0.0, progress=False)
    trainer = Trainer(load_plan(root / "plan.json"), spec, cfg, weights=str(root / "base" / "model.safetensors"),
                      tasks=load_tasks(root / "import.toml"))
    doc = np.load(root / "doc.npy")
    sched = StepSchedule(lengths=(len(doc),), groups=(Group((0,), ((Piece(0, 0, len(doc)),),)),), policy="test")
    trainer.step(TaskDocuments([doc], [0]), sched)
    sd = get_model_state_dict(trainer.inner_models()[0], options=StateDictOptions(full_state_dict=True))
    torch.save({peft_key(k): v for k, v in sd.items() if ".adapters." in k}, root / "flexmesh_step.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_imported_peft_adapter_trains_as_peft_does(tmp_path):
    from peft import LoraConfig, get_peft_model

    spec, base_folder = _hf_base(tmp_path)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder, torch_dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                        init_lora_weights=False)  # A and B random: the first step moves both
    model = get_peft_model(base, config)
    model.save_pretrained(tmp_path / "adapter")
    (tmp_path / "import.toml").write_text('[[task]]\nname = "imported"\ncorpus = "unused"\nrank = 4\nalpha = 8\n'
                                          'targets = ["q_proj", "v_proj", "down_proj"]\ninit = "adapter"\n')
    doc = np.random.default_rng(1).integers(1, spec.vocab, 50)
    np.save(tmp_path / "doc.npy", doc)
    spawn(_import_worker, (free_port(), str(tmp_path)), 1)
    # PEFT's own step: mean token cross-entropy, AdamW with the run's settings
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ids = torch.from_numpy(doc)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    want = {k.replace(".default", ""): v.detach() for k, v in model.state_dict().items() if "lora_" in k}
    got = torch.load(tmp_path / "flexmesh_step.pt")
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)


# ---- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("job,says", [
    ('[[task]]\nname = "a"\ncorpus = "c"\nrank = 4\nalpha = 8\ntargets = ["qkv"]\n', "no projection 'qkv'"),
    ('[[task]]\nname = "a"\ncorpus = "c"\nrank = 4\nalpha = 8\ntargets = ["q_proj"]\n'
     '[[task]]\nname = "a"\ncorpus = "c"\nrank = 4\nalpha = 8\ntargets = ["q_proj"]\n', "two tasks are named 'a'"),
    ('[[task]]\nname = "a"\ncorpus = "c"\nrank = 4\nalpha = 8\ntargets = ["q_proj"]\nranks = 3\n',
     "unknown key 'ranks'"),
    ('[[task]]\nname = "a"\ncorpus = "c"\nrank = 0\nalpha = 8\ntargets = ["q_proj"]\n', "rank must be at least 1"),
    ('[[task]]\nname = "a/b"\ncorpus = "c"\nrank = 4\nalpha = 8\ntargets = ["q_proj"]\n', "usable as a folder name"),
    ('', "lists no task"),
])
def test_bad_job_files_say_what_to_change(tmp_path, job, says):
    from flexmesh.errors import SpecError
    from flexmesh.spec.tasks import load_tasks

    (tmp_path / "jobs.toml").write_text(job)
    with pytest.raises(SpecError, match=says.replace("(", r"\(")):
        load_tasks(tmp_path / "jobs.toml")


def test_a_rank_the_model_cannot_carry_is_one_line_before_training(tmp_path):
    cfg, corpus, plan = write_inputs(tmp_path, 1)
    (tmp_path / "jobs.toml").write_text('[[task]]\nname = "a"\ncorpus = "corpus"\nrank = 4096\nalpha = 8\n'
                                        'targets = ["k_proj"]\n')
    proc = flexmesh_here("train", "--plan", str(plan), "--model", str(cfg), "--tasks", str(tmp_path / "jobs.toml"),
                         "--max-steps", "1", "--out", str(tmp_path / "run"))
    assert proc.returncode != 0
    assert "rank 4096 is larger than k_proj" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_empty_task_corpus_and_foreign_adapter_are_refused(tmp_path, run):
    from flexmesh.errors import CheckpointError
    from flexmesh.runtime.state.peft import read_adapter
    from flexmesh.spec.model import ModelSpec
    from flexmesh.spec.tasks import Task

    cfg, _, plan = write_inputs(tmp_path, 1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "jobs.toml").write_text('[[task]]\nname = "a"\ncorpus = "empty"\nrank = 4\nalpha = 8\n'
                                        'targets = ["q_proj"]\n')
    proc = flexmesh_here("train", "--plan", str(plan), "--model", str(cfg), "--tasks", str(tmp_path / "jobs.toml"),
                         "--max-steps", "1", "--out", str(tmp_path / "run"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "empty" in proc.stderr, proc.stderr[-2000:]
    # the "short" adapter (rank 4 on q_proj, v_proj of a 2-layer model of hidden 64) on a model of hidden 96
    other = ModelSpec(name="other", num_layers=2, hidden=96, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab=320)
    task = Task(name="short", rank=4, alpha=8, targets=("q_proj", "v_proj"))
    with pytest.raises(CheckpointError, match="another base model"):
        read_adapter(run["export"] / "adapters" / "short", task, other)
    with pytest.raises(CheckpointError, match="rank 4 on"):
        read_adapter(run["export"] / "adapters" / "short", Task(name="short", rank=8, alpha=8,
                                                                 targets=("q_proj", "v_proj")), other)
