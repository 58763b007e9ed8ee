"""The consoles flexmesh prints through: rich, with text printed exactly as given.

By default rich reads ``[bold]`` in a string as markup and ``:smile:`` as an emoji code, so a model
name, a path or an error message holding them would come out altered (styled, cut, or with an
emoji). Every rich Console in flexmesh comes from :func:`plain_console`, which turns markup, emoji
codes and highlighting off; that covers what it prints and the tables, rules and progress bars it
renders. Styles are given as :class:`~rich.text.Text` (:func:`styled`), never as markup in a string.

>>> from io import StringIO
>>> buf = StringIO()
>>> plain_console(file=buf).print("model :smile: [red]x[/red]")
>>> buf.getvalue()
'model :smile: [red]x[/red]\\n'
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.text import Text

# Outside a terminal (a pipe, a log file, CI) rich would squeeze every table to 80 columns, wrapping cells and
# cutting headers; a log has no width, so tables there are as wide as they need up to this many columns.
# COLUMNS, when set, still rules.
UNBOUNDED_WIDTH = 240


def plain_console(stderr: bool = False, **kwargs: Any) -> Console:
    """A rich Console on stdout (stderr with ``stderr``) that prints strings verbatim: no markup, no
    emoji codes, no highlighting. ``kwargs`` go to Console (``soft_wrap``, ``file``, ...). Outside a
    terminal, and without COLUMNS, lines may be :data:`UNBOUNDED_WIDTH` wide."""
    console = Console(stderr=stderr, markup=False, emoji=False, highlight=False, **kwargs)
    if "width" not in kwargs and not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = UNBOUNDED_WIDTH
    return console


def styled(head: str, style: str, rest: str = "") -> Text:
    """``head`` in ``style`` followed by ``rest``, both verbatim (``styled("error:", "bold red", " x")``)."""
    return Text.assemble((head, style), rest)


# Outside a terminal a rich bar draws nothing until it ends; a log gets one line at most this often instead.
PLAIN_PROGRESS_EVERY_S = 10.0
# Work estimated to take longer says so, once, with the estimate (measured over its first seconds).
LONG_WORK_S = 60.0
ESTIMATE_AFTER_S = 3.0


def _duration(seconds: float) -> str:
    """``seconds`` in words a person reads at a glance.

    >>> _duration(75), _duration(5400), _duration(200000)
    ('1 min', '1.5 h', '2.3 days')
    """
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 86400 else f"{seconds / 86400:.1f} days"


@contextmanager
def progress_steps(description: str, total: int, console: Console | None = None,
                   every_s: float = PLAIN_PROGRESS_EVERY_S, hint: str = "") -> Iterator[Callable[..., None]]:
    """Progress over ``total`` steps on stderr; yields ``advance(label=None)``. On a terminal a transient rich
    bar; elsewhere a plain line ``description: done/total (label), N s`` at most every ``every_s`` seconds
    and one when the work ends, so a long step never runs silent in a log. Either way, work that
    its first seconds project to over :data:`LONG_WORK_S` says so once, with the estimate and ``hint``
    (how to make it shorter): ``description: about 2.5 h for 9,600 steps (40 in 37 s); hint``.

    >>> import io
    >>> buf = io.StringIO()
    >>> with progress_steps("profiling", 2, plain_console(file=buf), every_s=0) as advance:
    ...     advance("gemm"); advance("attention")
    >>> [line.split(",")[0] for line in buf.getvalue().splitlines()]
    ['profiling: 1/2 (gemm)', 'profiling: 2/2 (attention)', 'profiling: done 2/2 in 0 s']
    """
    console = console or plain_console(stderr=True)
    start, said = time.monotonic(), False

    def estimate(done: int) -> None:
        nonlocal said
        spent = time.monotonic() - start
        if said or spent < ESTIMATE_AFTER_S or not done:
            return
        said = True
        projected = spent / done * total
        if projected > LONG_WORK_S:
            console.print(f"{description}: about {_duration(projected)} for {total:,} steps ({done:,} in {spent:.0f} "
                          f"s)" + (f"; {hint}" if hint else ""))

    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task(description, total=total)

            def advance_bar(label: str | None = None) -> None:
                bar.update(task, advance=1, description=f"{description}: {label}" if label else description)
                estimate(int(bar.tasks[0].completed))

            yield advance_bar
        return
    last = start
    done = 0

    def advance_line(label: str | None = None) -> None:
        nonlocal done, last
        done += 1
        estimate(done)
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            console.print(f"{description}: {done}/{total}" + (f" ({label})" if label else "")
                          + f", {now - start:.0f} s")

    yield advance_line
    console.print(f"{description}: done {done}/{total} in {time.monotonic() - start:.0f} s")


@contextmanager
def quiet_stdout() -> Iterator[None]:
    """The process's standard output (file descriptor 1) sent to the null device meanwhile, C libraries' prints
    included (HiGHS's MIP solver prints ``HighsMipSolverData::transformNewIntegerFeasibleSolution ...`` lines
    that SciPy's ``disp: False`` does not reach)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no standard output to silence
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        _flush_c_stdout()  # what the C side buffered goes where it was meant to: nowhere
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_stdout() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask (not a POSIX process)
        pass


def quietly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under :func:`quiet_stdout` (e.g. SciPy's HiGHS ``milp``)."""
    with quiet_stdout():
        return fn(*args, **kwargs)
