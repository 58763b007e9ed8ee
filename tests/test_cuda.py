"""On a CUDA GPU: every attention kernel against the CPU reference, and training against the CPU run.

Marked ``cuda``: skipped where torch sees no GPU (tests/conftest.py), so CI on CPU skips them; run
them on a GPU machine with ``python -m pytest -q -m cuda tests/test_cuda.py`` (with bench/gpu.py, one
call). Tolerances are bf16's: relative error of the whole tensor (Frobenius norm) under 2e-2 for
outputs and gradients.

- kernels: every kernel of flexmesh.runtime.model.attention_kernels that serves the case (``varlen``, and
  ``varlen`` with its key/value heads not repeated, ``flash-attn`` where installed, ``flex``, ``sdpa``), on
  packed rows of many documents, grouped-query heads, sliding windows and head sizes 64 and 128, and on
  queries after a carried prefix (the kernels' ``suffix``), forward and the gradients of q, k and v,
  against the fp32 CPU kernel on the same inputs;
- cut documents: the trainer on one GPU, a document cut over micro-batches (its keys and values
  carried), against the single-process CPU reference with whole documents;
- training: 5 steps of the trainer on one GPU in fp32 and in bf16 (compiled blocks, chunked loss,
  fused AdamW: the GPU defaults) against the CPU reference's losses;
- checkpoints: one written in the background (``--async-checkpoint``) while the next step runs holds the
  tensors of one written before that step.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import launch, make_steps, reference_training, tiny_spec, train_config

from flexmesh.runtime.model import attention_kernels as AK

pytestmark = pytest.mark.cuda

# (query heads, kv heads, head_dim, document lengths, window)
CASES = {
    "packed-gqa": (8, 2, 64, [1, 300, 17, 1000, 64, 2, 700], None),
    "one-long": (4, 4, 128, [2048], None),
    "window-gqa": (8, 4, 64, [900, 33, 1500], 256),
    "window-longer-than-docs": (4, 2, 128, [100, 200], 4096),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kernel", [*AK.KERNELS, "varlen-native-gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_the_cpu_reference(kernel, case, dtype, monkeypatch):
    """``varlen-native-gqa``: the varlen kernel with AK.VARLEN_NATIVE_GQA (keys and values not repeated)."""
    if kernel == "varlen-native-gqa":
        monkeypatch.setattr(AK, "VARLEN_NATIVE_GQA", True)
        kernel = "varlen"
    h, hkv, d, lengths, window = CASES[case]
    k_ = AK.KERNELS[kernel]
    if not k_.serves("cuda", dtype, window, d, hkv != h):
        pytest.skip(f"{kernel} does not serve {dtype} / window {window} / head_dim {d} on this machine")
    torch.manual_seed(0)
    t = sum(lengths)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cpu = [torch.randn(1, n, t, d) for n in (h, hkv, hkv)]
    gout = torch.randn(1, h, t, d)
    ref_in = [x.clone().requires_grad_() for x in cpu]
    ref = AK.local_attention(*ref_in, torch.tensor(bounds, dtype=torch.int32), window, kernel="sdpa")
    ref_grads = torch.autograd.grad(ref, ref_in, gout)
    gpu_in = [x.to("cuda", dtype).requires_grad_() for x in cpu]
    docs = AK.Documents(torch.tensor(bounds, dtype=torch.int32, device="cuda"), tuple(bounds))
    out = k_.run(*gpu_in, docs, window)
    grads = torch.autograd.grad(out, gpu_in, gout.to("cuda", dtype))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    assert rel(out.cpu(), ref) < tol, f"{kernel} forward"
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel(g.cpu(), r) < tol, f"{kernel} d{name}"


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("kernel", list(AK.KERNELS))
def test_suffix_kernel_matches_the_cpu_reference(kernel, window):
    """A piece of a cut document after its carried prefix: 700 queries over 1,900 keys."""
    k_ = AK.KERNELS[kernel]
    if not k_.serves("cuda", torch.bfloat16, window, 64, True):
        pytest.skip(f"{kernel} does not serve bf16 / window {window} on this machine")
    torch.manual_seed(1)
    cpu = [torch.randn(1, h, n, 64) for h, n in ((8, 700), (2, 1900), (2, 1900))]
    gout = torch.randn(1, 8, 700, 64)
    ref_in = [x.clone().requires_grad_() for x in cpu]
    ref = AK.suffix_attention(*ref_in, window, kernel="sdpa")
    ref_grads = torch.autograd.grad(ref, ref_in, gout)
    gpu_in = [x.to("cuda", torch.bfloat16).requires_grad_() for x in cpu]
    out = k_.suffix(*gpu_in, window)
    grads = torch.autograd.grad(out, gpu_in, gout.to("cuda", torch.bfloat16))
    assert rel(out.cpu(), ref) < 2e-2, f"{kernel} forward"
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel(g.cpu(), r) < 2e-2, f"{kernel} d{name}"


def test_the_gpu_picks_a_kernel_made_for_packed_documents():
    assert AK.select_kernel("cuda", torch.bfloat16, None, 64, True).name in ("varlen", "flash-attn", "flex")
    assert AK.select_kernel("cuda", torch.float32, None, 64, True).name in ("flex", "sdpa")


# ---- the trainer on one GPU (a torchrun worker of one rank) ----------------------------------------------
def plan_of_one():
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    st = StagePlan(0, 4, tuple(LayerStrategy.parse(s) for s in ("tp1-dp1z0", "tp1-dp1z0-ac", "tp1-dp1z0",
                                                                 "tp1-dp1z0-sac")))
    return Plan.uniform(model="test-tiny", cluster="1xH100-80GB", world_size=1, pp=1, pipeline_schedule="1f1b",
                num_microbatches=1, seq_len=256, global_batch=8, stages=(st,))


STEPS = 5


def worker(out: Path) -> None:
    """Both precisions in one process: the second reuses the first's start-up and compiler workers."""
    import dataclasses

    import torch.distributed as dist

    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.trainer import Trainer

    init_distributed(timeout_s=300, device="cuda")
    for dtype in ("bf16", "fp32"):
        trainer = Trainer(plan_of_one(), tiny_spec(), replace(train_config(), max_steps=STEPS, dtype=dtype))
        rows = [dataclasses.asdict(trainer.step(docs, sched)) for docs, sched in make_steps(1, 1, steps=STEPS)]
        (out / f"{dtype}.json").write_text(json.dumps({"rows": rows, "compiled": trainer.config.compile,
                                                      "chunked": trainer.chunked_loss}))
    try:
        async_checkpoint(trainer, out)
    except Exception as e:  # its own test's failure, not the training tests'
        (out / "async.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
    dist.barrier()
    dist.destroy_process_group()


def async_checkpoint(trainer, out: Path) -> None:  # noqa: ANN001 - a Trainer on the GPU
    """--async-checkpoint's write on the GPU: the state written by a thread while the next step changes the
    weights on the device, against the same state written before that step and the state after it, tensor by
    tensor (``async.json``: the keys that differ from the state before, and which of them hold the state after)."""
    import torch.distributed as dist

    from flexmesh.runtime.state.checkpoint import save_checkpoint, start_checkpoint

    docs, sched = make_steps(1, 1, steps=1)[0]
    before = save_checkpoint(out / "before", STEPS, trainer, {"position": STEPS})
    pending = start_checkpoint(out / "async", STEPS, trainer, {"position": STEPS},
                               background=dist.new_group(backend="gloo"))
    trainer.step(docs, sched)  # the weights move while the shards may still be written
    written = pending.finish()
    after = save_checkpoint(out / "after", STEPS + 1, trainer, {"position": STEPS + 1})
    want, got, moved = (shard_tensors(f, out / f"{f.parent.name}.pt") for f in (before, written, after))
    differ = sorted(k for k in want if k not in got or not torch.equal(want[k], got[k]))
    (out / "async.json").write_text(json.dumps({
        "tensors": len(want), "same_keys": sorted(want) == sorted(got), "differ": differ[:20],
        "differ_count": len(differ), "hold_after": sum(1 for k in differ if k in got and torch.equal(got[k], moved[k])),
        "step_changed": sum(1 for k in want if not torch.equal(want[k], moved[k]))}))


def shard_tensors(folder: Path, into: Path) -> dict:
    """The tensors of a checkpoint's DCP shards, by their flattened key (DCP's own reader, on CPU)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, into)
    flat: dict = {}

    def walk(prefix: str, x) -> None:  # noqa: ANN001
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(x, torch.Tensor):
            flat[prefix] = x

    walk("", torch.load(into, weights_only=False))
    return flat


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-runs")
    proc = launch(1, ["worker", str(out)], script=__file__, timeout=850, fresh=True)  # CUDA
    return out, proc


@pytest.mark.timeout(900)
def test_a_checkpoint_written_in_the_background_holds_the_state_it_was_started_with(gpu_runs):
    out, proc = gpu_runs
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    got = json.loads((out / "async.json").read_text())
    assert "error" not in got, got.get("error")
    assert got["tensors"] > 0 and got["step_changed"] > 0 and got["same_keys"]  # the step moved the weights
    assert got["differ_count"] == 0, f"written in the background unlike the state it was started with: {got}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_five_steps_on_the_gpu_match_the_cpu_reference(gpu_runs, dtype):
    """Steps with a document cut over micro-batches (carried keys and values), a recomputed layer and
    a selectively recomputed one, under the GPU defaults (compiled blocks, chunked loss, fused AdamW)."""
    out, proc = gpu_runs
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    got = json.loads((out / f"{dtype}.json").read_text())
    assert got["compiled"] and got["chunked"]
    want, _, _, _ = reference_training(make_steps(1, 1, steps=STEPS), replace(train_config(), max_steps=STEPS))
    tol = 2e-2 if dtype == "bf16" else 1e-4
    for step, (row, w) in enumerate(zip(got["rows"], want, strict=True)):
        assert abs(row["loss"] - w) <= tol * w, f"step {step + 1}: {row['loss']} on the GPU vs {w} on CPU"
        assert row["attention_kernel"] and row["microbatch_tokens"] == plan_of_one().microbatch_tokens
    if dtype == "bf16":
        assert got["rows"][-1]["attention_kernel"] != "sdpa"  # a kernel made for packed documents ran


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker(Path(sys.argv[2]))
