"""The README's commands timed in a fresh clone of this checkout, and the README's timing line written from what
they took (between ``<!-- timing -->`` and ``<!-- /timing -->``): never edited by hand.

In a temporary folder: ``git clone`` of this repository, a virtual environment with torch 2.13.0 installed first
(setup's first step then finds it, as the line says), ``bash setup.sh``, the test command ``python3 -m pytest -q``,
the quick pass ``-m "not slow"`` and ``flexmesh demo``, each timed by the wall clock, the tests' CPU-seconds over
their whole process tree (``getrusage`` of the children), the load before and after, the passed count read off
pytest's last line. Nothing else should run meanwhile; the line says the load it met.

    python -m bench.readme_timing              # about 25 minutes on a 2-core machine
    python -m bench.readme_timing --no-demo    # the line then says the demo was not timed
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN, END = "<!-- timing -->", "<!-- /timing -->"


def _minutes(s: float) -> str:
    return f"{int(s // 60)} min {round(s % 60)} s" if s >= 60 else f"{s:.0f} s"


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_gib() -> int:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return round(pages / 2**30)


def _timed(cmd: str, cwd: Path, env: dict, log: Path) -> tuple[float, float, str]:
    """(wall seconds, CPU-seconds of the process tree, the output's last line) of a shell command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    if proc.returncode != 0:
        raise SystemExit(f"`{cmd}` failed (exit {proc.returncode}); its output: {log}")
    return wall, cpu, lines[-1] if lines else ""


def measure(demo: bool) -> str:
    """The timing line (see the module doc)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="readme-timing-"))
    subprocess.run(["git", "clone", "-q", str(ROOT), str(work / "fresh")], check=True)
    fresh = work / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
    env = {**os.environ, "PATH": f"{work / 'venv' / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(work / "venv")}
    env.pop("PYTHONPATH", None)
    _timed("python3 -m pip install --quiet torch==2.13.0", fresh, env, work / "torch.log")
    setup, _, _ = _timed("bash setup.sh", fresh, env, work / "setup.log")
    load0 = os.getloadavg()[0]
    tests, cpu, last = _timed("python3 -m pytest -q", fresh, env, work / "tests.log")
    load1 = os.getloadavg()[0]
    passed = re.search(r"(\d+) passed", last)
    quick, _, _ = _timed('python3 -m pytest -q -m "not slow"', fresh, env, work / "quick.log")
    shown = ""
    if demo:
        took, _, _ = _timed("flexmesh demo", fresh, env, work / "demo.log")
        shown = f"; demo {_minutes(took)}"
    date = datetime.date.today().isoformat()
    return (f"Fresh clone, {os.cpu_count()}-core {_memory_gib()} GiB machine without a GPU ({date}, at {commit}, "
            f"{_cpu()}): setup {setup:.0f} s with torch already installed; tests {_minutes(tests)} (load "
            f"{load0:.1f} before, {load1:.1f} after; {cpu:,.0f} CPU-seconds over the whole process tree; "
            f"{passed.group(1) if passed else '?'} passed){shown or '; demo not timed'}; the quick pass "
            f"(`-m \"not slow\"`) {_minutes(quick)}. Written by `python -m bench.readme_timing`.")


def write(line: str, readme: Path = README) -> None:
    """``line`` between the README's timing markers."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END}; put them where the timing line goes")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{line}\n{END}{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-demo", action="store_true", help="do not time the demo")
    args = ap.parse_args()
    line = measure(demo=not args.no_demo)
    write(line)
    print(line)


if __name__ == "__main__":
    main()
