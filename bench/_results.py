"""Record a benchmark's table in bench/RESULTS.md, in its own section, with the commit it ran on."""

from __future__ import annotations

import datetime
import platform
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADER = "# Benchmark results\n\nEach section is rewritten by the script named in its heading.\n"
REPEATS = 3  # timed runs of a search; the fastest is recorded
S = TypeVar("S")
T = TypeVar("T")


def fastest(setup: Callable[[], S], run: Callable[[S], T], label: str) -> tuple[S, T, float]:
    """``run(setup())`` :data:`REPEATS` times, a fresh ``setup()`` (cost models, their caches empty) each
    time and only ``run`` timed: the last (state, result) and the fastest time, as timeit reports (what
    other work on the machine adds is noise, not the code's time); the times are printed after ``label``."""
    times = []
    for _ in range(REPEATS):
        state = setup()
        t0 = time.perf_counter()
        out = run(state)
        times.append(time.perf_counter() - t0)
    print(f"{label}: {', '.join(f'{t:.2f}' for t in times)} s")
    return state, out, min(times)


def commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=RESULTS.parent).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    # The results file itself is not code: earlier benches of the same run rewrite it.
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(exclude,top)bench/RESULTS.md")
    return sha + ("-dirty" if changed else "")


def markdown_table(columns, rows) -> list[str]:
    """Lines of a markdown table.

    >>> markdown_table(["a", "b"], [[1, 2]])
    ['| a | b |', '|---|---|', '| 1 | 2 |']
    """
    return ["| " + " | ".join(map(str, columns)) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


def record(name: str, body: str, script: str | None = None) -> None:
    """Replace section ``name`` of RESULTS.md with ``body`` (markdown), stamped with commit and machine;
    its heading names bench/``script``.py (default: ``name``)."""
    stamp = (f"_commit {commit()}, {datetime.date.today().isoformat()}, {platform.machine()} "
             f"{platform.processor() or ''} python {platform.python_version()}_\n")
    section = (f"<!-- bench:{name} -->\n## {name} (`bench/{script or name}.py`)\n\n{stamp}\n{body.rstrip()}\n"
               f"<!-- /bench:{name} -->")
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    RESULTS.write_text(text)
