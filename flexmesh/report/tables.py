"""Tables that keep every figure whole on a narrow terminal.

rich fits a table that is too wide by shrinking its columns, and a number then loses its last
digits behind an ellipsis ("60,4…"). :func:`print_table` prints a table whole when its narrowest
layout fits the console (headers and text cells wrap at spaces, figures never break); otherwise it
prints the columns in several tables, each led by the first column, so the layout wraps and not the
figures. rich has no such mode (its ``overflow`` modes cut or fold the cells), hence this module.
"""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import TextType


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` on ``console``, split by columns where it cannot fit whole."""
    if _narrowest(console, table) <= console.width or len(table.columns) <= 2:
        console.print(table)
        return
    key = table.columns[0]
    parts: list[list[Column]] = []
    current: list[Column] = []
    for column in table.columns[1:]:
        if current and _narrowest(console, _part(table, key, [*current, column], None)) > console.width:
            parts.append(current)
            current = []
        current.append(column)
    parts.append(current)
    for i, columns in enumerate(parts):
        console.print(_part(table, key, columns, table.title if i == 0 else None))


def _narrowest(console: Console, table: Table) -> int:
    # measured as if the console were unbounded: rich clamps a measurement to the console's width
    return Measurement.get(console, console.options.update(max_width=1 << 16), table).minimum


def _part(table: Table, key: Column, columns: list[Column], title: TextType | None) -> Table:
    """A table of ``key`` and ``columns`` with ``table``'s rows and style."""
    part = Table(title=title, box=table.box, show_lines=table.show_lines, padding=table.padding)
    chosen = [key, *columns]
    for c in chosen:
        part.add_column(c.header, justify=c.justify, style=c.style, no_wrap=c.no_wrap)
    cells = [list(c.cells) for c in chosen]
    for row in zip(*cells, strict=True):
        part.add_row(*row)
    return part
