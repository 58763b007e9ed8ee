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

import os
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
