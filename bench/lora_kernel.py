"""Many LoRA adapters in one forward: the grouped path against a per-adapter loop and against one adapter.

One adapted projection (flexmesh.runtime.model.lora.Adapters), forward and backward, over ``--tokens`` tokens
of ``--adapters`` tasks with uneven shares (a seeded draw), hidden ``--hidden`` -> ``--hidden``, rank
``--rank``; three ways:

- grouped: what the runtime runs (two ``torch._grouped_mm`` over the micro-batch's task runs)
- loop: the same adapters, one pair of ``F.linear`` per task run (the per-adapter loop)
- one LoRA: a single adapter over all the tokens (the floor: the same FLOPs, one task)

Median of ``--repeat`` timed runs of each, round-robin, after two warm-ups, on whichever device this
machine has (CUDA when present, in bf16 there; fp32 on CPU, one thread). A CPU figure says nothing
of a GPU's: there the loop pays a kernel launch per task and per pass, which is what grouping removes.

    OMP_NUM_THREADS=1 python -m bench.lora_kernel          # records "lora_kernel" in bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit).
DEPENDS_ON = ("flexmesh/runtime/model", "flexmesh/spec", "flexmesh/errors.py", "flexmesh/files.py",
              "flexmesh/inputs.py")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPEEDUP_TARGET = 3.0  # grouped >= 3x the per-adapter loop
OVERHEAD_TARGET = 1.3  # grouped <= 1.3x one LoRA over the same tokens


def shares(tokens: int, adapters: int, seed: int = 0) -> list[int]:
    """Uneven tokens per adapter summing to ``tokens`` (each at least 1)."""
    import numpy as np

    w = np.random.default_rng(seed).pareto(1.2, adapters) + 0.05
    n = np.maximum(1, np.floor(w / w.sum() * tokens).astype(int))
    n[np.argmax(n)] += tokens - n.sum()
    return [int(x) for x in n]


def timed(fns: dict, repeat: int, sync) -> dict[str, float]:  # noqa: ANN001
    """Median seconds of each of ``fns``, run round-robin (so that a machine's drift touches all alike)."""
    for fn in fns.values():
        fn()
        fn()
    sync()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            sync()
            out[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in out.items()}


def main() -> None:
    import torch

    from flexmesh.runtime.model.grouped import grouped_kernel_ok
    from flexmesh.runtime.model.lora import AdapterRow, Adapters
    from flexmesh.spec.tasks import Task, TaskSet

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    counts = shares(args.tokens, args.adapters)

    def task_set(n: int) -> TaskSet:
        return TaskSet(tuple(Task(name=f"t{i}", rank=args.rank, alpha=2.0 * args.rank, targets=("q_proj",))
                             for i in range(n)))

    def module(n: int) -> Adapters:
        m = Adapters(args.hidden, args.hidden, task_set(n), "q_proj", device)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0.0, 0.02)
        return m

    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype)
    many, one = module(args.adapters), module(1)
    many_row = AdapterRow.of([(i, n) for i, n in enumerate(counts)], device)
    one_row = AdapterRow.of([(0, args.tokens)], device)

    def run(m: Adapters, row: AdapterRow, loop: bool) -> None:
        m.loop = loop
        m(x, row).backward(grad)

    # the paths agree before they are timed
    many.loop = True
    want = many(x, many_row)
    many.loop = False
    torch.testing.assert_close(many(x, many_row), want, rtol=2e-2 if cuda else 1e-5, atol=1e-3 if cuda else 1e-6)
    t = timed({"grouped": lambda: run(many, many_row, False), "loop": lambda: run(many, many_row, True),
               "one": lambda: run(one, one_row, False)}, args.repeat, sync)
    t_grouped, t_loop, t_one = t["grouped"], t["loop"], t["one"]
    grouped = grouped_kernel_ok(x, args.rank, args.hidden)
    kernel = "torch._grouped_mm" if grouped else "per-run matmuls (no grouped kernel)"
    speedup, overhead = t_loop / t_grouped, t_grouped / t_one
    from bench._results import markdown_table, record

    name = torch.cuda.get_device_name() if cuda else "CPU, 1 thread"
    rows = [["grouped (runtime)", f"{t_grouped * 1e3:.2f}", "1.00", f"{overhead:.2f}"],
            ["per-adapter loop", f"{t_loop * 1e3:.2f}", f"{t_loop / t_grouped:.2f}", f"{t_loop / t_one:.2f}"],
            ["one LoRA", f"{t_one * 1e3:.2f}", f"{t_one / t_grouped:.2f}", "1.00"]]
    md = [f"One adapted {args.hidden} -> {args.hidden} projection, forward + backward, {args.tokens} tokens of "
          f"{args.adapters} adapters of rank {args.rank} (tokens per adapter {counts}), {name}, "
          f"{str(dtype).removeprefix('torch.')}; grouped kernel: {kernel}. Median of {args.repeat} runs.", "",
          *markdown_table(["path", "ms", "x grouped", "x one LoRA"], rows), "",
          f"- grouped vs loop: {speedup:.2f}x (target >= {SPEEDUP_TARGET:g}x: "
          f"{'PASS' if speedup >= SPEEDUP_TARGET else 'FAIL'})",
          f"- grouped vs one LoRA: {overhead:.2f}x (target <= {OVERHEAD_TARGET:g}x: "
          f"{'PASS' if overhead <= OVERHEAD_TARGET else 'FAIL'})",
          "Reproduce: `OMP_NUM_THREADS=1 python -m bench.lora_kernel`"]
    print("\n".join(md))
    if not args.no_record:
        record("lora_kernel" if not cuda else "lora_kernel-gpu", "\n".join(md), script="lora_kernel",
               headline=f"grouped {speedup:.2f}x the per-adapter loop, {overhead:.2f}x one LoRA", gpu=cuda)


if __name__ == "__main__":
    main()
