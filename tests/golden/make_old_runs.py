"""Runs of `flexmesh train` written by flexmesh at commit fde2c13, before the plan types merged: a
version-2 plan (ZeRO-2 over 2 ranks) and a version-3 plan (two replicas of one rank each), each trained
2 steps with a checkpoint at step 2, and 3 steps straight for the losses a resume must continue with.

tests/test_resume_old_runs.py resumes them with today's code. Re-make them on that commit (the script is
not part of fde2c13: copy it into the worktree's root first):

    git worktree add /tmp/x fde2c13
    cp tests/golden/make_old_runs.py /tmp/x/
    cd /tmp/x; PYTHONPATH=. OMP_NUM_THREADS=1 python3 make_old_runs.py OUTDIR

OUTDIR/<name>/ holds config.json (the model, named by its relative path in the plan, so the folder
moves), corpus/, plan.json (as that commit wrote it), run/ (metrics.jsonl, checkpoints/step_000002) and
straight.jsonl (the 3-step run's metrics). The tokenizer cache is not kept: it is trained again,
deterministically, from the same corpus.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

RUNS = {
    "v2-zero2": {"version": 2, "model": "config.json", "cluster": "2xA100-80GB", "world_size": 2, "pp": 1,
                 "pipeline_schedule": "1f1b", "virtual_stages": 1, "num_microbatches": 1, "seq_len": 128,
                 "global_batch": 4, "stages": [{"layers": [0, 2], "strategies": ["tp1-dp2z2", "tp1-dp2z2"]}]},
    "v3-replicas": {"version": 3, "model": "config.json", "cluster": "2xA100-80GB", "world_size": 2, "seq_len": 128,
                    "global_batch": 4, "pipeline_schedule": "1f1b", "unused": [],
                    "replicas": [{"batch": 2, "num_microbatches": 1, "stages": [
                                     {"layers": [0, 2], "devices": [0], "recompute": "none"}]},
                                 {"batch": 2, "num_microbatches": 2, "stages": [
                                     {"layers": [0, 2], "devices": [1], "recompute": "full"}]}]},
}
TRAIN = ["--nproc", "2", "--corpus", "corpus", "--checkpoint-every", "2", "--no-progress", "--lr", "1e-3",
         "--min-lr-ratio", "1"]  # a flat learning rate: the same whatever --max-steps


def train(folder: Path, out: str, steps: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "flexmesh", "train", "--plan", "plan.json", "--out", out,
                           "--cache-dir", "cache", "--max-steps", str(steps), *TRAIN], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"train {folder.name} {out} failed:\n{proc.stderr[-3000:]}")


def main(outdir: Path) -> None:
    from helpers import write_inputs

    for name, plan in RUNS.items():
        folder = outdir / name
        folder.mkdir(parents=True)
        write_inputs(folder, world=2)  # config.json and corpus/ (and a plan of its own, replaced here)
        (folder / "plan.json").write_text(json.dumps(plan))
        train(folder, "run", 2)
        train(folder, "straight", 3)
        shutil.copy(folder / "straight" / "metrics.jsonl", folder / "straight.jsonl")
        for extra in ("straight", "cache"):
            shutil.rmtree(folder / extra)
        print(f"{name}: {sum(f.stat().st_size for f in folder.rglob('*') if f.is_file()) / 1e6:.1f} MB")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
