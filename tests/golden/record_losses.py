"""Golden per-step losses of the multi-process runtime tests, recorded at commit fde2c13 (before the plan
types merged: uniform ``Plan`` and heterogeneous ``HeteroPlan`` / groups-v3 plans still separate).

Re-run it on that commit (the script is not part of fde2c13: copy it into the worktree's root first):

    git worktree add /tmp/x fde2c13
    cp tests/golden/record_losses.py /tmp/x/
    cd /tmp/x; PYTHONPATH=. OMP_NUM_THREADS=1 python3 record_losses.py OUTFILE

It launches the torchrun workers of three test files exactly as their tests do, through the test
modules' own functions (same world sizes, case names, documents, seeds and schedules), and collects
what the workers write:

- ``runtime_parallel``: tests/test_runtime_parallel.py, every layout of LAYOUTS, one launch per world
  size (2 and 4) via ``run_layouts``; the worker's rank 0 writes ``OUT/<layout>/result.json``
  ``{"losses": [...], "layout": ..., "weights_loss": float}``. ``weights_loss`` (the first step's loss
  of a model loaded from Hugging Face safetensors) is one number per layout, kept under
  ``weights_loss.runtime_parallel``.
- ``groups_v3``: tests/test_hetero_runtime.py, every plan of PLANS, one launch per world size (3 and 4)
  via ``_run``; rank 0 writes ``OUT/<plan>/result.json`` ``{"losses": [...]}``.
- ``adaptive``: tests/test_adaptive_runtime.py, the cases of test_every_policy_matches_single_process
  (``z2-<policy>``, ``z3-<policy>`` for every RUNTIME_POLICIES policy, and ``u2-hdp``), world 4, as its
  ``run`` fixture does (``cases()`` pickled to ``OUT/cases.pkl``, one launch); rank 0 writes
  ``OUT/report.json`` ``{case: [StepMetrics.to_dict() per step], "bad_group": ...}``. Besides ``loss``
  the deterministic per-step fields ``grad_norm``, ``lr``, ``tokens``, ``label_tokens``,
  ``padded_tokens`` and ``microbatches`` are kept (the last two are rank 0's own), each under
  ``<field>.adaptive``. Skipped: the same launch's AdaptiveSource run (``OUT/adaptive/metrics.jsonl``),
  whose schedules depend on timing (a scheduler forced late, deadline 0 s, so which steps fall back
  is not fixed), the per-rank timings and the unaligned-group refusal (no losses).

Output: ``{"commit", "runtime_parallel": {name: [loss, ...]}, "groups_v3": {...}, "adaptive": {...},
"grad_norm": {"adaptive": {...}}, ..., "weights_loss": {"runtime_parallel": {...}},
"world_size": {section: {name: world}}}``; floats as json.dumps writes them (they round-trip exactly).
The commit gets ``-dirty`` when tracked files differ from it.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TESTS = ROOT / "tests"
if not (TESTS / "test_runtime_parallel.py").is_file() or not (ROOT / "flexmesh").is_dir():
    sys.exit(f"error: {ROOT} is not a flexmesh checkout's root: put record_losses.py there")

os.environ["OMP_NUM_THREADS"] = "1"
# The workers (torchrun children) must import this checkout's flexmesh too, not an editable install.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
sys.path[:0] = [str(ROOT), str(TESTS)]  # tests/ as pytest puts it (conftest.py): `import helpers`

import flexmesh  # noqa: E402

if Path(flexmesh.__file__).resolve().parent != ROOT / "flexmesh":
    sys.exit(f"error: flexmesh resolves to {flexmesh.__file__}, not {ROOT / 'flexmesh'}")

import helpers  # noqa: E402
import test_adaptive_runtime as adaptive_t  # noqa: E402
import test_hetero_runtime as hetero_t  # noqa: E402
import test_runtime_parallel as parallel_t  # noqa: E402

# Only the launches' wall-clock limit differs from the tests' (240 s / 420 s): the machine may be
# busy. It changes no result.
LAUNCH_TIMEOUT_S = float(os.environ.get("RECORD_LAUNCH_TIMEOUT_S", "3600"))
launch = functools.partial(helpers.launch, timeout=LAUNCH_TIMEOUT_S)
parallel_t.launch = launch
hetero_t.launch = launch

ADAPTIVE_FIELDS = ("grad_norm", "lr", "tokens", "label_tokens", "padded_tokens", "microbatches")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def record_runtime_parallel(tmp: Path, out: dict) -> None:
    """test_layouts_match_single_process: every layout of each world size under one torchrun."""
    for world in (2, 4):
        names = [n for n, c in parallel_t.LAYOUTS.items() if c["world"] == world]
        folder = tmp / f"runtime_parallel_w{world}"
        folder.mkdir()
        t0 = time.time()
        results = parallel_t.run_layouts(folder, world, names)
        log(f"runtime_parallel world {world}: {len(names)} layouts in {time.time() - t0:.0f} s")
        for n in names:
            out["runtime_parallel"][n] = results[n]["losses"]
            out["weights_loss"]["runtime_parallel"][n] = results[n]["weights_loss"]
            out["world_size"]["runtime_parallel"][n] = world


def record_groups_v3(tmp: Path, out: dict) -> None:
    """test_hetero_plans_match_single_process: every plan of each world size under one torchrun."""
    for world in (3, 4):
        names = [n for n, (w, _, _) in hetero_t.PLANS.items() if w == world]
        folder = tmp / f"groups_v3_w{world}"
        folder.mkdir()
        t0 = time.time()
        hetero_t._run(folder, world, names)
        log(f"groups_v3 world {world}: {len(names)} plans in {time.time() - t0:.0f} s")
        for n in names:
            out["groups_v3"][n] = json.loads((folder / n / "result.json").read_text())["losses"]
            out["world_size"]["groups_v3"][n] = world


def record_adaptive(tmp: Path, out: dict) -> None:
    """The module fixture ``run`` of test_adaptive_runtime.py (one launch), then the cases that
    test_every_policy_matches_single_process checks."""
    folder = tmp / "adaptive"
    folder.mkdir()
    all_cases = adaptive_t.cases()
    for case, (_, steps) in all_cases.items():  # a MILP cut short by a wall-clock cap would not be reproducible
        for _, sched in steps:
            assert sched.extra.get("stopped_by") != "time_limit", f"{case}: schedule stopped by a time limit"
    with open(folder / "cases.pkl", "wb") as f:
        pickle.dump(all_cases, f)
    t0 = time.time()
    proc = launch(adaptive_t.WORLD, ["worker", str(folder)], script=adaptive_t.__file__)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    report = json.loads((folder / "report.json").read_text())
    checked = [f"{lay}-{p}" for lay in ("z2", "z3") for p in adaptive_t.POLICIES] + ["u2-hdp"]
    log(f"adaptive world {adaptive_t.WORLD}: {len(checked)} cases in {time.time() - t0:.0f} s")
    for case in checked:
        rows = report[case]
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), case
        out["adaptive"][case] = [r["loss"] for r in rows]
        for field in ADAPTIVE_FIELDS:
            out[field]["adaptive"][case] = [r[field] for r in rows]
        out["world_size"]["adaptive"][case] = adaptive_t.WORLD


def check(out: dict) -> None:
    """Every per-step list has STEPS finite values; losses are positive."""
    for section in ("runtime_parallel", "groups_v3", "adaptive"):
        assert out[section], f"nothing recorded for {section}"
        for name, losses in out[section].items():
            assert len(losses) == helpers.STEPS, (section, name, losses)
            assert all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in losses), (section, name, losses)
    for field in ADAPTIVE_FIELDS:
        for name, values in out[field]["adaptive"].items():
            assert len(values) == helpers.STEPS and all(math.isfinite(v) for v in values), (field, name, values)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: PYTHONPATH=. OMP_NUM_THREADS=1 python3 record_losses.py OUTFILE")
    outfile = Path(argv[0])
    dirty = git("status", "--porcelain", "--untracked-files=no")
    out: dict = {"commit": git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else ""),
                 "runtime_parallel": {}, "groups_v3": {}, "adaptive": {},
                 **{field: {"adaptive": {}} for field in ADAPTIVE_FIELDS},
                 "weights_loss": {"runtime_parallel": {}},
                 "world_size": {"runtime_parallel": {}, "groups_v3": {}, "adaptive": {}}}
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="record_losses_"))
    record_runtime_parallel(tmp, out)
    record_groups_v3(tmp, out)
    record_adaptive(tmp, out)
    check(out)
    outfile.write_text(json.dumps(out, indent=1) + "\n")
    assert json.loads(outfile.read_text()) == out  # the floats round-trip
    shutil.rmtree(tmp)
    log(f"wrote {outfile} ({out['commit']}) in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
