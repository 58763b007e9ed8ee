"""The runtime's attention kernel against the cost model's price for it, forward and backward.

FlashAttention-3's benchmark shape (2407.08608, section 4.1): causal attention, hidden 2048 (16 heads of
dim 128, or 32 of dim 64), 16,384 tokens per call as documents of one length from 512 to 16,384 (here
packed in one row, as the runtime packs them: :func:`flexmesh.runtime.model.attention_kernels.local_attention`
with the kernel its rule picks for the device and dtype). Forward FLOPs are the cost model's,
``layer_attn_flops_per_sq_token * sum(len^2)`` (``4 s^2 h d / 2``, the paper's count); the backward is
priced at twice the forward's FLOPs (:meth:`flexmesh.cost.training.analytic.AnalyticTiming.attention_times`), so
its TFLOP/s below counts 2x (the paper counts 2.5x: its backward figures are 1.25x these).

Predicted: one layer's attention priced by the cost model on this GPU's device preset (``--cluster``;
default :func:`flexmesh.spec.devices.preset_of_gpu`'s, 1xA100-80GB on CPU), as two stacks run it:
``fused``, the fastest fused kernel the measured tables price (FlashAttention-3-class on Hopper), and
``flash2``, the runtime's (flexmesh.cost.device.flash2: on Hopper fitted to this bench's H200 run of 2026-11-26,
so in-sample there). measured / predicted is how much slower the kernel the runtime runs is than priced.
Median of ``--repeat`` CUDA-synchronised runs after two warm-ups.

    python -m bench.attention_kernel            # on a CUDA machine; records "attention_kernel"
    python -m bench.attention_kernel --cpu --no-record   # small shapes on CPU (tests/test_flash2.py)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit).
DEPENDS_ON = ("flexmesh/runtime/model", "flexmesh/cost", "flexmesh/layout", "flexmesh/spec", "flexmesh/errors.py",
              "flexmesh/files.py", "flexmesh/inputs.py", "flexmesh/units.py")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GPU_SHAPE = {"hidden": 2048, "tokens": 16384, "lengths": [512, 1024, 2048, 4096, 8192, 16384],
             "head_dims": [64, 128]}
CPU_SHAPE = {"hidden": 128, "tokens": 512, "lengths": [128, 256, 512], "head_dims": [32, 64]}


def priced(hidden: int, head_dim: int, length: int, tokens: int, cluster: str, attention: str) -> tuple[float, float]:
    """The cost model's (forward, backward) seconds of one layer's attention over ``tokens`` tokens
    of documents of ``length``, as a stack of ``attention`` kernels runs it."""
    from flexmesh.cost import CostModel
    from flexmesh.cost.training.analytic import AnalyticTiming
    from flexmesh.cost.training.parts import Parts
    from flexmesh.layout.stack import Stack
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.spec.cluster import parse_cluster
    from flexmesh.spec.model import MODEL_PRESETS

    heads = hidden // head_dim
    spec = replace(MODEL_PRESETS["tinyllama-1.1b"], hidden=hidden, num_heads=heads, num_kv_heads=heads,
                   max_position=max(length, 4096), dtype="bf16")
    timing = CostModel(spec, parse_cluster(cluster), parts=Parts(stack=Stack(attention=attention))).timing
    assert isinstance(timing, AnalyticTiming)
    fwd, bwd = timing.attention_times(LayerStrategy(), float(tokens), float(tokens // length * length**2))
    return float(fwd), float(bwd)


def measure(hidden: int, head_dim: int, length: int, tokens: int, repeat: int, device, dtype):  # noqa: ANN001
    """Median (forward, forward + backward) seconds of the runtime's kernel; and the kernel's name."""
    import torch

    from flexmesh.runtime.model.attention_kernels import local_attention, select_kernel

    heads = hidden // head_dim
    q, k, v = (torch.randn(1, heads, tokens, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32, device=device)
    grad = torch.randn(1, heads, tokens, head_dim, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def forward() -> None:
        with torch.no_grad():
            local_attention(q, k, v, cu)

    def both() -> None:
        local_attention(q, k, v, cu).backward(grad)

    out = []
    for fn in (forward, both):
        fn()
        fn()
        sync()
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        out.append(statistics.median(times))
    return out[0], out[1], select_kernel(device.type, dtype, None, head_dim).name


def main() -> None:
    import torch

    from flexmesh.spec.devices import preset_of_gpu

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="small shapes on CPU, fp32 (what the test suite runs)")
    ap.add_argument("--cluster", default=None, help="one-device preset that prices it (default: the GPU's family)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.cpu
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = GPU_SHAPE if cuda else CPU_SHAPE
    name = torch.cuda.get_device_name() if cuda else "CPU"
    cluster = a.cluster or f"1x{preset_of_gpu(name) or 'A100-80GB'}"
    stacks = ("fused", "flash2")
    rows: list[list] = []
    ratios: dict[tuple[str, str], list[float]] = {(k, p): [] for k in stacks for p in ("fwd", "bwd")}
    for d in shape["head_dims"]:
        for length in shape["lengths"]:
            fwd, both, kernel = measure(shape["hidden"], d, length, shape["tokens"], a.repeat, device, dtype)
            bwd = max(both - fwd, 1e-12)
            flops = 2 * shape["hidden"] * (shape["tokens"] // length) * length**2  # forward, cost model's count
            row = [d, f"{length:,}", kernel, f"{fwd * 1e3:.3f}", f"{bwd * 1e3:.3f}",
                   f"{flops / fwd / 1e12:.1f}", f"{2 * flops / bwd / 1e12:.1f}"]
            for stack in stacks:
                p_fwd, p_bwd = priced(shape["hidden"], d, length, shape["tokens"], cluster, stack)
                ratios[stack, "fwd"].append(fwd / p_fwd)
                ratios[stack, "bwd"].append(bwd / p_bwd)
                row += [f"{fwd / p_fwd:.2f}", f"{bwd / p_bwd:.2f}"]
            rows.append(row)
            print(*rows[-1], flush=True)
    from bench._results import markdown_table, record

    med = {k: statistics.median(v) for k, v in ratios.items()}
    worst = {k: max(v, key=lambda r: abs(r - 1.0)) for k, v in ratios.items()}
    md = [f"The runtime's attention kernel on {name}, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}: "
          f"causal, hidden {shape['hidden']}, {shape['tokens']:,} tokens per call packed as documents of one length; "
          f"median of {a.repeat} runs. Predicted: the cost model on {cluster}, as a `fused` stack (the tables' "
          "fastest kernel) and a `flash2` stack (the runtime's) run it. TFLOP/s count the forward's FLOPs and "
          "twice them for the backward, as the cost model does.", "",
          *markdown_table(["head dim", "doc length", "kernel", "fwd ms", "bwd ms", "fwd TFLOP/s", "bwd TFLOP/s",
                           "fwd / fused", "bwd / fused", "fwd / flash2", "bwd / flash2"], rows), "",
          *(f"- measured / {k} price: forward median {med[k, 'fwd']:.2f}x (farthest {worst[k, 'fwd']:.2f}x), "
            f"backward median {med[k, 'bwd']:.2f}x (farthest {worst[k, 'bwd']:.2f}x)" for k in stacks),
          f"Reproduce: `python -m bench.attention_kernel{' --cpu' if not cuda else ''}`"]
    print("\n".join(md))
    if not a.no_record:
        record("attention_kernel" if cuda else "attention_kernel-cpu", "\n".join(md), script="attention_kernel",
               headline="measured / price, forward and backward medians: " + "; ".join(
                   f"{k} {med[k, 'fwd']:.2f}x, {med[k, 'bwd']:.2f}x" for k in stacks), gpu=cuda)


if __name__ == "__main__":
    main()
