"""What flexmesh prints outside a terminal (a pipe, a log, CI): tables as wide as their content, never squeezed
to 80 columns; COLUMNS still rules when set."""

from __future__ import annotations

import io

import pytest
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


class _Clock:
    """time.monotonic for flexmesh.console, ``step_s`` seconds further at each call."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 1000.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def _run(monkeypatch, step_s: float, total: int) -> list[str]:
    import flexmesh.console as console

    monkeypatch.setattr(console.time, "monotonic", _Clock(step_s))
    buf = io.StringIO()
    with console.progress_steps("simulating", total, plain_console(file=buf), hint="fewer --steps") as advance:
        for _ in range(total):
            advance()
    return buf.getvalue().splitlines()


def test_long_work_says_its_estimate_once_and_short_work_does_not(monkeypatch):
    import re

    lines = _run(monkeypatch, step_s=1.0, total=3600)  # a second or two a step (the clock moves at each read)
    said = [ln for ln in lines if "about" in ln]
    assert len(said) == 1 and re.fullmatch(r"simulating: about [12]\.\d h for 3,600 steps \(\d+ in \d+ s\); "
                                           r"fewer --steps", said[0]), said
    assert lines[-1].startswith("simulating: done 3600/3600")
    assert len(lines) < 3600 / 4  # a line per 10 s at most, not one per step
    assert not [ln for ln in _run(monkeypatch, step_s=0.001, total=3000) if "about" in ln]  # 6 s in all


@pytest.mark.slow
def test_simulate_reports_progress_on_stderr_and_keeps_stdout_json(capsys):
    import json

    from flexmesh.cli import main

    args = ["simulate", "--model", "llama2-7b", "--cluster", "2x8xA100-80GB", "--context", "32768",
            "--global-batch", "48", "--steps", "8", "--seed", "1", "--policies", "fixed", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["policies"]
    assert "scheduling and simulating: done" in captured.err  # not a terminal: plain lines, never silent
