"""A markdown report with tables and PNG plots, written to an output folder.

>>> import tempfile, pathlib
>>> out = pathlib.Path(tempfile.mkdtemp())
>>> r = Report("demo", out)
>>> r.text("Two runs.")
>>> r.table(["policy", "tokens/s"], [["fixed", "1,000"], ["hdp", "1,500"]])
>>> print((out / "report.md").read_text() if r.write() else "")
# demo
<BLANKLINE>
Two runs.
<BLANKLINE>
| policy | tokens/s |
| --- | --- |
| fixed | 1,000 |
| hdp | 1,500 |
<BLANKLINE>
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np


def median_abs_error(predicted, measured) -> float:
    """Median of ``|predicted - measured| / measured``.

    >>> median_abs_error([1.0, 2.2, 2.7], [1.0, 2.0, 3.0])
    0.1
    """
    p = np.asarray(predicted, dtype=float)
    m = np.asarray(measured, dtype=float)
    if p.size == 0:
        return float("nan")
    return float(np.round(np.median(np.abs(p - m) / m), 12))


class Report:
    """Collects sections in order; :meth:`write` writes ``<out>/report.md`` atomically."""

    def __init__(self, title: str, out: str | Path) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.parts: list[str] = [f"# {title}\n"]

    def heading(self, text: str) -> None:
        self.parts.append(f"## {text}\n")

    def text(self, text: str) -> None:
        self.parts.append(text.strip() + "\n")

    def table(self, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        self.parts.append("\n".join(lines) + "\n")

    def image(self, path: str | Path, caption: str) -> None:
        rel = os.path.relpath(Path(path), self.out)
        self.parts.append(f"![{caption}]({rel})\n")

    def write(self) -> Path:
        path = self.out / "report.md"
        tmp = path.with_suffix(".md.tmp")
        tmp.write_text("\n".join(self.parts))
        os.replace(tmp, path)
        return path
