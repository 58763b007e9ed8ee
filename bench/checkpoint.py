"""Checkpoints written in the background (``train --async-checkpoint``) against written in the step's path.

One ``flexmesh train`` process (a Llama of 12 layers of 768, vocabulary 8192, fp32 weights and AdamW states: 1.1 GB
a checkpoint; two 256-token documents of the standard library a step) trains ``--steps`` steps with a checkpoint
every 2, once as checkpoints are written by default and once with ``--async-checkpoint``, from the same weights,
batches and tokenizer (built once before both). Per run, from its own wall-time line: the time in steps (the
first included) and in checkpoints (staging and publishing for the background ones, and the last checkpoint, which
is written before the run ends either way), the two together, and the median step time of the steps that ran while
a checkpoint was being written against the others; then whether both runs wrote the same model and optimizer shards
(their sha256). On this machine the writer threads share two cores and one memory bus with the step.

Run: ``OMP_NUM_THREADS=1 python -m bench.checkpoint [--steps 8] [--no-record]``
"""

from __future__ import annotations

import argparse
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
EVERY = 2
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 12, "hidden_size": 768,
          "num_attention_heads": 12, "num_key_value_heads": 12, "intermediate_size": 2048, "vocab_size": 8192,
          "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
          "torch_dtype": "float32"}


def _train(folder: Path, name: str, steps: int, extra: list[str]) -> dict:
    out = folder / name
    cmd = [sys.executable, "-m", "flexmesh", "train", "--model", str(folder / "config.json"), "--corpus", "stdlib",
           "--nproc", "1", "--global-batch", "2", "--seq-len", "256", "--max-steps", str(steps), "--checkpoint-every",
           str(EVERY), "--out", str(out), "--cache-dir", str(folder / "cache"), "--no-progress", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    wall = next(ln for ln in reversed(proc.stderr.splitlines()) if ln.startswith("wall time "))
    phases = {p.rsplit(" ", 2)[0]: float(p.rsplit(" ", 2)[1]) for p in wall.split(": ", 1)[1].split(", ")}
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    shards = {}
    for step in range(EVERY, steps + 1, EVERY):
        sums = json.loads((out / "checkpoints" / f"step_{step:06d}" / "manifest.json").read_text())["sha256"]
        shards[step] = {k: v for k, v in sums.items() if k.endswith(".distcp")}
    return {"phases": phases, "rows": rows, "shards": shards, "loss": rows[-1]["loss"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-record", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args(argv)
    runs = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="flexmesh-ckpt-") as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(CONFIG))
        _train(folder, "warm-up", 1, [])  # the tokenizer and the corpus cache, built once for both runs
        for name, extra in (("in the step's path", []), ("--async-checkpoint", ["--async-checkpoint"])):
            runs[name] = _train(folder, name, args.steps, extra)
            print(f"  {name} done", flush=True)
    table = []
    for name, r in runs.items():
        ph = r["phases"]
        steps_s = ph["first step"] + ph["steps"]
        # steps after a checkpoint step, before the next: the ones a background write ran beside
        beside = [x["step_time_s"] for x in r["rows"] if x["step"] % EVERY != 0 and x["step"] > EVERY]
        alone = [x["step_time_s"] for x in r["rows"] if x["step"] % EVERY == 0 or x["step"] < EVERY]
        table.append([name, f"{steps_s:.1f}", f"{ph['checkpoints']:.1f}", f"{steps_s + ph['checkpoints']:.1f}",
                      f"{np.median(beside):.2f}", f"{np.median(alone):.2f}", f"{r['loss']:.4f}"])
    sync, bg = runs["in the step's path"], runs["--async-checkpoint"]
    same = sync["shards"] == bg["shards"] and bool(sync["shards"])
    total = {n: r["phases"]["first step"] + r["phases"]["steps"] + r["phases"]["checkpoints"] for n, r in runs.items()}
    saved = 1 - total["--async-checkpoint"] / total["in the step's path"]
    lines = [f"One process (OMP_NUM_THREADS=1) on a {os.cpu_count()}-core machine, {args.steps} steps, a checkpoint "
             f"every {EVERY} (1.1 GB each; the last written before the run ends in both runs). Load average (1 min) "
             f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after.", ""]
    lines += markdown_table(["checkpoints written", "steps s", "checkpoints s", "steps + checkpoints s",
                             "median step s after a checkpoint's step", "median step s, the others", "last loss"],
                            table)
    lines += ["", f"Steps and checkpoints together: {saved:.1%} less time with --async-checkpoint. The model and "
                  f"optimizer shards of every checkpoint: {'byte for byte the same' if same else 'DIFFERENT'} in both "
                  f"runs (sha256) {'PASS' if same else 'FAIL'}."]
    body = "\n".join(lines)
    print(body)
    if not args.no_record:
        record("checkpoint", body, headline=f"--async-checkpoint: steps + checkpoints {saved:.1%} less time; "
                                            f"shards {'identical' if same else 'DIFFERENT'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
