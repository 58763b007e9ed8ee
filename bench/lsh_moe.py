"""Compressed expert all-to-all (LSH-MoE, arXiv 2411.08446): measured on ``tiny-moe``, priced on the paper's settings.

Measured: ``tiny-moe`` (4 layers, hidden 256, 8 experts top 2) trains ``--steps`` steps of 8 standard-library files
of up to 512 tokens on two processes (its experts sharded over both: every token crosses the all-to-all), from the
same weights and batches, uncompressed and with ``--expert-lsh`` at two settings: the paper's six hash functions
(one rotated dimension each: 64 buckets) and flexmesh's default (one hash of 16 dimensions: 32 buckets). Per run: the
rows the token all-to-alls carried over the routed pairs (``expert_a2a_ratio``, the bytes' share) and the mean loss of
the last 20 steps against the uncompressed run's. Targets (#81): bytes <= 30% of uncompressed, loss within 1%.

Priced: the cost model's step with the all-to-all's bytes at the paper's compression (about 20% of the traffic with
six hashes, its section 4.4) against uncompressed, on the paper's models and clusters (its Table 1 and section 4.1):
RoBERTa-MoE and GPT-MoE 15B on 2 x 8 V100 (100 Gb/s between nodes), T5-MoE on 4 x 8 A100-40GB (200 Gb/s). The
paper does not give sequence length or batch: 512-token sequences, 16 per GPU per step (8 for T5-MoE), experts
over every GPU (expert parallelism, top 2, MoE in every other layer), SwiGLU experts of two thirds the width (the
FLOPs of its two-matrix FFN). Beside each: the paper's measured end-to-end speedup and all-to-all share of the step.

Run: ``OMP_NUM_THREADS=1 python -m bench.lsh_moe [--steps 200] [--no-record]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench._results import markdown_table, record

DEPENDS_ON = ("flexmesh/runtime", "flexmesh/cost", "flexmesh/layout", "flexmesh/spec", "flexmesh/data",
              "flexmesh/commands", "flexmesh/units.py", "flexmesh/errors.py", "flexmesh/files.py", "flexmesh/inputs.py")
SETTINGS = {"uncompressed": None, "paper: 6 hashes x 1 dim": "1x6", "default: 1 hash x 16 dims": "16x1"}
BYTES_TARGET, LOSS_TARGET = 0.30, 0.01
# (name, layers, hidden, two-matrix ffn, experts, vocab, cluster, sequences per GPU, published speedup,
# published all-to-all share of the step) -- LSH-MoE Table 1, section 4.1, Figures 1 and 6-8
PAPER = (("RoBERTa-MoE", 12, 768, 3072, 16, 50265, "2x8xV100-32GB", 12.5, 16, "1.6x", "40%"),
         ("GPT-MoE 15B", 12, 768, 3072, 512, 50257, "2x8xV100-32GB", 12.5, 16, "1.3-1.4x", "30%"),
         ("T5-MoE", 16, 1024, 16384, 16, 32128, "4x8xA100-40GB", 25.0, 8, "2.2x", "-"))
PAPER_COMPRESSION = 0.2


def measured(steps: int) -> tuple[list[list], list[list], str]:
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    runs = {}
    with tempfile.TemporaryDirectory(prefix="flexmesh-lsh-") as tmp:
        folder = Path(tmp)
        st = StagePlan(0, 4, (LayerStrategy.parse("tp1-dp2z2"),) * 4)
        Plan.uniform(model="tiny-moe", cluster="2xA100-80GB", world_size=2, pp=1, pipeline_schedule="1f1b",
                     num_microbatches=1, seq_len=512, global_batch=8, stages=(st,)).save(folder / "plan.json")
        for name, lsh in SETTINGS.items():
            out = folder / name.split(":")[0]
            cmd = [sys.executable, "-m", "flexmesh", "train", "--plan", str(folder / "plan.json"), "--corpus",
                   "stdlib", "--max-steps", str(steps), "--nproc", "2", "--out", str(out), "--no-progress",
                   "--lr", "1e-3", "--cache-dir", str(folder / "cache"), *(["--expert-lsh", lsh] if lsh else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
            runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            print(f"  {name} done", flush=True)
    base = float(np.mean([r["loss"] for r in runs["uncompressed"][-20:]]))
    rows, checks = [], []
    for name, lsh in SETTINGS.items():
        loss = float(np.mean([r["loss"] for r in runs[name][-20:]]))
        ratio = float(np.mean([r["expert_a2a_ratio"] for r in runs[name]]))
        secs = float(np.median([r["step_time_s"] for r in runs[name][5:]]))
        rows.append([name, lsh or "-", f"{ratio:.1%}", f"{loss:.4f}", f"{(loss - base) / base:+.2%}", f"{secs:.3f}"])
        if lsh:
            checks.append([name, "all-to-all rows / routed pairs", f"<= {BYTES_TARGET:.0%}", f"{ratio:.1%}",
                           "PASS" if ratio <= BYTES_TARGET else "FAIL"])
            off = (loss - base) / base
            checks.append([name, f"loss of the last 20 of {steps} steps vs uncompressed", f"within {LOSS_TARGET:.0%}",
                           f"{off:+.2%}", "PASS" if abs(off) <= LOSS_TARGET else "FAIL"])
    return rows, checks, f"{steps} steps"


def priced() -> list[list]:
    from flexmesh.cost.training.experts import ExpertParallel
    from flexmesh.cost.training.model import CostModel
    from flexmesh.cost.training.parts import Parts
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.spec.cluster import parse_cluster
    from flexmesh.spec.model import ModelSpec
    from flexmesh.spec.moe import MoESpec

    rows = []
    for name, layers, h, ffn, e, vocab, cluster_name, net, seqs, speedup, share in PAPER:
        cluster = parse_cluster(cluster_name)
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, node_net_gbps=net))
        world = cluster.world_size
        swiglu = 2 * ffn // 3
        spec = ModelSpec(name=name, num_layers=layers, hidden=h, num_heads=h // 64, num_kv_heads=h // 64,
                         ffn_hidden=swiglu, vocab=vocab, max_position=512, dtype="fp16",
                         moe=MoESpec(e, 2, swiglu, dense_layers=tuple(range(0, layers, 2))))
        s = LayerStrategy.parse(f"tp1-dp{world}z1")
        times = {}
        for label, lsh in (("plain", None), ("lsh", (1, 6))):
            experts = ExpertParallel("static", ep=min(e, world), imbalance=1.0, lsh=lsh,
                                     compression=PAPER_COMPRESSION if lsh else None)
            cm = CostModel(spec, cluster, parts=Parts(experts=experts))
            times[label] = cm.evaluate_stages([[s] * layers], 1, "1f1b", 1, 1, seqs, 512).step_time
        rows.append([name, cluster_name.replace("x", " x ", 2), f"{times['plain']:.3f}", f"{times['lsh']:.3f}",
                     f"{times['plain'] / times['lsh']:.2f}x", speedup, share])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--no-record", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args(argv)
    rows, checks, what = measured(args.steps)
    lines = [f"Measured on tiny-moe, {what}, two processes on two cores (OMP_NUM_THREADS=1):", ""]
    lines += markdown_table(["run", "--expert-lsh", "all-to-all rows / pairs", "loss (last 20 steps)",
                             "vs uncompressed", "median step s"], rows)
    lines += ["", *markdown_table(["run", "check", "target", "measured", ""], checks)]
    lines += ["", f"Priced by the cost model at the paper's compression ({PAPER_COMPRESSION:.0%} of the tokens' "
                  "all-to-all), beside the paper's measured speedup and all-to-all share:", ""]
    lines += markdown_table(["model", "cluster", "step s, uncompressed", "step s, LSH", "predicted speedup",
                             "published speedup", "published all-to-all share"], priced())
    body = "\n".join(lines)
    print(body)
    if not args.no_record:
        ratio = [c for c in checks if c[1].startswith("all-to-all")]
        record("lsh_moe", body, headline="; ".join(f"{c[0].split(':')[0]} {c[3]} of the bytes" for c in ratio))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
