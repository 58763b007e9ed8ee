"""torchtitan's side of ``bench/gpu.py``: its own Llama3 model at the bench's shape, trained on the same steps.

``torchtitan_worker(a)`` takes the namespace of a ``bench.gpu`` worker (``cpu``, ``case``, ``steps``,
``compile``) and returns the same dict as ``bench.gpu.transformers_worker``, plus ``version`` and
``config``. What runs, at world size 1:

- model: ``torchtitan.models.llama3.Llama3Model`` built from torchtitan's own layer builder with the bench
  spec's shape (TinyLlama-1.1B on a GPU: 22 layers, hidden 2048, 32 q / 4 kv heads, FFN 5632, vocabulary
  32,000, RoPE theta 10,000 without scaling, RMSNorm eps 1e-5, untied head), built on the meta device and
  initialised by its ``init_weights`` (torchtitan's initialisation, not the bench's shared weights: the
  step-1 loss differs from the other systems');
- attention: torchtitan 0.3.0's default, FlexAttention with its causal packed-document mask built from
  per-document positions (0.3.0 no longer offers plain SDPA causal attention for language models; the
  ``varlen`` backend is the other choice and is not used); each micro-batch is one row of
  ``case.microbatch_tokens`` tokens, its documents packed as the ``fixed`` policy packs them, labels
  the next token within each document;
- compile (``--compile``, the default on a GPU): torchtitan's ``apply_compile`` (each TransformerBlock
  compiled, ``fullgraph=True``), and its loss compiled as its trainer compiles it;
- precision: bf16 ``torch.autocast`` over fp32 weights on a GPU (fp32 on CPU). torchtitan's trainer at
  world size 1 would wrap the model in FSDP2 with a bf16-parameter MixedPrecisionPolicy instead; that
  path needs its process-group and mesh setup and is not what runs here;
- loss: torchtitan's ``CrossEntropyLoss`` (sum over label tokens) divided by the step's label tokens,
  gradients accumulated over the micro-batches; AdamW (fused on CUDA, lr 1e-4, betas 0.9/0.95, weight
  decay 0.1), gradient norm clipped to 1.0 by ``torch.nn.utils.clip_grad_norm_``; no activation
  checkpointing, no CUDA graphs;
- torch: torchtitan 0.3.0 is written against a newer torch than 2.11; ``torch_shims`` bridges the two names
  it needs there (an FSDP import it never calls at world size 1, and a ``create_block_mask`` keyword whose
  value is the older torch's behaviour) and the result's ``torch_shims`` lists what was bridged. On CPU,
  where FlexAttention has no backward, ``dense_flex_on_cpu`` runs SDPA under the same mask instead.

Measured once on one NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, compiled, 6 / 4 steps): 2048 case 0.533 s a
step after the first (61,500 tokens/s, first step 46 s, peak 30.2 GiB); 8192 case 0.762 s (43,000 tokens/s).

Wheels the imports need beyond torch, triton, safetensors, tokenizers, pillow (pure Python, Python >= 3.11):
torchtitan==0.3.0, spmd_types==0.2.3, tyro==1.0.17, docstring-parser==0.18.0, typeguard==4.6.1. Fetch
them with::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1

and install them without dependencies (``pip install --no-deps .whl/*.whl``, or ``--target DIR`` and
``PYTHONPATH=DIR``) so that no other torch is pulled. Then::

    python -m bench.gpu_torchtitan --case 2048 --steps 10 --out titan.json   # one GPU
    python -m bench.gpu_torchtitan --cpu --case 256 --steps 3 --out X.json   # the tiny model on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_case import (  # noqa: E402
    case_of,
    device_of,
    make_plan,
    make_steps,
    model_spec,
    schedules,
    sync,
    traced_step,
)


def torch_shims() -> list[str]:
    """Bridges from torchtitan 0.3.0 (written against a newer torch) to an older installed torch, each used only
    where that torch lacks the name, and reported in the result:

    - ``torch.distributed.fsdp.DataParallelMeshDims`` (torch 2.11 lacks it) is bound to a placeholder so that
      torchtitan imports: only its FSDP wrapping reads it, which world size 1 here never calls;
    - ``create_block_mask(..., separate_full_blocks=True)``: a torch without that keyword always separates the
      full blocks, so torchtitan's compiled mask builder is given one that drops it (a value of False, which
      torchtitan passes only in its batch-invariant mode, is refused)."""
    import inspect

    import torch
    import torch.distributed.fsdp as fsdp
    from torch.nn.attention.flex_attention import create_block_mask

    bound = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})  # never instantiated here
        bound.append("torch.distributed.fsdp.DataParallelMeshDims (placeholder)")
    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        import torchtitan.models.common.attention as attention

        def block_mask(*args, separate_full_blocks: bool = True, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if not separate_full_blocks:
                raise NotImplementedError("this torch's create_block_mask always separates full blocks")
            return create_block_mask(*args, **kwargs)

        attention._compiled_create_block_mask = torch.compile(block_mask)
        bound.append("create_block_mask without separate_full_blocks (always separated)")
    return bound


def build_model(spec, seq_len: int):  # noqa: ANN001, ANN201
    """torchtitan's Llama3Model of ``spec``'s shape, on the meta device (``init_weights`` after ``to_empty``)."""
    import torch
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3.model import Llama3Model

    dim, heads = spec.hidden, spec.num_heads
    layers = _build_llama3_layers(
        n_layers=spec.num_layers, dim=dim, n_heads=heads, n_kv_heads=spec.num_kv_heads,
        hidden_dim=spec.ffn_hidden, fuse_qkv=True, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=seq_len, theta=spec.rope_theta, scaling="none"))
    for layer in layers:  # the builder leaves eps at RMSNorm's default; set the spec's
        layer.attention_norm.eps = layer.ffn_norm.eps = spec.norm_eps
    config = Llama3Model.Config(
        dim=dim, vocab_size=spec.vocab, enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=spec.vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=spec.norm_eps, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=spec.vocab, param_init=_output_linear_init(dim)),
        layers=layers)
    with torch.device("meta"):
        return config.build()


def pack_row(docs, mb, width: int):  # noqa: ANN001, ANN201
    """One micro-batch as torchtitan's loader shapes it: a row of ``width`` tokens, positions restarting at 0 at
    each document (what its packed-document mask and RoPE read), labels the next token within the document
    (-100 at each document's last token and in the padding)."""
    import numpy as np
    import torch

    from flexmesh.runtime.model.packing import IGNORE_INDEX

    ids = np.zeros(width, dtype=np.int64)
    labels = np.full(width, IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros(width, dtype=np.int64)  # padding: one-token documents that nothing attends across
    at = 0
    for p in mb:
        d = docs[p.seq_id][p.start:p.end]
        n = len(d)
        ids[at:at + n] = d
        labels[at:at + n - 1] = d[1:]
        positions[at:at + n] = np.arange(n)
        at += n
    if at > width:
        raise ValueError(f"a micro-batch of {at} tokens does not fit a row of {width}: raise the case's "
                         "microbatch_tokens")
    return (torch.from_numpy(ids)[None], torch.from_numpy(labels)[None], torch.from_numpy(positions)[None])


@contextlib.contextmanager
def dense_flex_on_cpu():  # noqa: ANN201
    """FlexAttention has no backward on CPU: inside this block its kernel is SDPA under the same mask made dense
    (``create_mask`` over the BlockMask's ``mask_mod``), so that the rest of a CPU run is torchtitan's code. A
    stand-in written here because torch offers no CPU backward for flex_attention; never used on a GPU."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.models.common.attention import FlexAttention

    def dense(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):  # noqa: ANN001, ANN202
        if score_mod is not None or return_aux.lse:
            raise NotImplementedError("the CPU stand-in for FlexAttention takes a mask only")
        mask = create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), None

    original = FlexAttention.__dict__["compiled_flex_attn"]
    FlexAttention.compiled_flex_attn = staticmethod(dense)
    try:
        yield
    finally:
        FlexAttention.compiled_flex_attn = original


def train(model, loss_fn, opt, steps_docs, steps, width: int, device) -> list[dict]:  # noqa: ANN001
    """The steps as torchtitan's trainer runs them at world size 1: per micro-batch its block mask from the
    positions, forward and summed loss over the step's label tokens, backward; then clip, AdamW, zero."""
    import torch

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    rows = []
    for docs, schedule in zip(steps_docs, steps):
        mbs = schedule.groups[0].microbatches
        batches = [pack_row(docs, mb, width) for mb in mbs]
        sync(device)
        t0 = time.perf_counter()
        label_tokens = sum(int((labels != -100).sum()) for _, labels, _ in batches)
        global_valid = torch.tensor(label_tokens, device=device)
        total = torch.zeros((), device=device)
        for ids, labels, positions in batches:
            ids, labels, positions = ids.to(device), labels.to(device), positions.to(device)
            masks = model.get_attention_masks(positions=positions)
            with autocast:
                pred = model(ids, positions=positions, attention_masks=masks)
                loss, _ = loss_fn(pred, labels, global_valid)
            del pred
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = float(total)
        sync(device)
        rows.append({"time_s": time.perf_counter() - t0, "tokens": sum(len(d) for d in docs), "loss": loss_value,
                     "microbatches": len(mbs)})
    return rows


def torchtitan_worker(a: argparse.Namespace) -> dict:
    import importlib.metadata

    import torch

    shims = torch_shims()
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.parallel_dims import ParallelDims

    spec, case = model_spec(a.cpu), case_of(a)
    device = device_of(a.cpu)
    compile_ = (device.type == "cuda") if a.compile is None else bool(a.compile)
    plan = make_plan(spec, case, "1xA100-80GB")
    steps_docs = make_steps(spec, case, a.steps)
    steps = schedules(spec, plan, steps_docs, case.doc_len)
    width = case.microbatch_tokens
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(spec, width)
    compile_config = CompileConfig(enable=compile_, components=["model", "loss"])
    if compile_:
        apply_compile(model, compile_config=compile_config,
                      parallel_dims=ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1))
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=spec.vocab), compile_config=compile_config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    setup = time.perf_counter() - t0
    with dense_flex_on_cpu() if device.type == "cpu" else contextlib.nullcontext():
        rows = train(model, loss_fn, opt, steps_docs, steps, width, device)
        # one more step (the last step's documents again) under the profiler, as bench.gpu --trace does flexmesh's
        trace = traced_step(lambda: train(model, loss_fn, opt, steps_docs[-1:], steps[-1:], width, device),
                            device.type) if getattr(a, "trace", False) else None
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    precision = "bf16 autocast over fp32 weights" if device.type == "cuda" else "fp32"
    config = (f"Llama3Model {spec.num_layers}x{spec.hidden} ({spec.num_heads}q/{spec.num_kv_heads}kv, ffn "
              f"{spec.ffn_hidden}, vocab {spec.vocab}), rows of {width} tokens, flex block-causal per document, "
              f"{precision}, {'apply_compile per block + loss' if compile_ else 'eager'}, fused AdamW"
              f"{'' if device.type == 'cuda' else ' (unfused on CPU)'}, clip 1.0; torchtitan's own init "
              "(step-1 loss not comparable)")
    kernel = "flex (document mask)" if device.type == "cuda" else "sdpa, flex's mask made dense (CPU)"
    return {"setup_s": setup, "steps": rows, "kernel": kernel, "compiled": compile_,
            "predicted": {}, "device": torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
            "peak_gib": peak, "version": importlib.metadata.version("torchtitan"), "config": config,
            "init": "torchtitan init_weights (differs from the shared safetensors)", "torch_shims": shims,
            **({"trace": trace} if trace else {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the tiny model on CPU (bench.gpu's CPU cases)")
    p.add_argument("--case", default=None, help="a bench.gpu case name (default: 2048 on a GPU, 256 on CPU)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torchtitan's per-block compile (default: on a GPU only)")
    p.add_argument("--out", required=True, help="write the result here as JSON")
    a = p.parse_args()
    if a.case is None:
        a.case = "256" if a.cpu else "2048"
    Path(a.out).write_text(json.dumps(torchtitan_worker(a)))


if __name__ == "__main__":
    main()
