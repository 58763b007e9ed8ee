"""This machine as a device: a CPU run planned for ``--cluster 2xlocal`` against the same run planned for a
device preset, predicted step against measured.

What a new user does on a laptop: ``flexmesh profile hardware --nproc 2`` and ``flexmesh profile model
--model tiny --nproc 2`` (each keeps a copy as this machine's profile), ``flexmesh plan --model tiny
--cluster 2xlocal``, then ``flexmesh train --nproc 2`` on that plan. Each step's prediction is the
trainer's (``predicted_step_time_s`` in metrics.jsonl: the step simulator on the schedule that ran,
priced by the plan's cluster); the measured step is ``step_time_s``. The same plan priced by a
datasheet preset (``--cluster 2xA100-80GB``, what a CPU run had to be planned for before) shows the
gap the local device closes. The profiles are taken by this run into a fresh cache folder
(``FLEXMESH_CACHE``), so nothing of an earlier run is reused; the first step is left out (warm-up).

    OMP_NUM_THREADS=1 python -m bench.local_device            # records "local_device" in bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit): it
# runs `flexmesh` commands, so the whole package.
DEPENDS_ON = ("flexmesh",)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET = 0.30  # the bound on the median |predicted - measured| / measured


def flexmesh(*args: str, env: dict) -> None:
    done = subprocess.run([sys.executable, "-m", "flexmesh", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"flexmesh {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def errors(rows: list[dict]) -> tuple[float, float, float]:
    """(median measured step s, median predicted step s, median |predicted - measured| / measured)."""
    timed = [r for r in rows[1:] if r.get("predicted_step_time_s")]
    return (statistics.median(r["step_time_s"] for r in timed),
            statistics.median(r["predicted_step_time_s"] for r in timed),
            statistics.median(abs(r["predicted_step_time_s"] - r["step_time_s"]) / r["step_time_s"] for r in timed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="flexmesh-local-"))
    env = dict(os.environ, FLEXMESH_CACHE=str(tmp / "cache"), OMP_NUM_THREADS="1")
    load = os.getloadavg()[0]
    flexmesh("profile", "hardware", "--quick", "--nproc", "2", "--out", str(tmp / "hw.json"), "--no-progress", env=env)
    flexmesh("profile", "model", "--model", "tiny", "--quick", "--nproc", "2", "--out", str(tmp / "mp.json"),
             "--no-progress", env=env)
    results = {}
    for label, cluster in (("local", "2xlocal"), ("preset", "2xA100-80GB")):
        plan = tmp / f"plan-{label}.json"
        flexmesh("plan", "--model", "tiny", "--cluster", cluster, "--seq-len", str(args.seq_len),
                 "--global-batch", str(args.global_batch), "--out", str(plan), env=env)
        run = tmp / f"run-{label}"
        # the same layout for both: the local plan's, so only the pricing differs
        layout = json.loads((tmp / "plan-local.json").read_text())
        layout["cluster"] = json.loads(plan.read_text())["cluster"]
        plan.write_text(json.dumps(layout))
        flexmesh("train", "--plan", str(plan), "--corpus", "stdlib", "--max-steps", str(args.steps), "--out", str(run),
                 "--nproc", "2", "--no-progress", "--policy", "fixed", "--straggler-threshold", "0.99", env=env)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        results[label] = (cluster, *errors(rows))
    after = os.getloadavg()[0]
    columns = ["plan's cluster", "measured step s", "predicted step s", "median abs error", f"<= {TARGET:.0%}"]
    table = [[c, f"{m:.3f}", f"{p:.4f}", f"{e:.1%}", ("PASS" if e <= TARGET else "FAIL") if label == "local" else "-"]
             for label, (c, m, p, e) in results.items()]  # the target is the local device's; the preset shows the gap
    from bench._results import markdown_table, record

    md = [f"`tiny` (fp32) on 2 processes of this machine (2 cores, gloo, OMP_NUM_THREADS=1), {args.steps} steps of "
          f"{args.global_batch} standard-library documents of at most {args.seq_len} tokens, policy fixed, one "
          "layout (the local plan's) priced two ways; profiles taken by this run (`--quick`, 2 processes). "
          "Error: median over the steps after the first of |predicted - measured| / measured.", "",
          *markdown_table(columns, table), "",
          f"- load average {load:.1f} before, {after:.1f} after (2 cores)",
          "Reproduce: `OMP_NUM_THREADS=1 python -m bench.local_device`"]
    print("\n".join(md))
    if not args.no_record:
        record("local_device", "\n".join(md), headline=", ".join(
            f"{c}: step predicted within {e:.1%}" for c, _, _, e in results.values()))


if __name__ == "__main__":
    main()
