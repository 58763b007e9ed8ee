"""What flexmesh prints outside a terminal (a pipe, a log, CI): tables as wide as their content, never squeezed
to 80 columns; COLUMNS still rules when set."""

from __future__ import annotations

import io

from rich.table import Table

from flexmesh.console import UNBOUNDED_WIDTH, plain_console


def _table() -> Table:
    t = Table()
    for c in ("a header that is long enough", "another header that is long enough", "a third long header here"):
        t.add_column(c)
    t.add_row("x" * 30, "y" * 30, "z" * 30)
    return t


def test_a_pipe_gets_the_whole_table_on_one_line_per_row(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    buf = io.StringIO()
    console = plain_console(file=buf)
    assert console.width == UNBOUNDED_WIDTH
    console.print(_table())
    lines = buf.getvalue().splitlines()
    assert any("a header that is long enough" in line and "a third long header here" in line for line in lines)
    assert any("x" * 30 in line and "z" * 30 in line for line in lines) and max(map(len, lines)) > 80


def test_columns_still_rules(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    buf = io.StringIO()
    plain_console(file=buf).print(_table())
    assert max(map(len, buf.getvalue().splitlines())) <= 60
