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
from numpy.typing import ArrayLike

from flexmesh.files import make_folder, write_atomic


def median_abs_error(predicted: ArrayLike, measured: ArrayLike) -> float:
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
        self.out = make_folder(out)
        self.parts: list[str] = [f"# {title}\n"]

    def heading(self, text: str) -> None:
        """A second-level heading."""
        self.parts.append(f"## {text}\n")

    def text(self, text: str) -> None:
        """A paragraph (surrounding whitespace dropped)."""
        self.parts.append(text.strip() + "\n")

    def table(self, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        """A markdown table; cells are written with ``str``."""
        lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        self.parts.append("\n".join(lines) + "\n")

    def image(self, path: str | Path, caption: str) -> None:
        """An image, linked relative to the report so the output folder can move."""
        rel = os.path.relpath(Path(path), self.out)
        self.parts.append(f"![{caption}]({rel})\n")

    def write(self) -> Path:
        """Write ``<out>/report.md`` (atomically: a reader never sees half a report) and return its path."""
        path = self.out / "report.md"
        write_atomic(path, "\n".join(self.parts))
        return path
