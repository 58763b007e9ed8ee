"""``flexmesh serve engines [NAME|FILE]``: Lists the engine presets serving is priced by, one row each, or shows
one description's fields, each with its value and the source the description gives for it (docs/engines.md).
One picks the preset whose engine and version are the ones that run, or writes a file on one as its ``base``."""

from __future__ import annotations

import argparse
from typing import Any

from flexmesh.commands.args import DefaultsHelpFormatter


def add_parser(kinds) -> argparse.ArgumentParser:
    p = kinds.add_parser("engines", help="the engine presets, or one description's fields with their sources",
                         description=__doc__.split(": ", 1)[1].replace("``", "`"),
                         formatter_class=DefaultsHelpFormatter)
    p.add_argument("engine", nargs="?", metavar="NAME|FILE",
                   help="a preset or a description file (.toml/.json): show its fields, each with its source "
                        "(default: list the presets)")
    p.set_defaults(func=run)
    return p


def _value(field: str, value: Any) -> str:
    if field == "overhead" and isinstance(value, dict):
        return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items()
                         if k != "source")
    if field == "rates" and isinstance(value, dict):
        return ", ".join(f"{k} {v:g}" for k, v in value.items() if k != "source")
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:g}" if isinstance(value, float) else str(value)


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from flexmesh.console import plain_console
    from flexmesh.serve.layout.engine import DEFAULT_ENGINE, engine_spec, presets

    console = plain_console()
    if args.engine is None:
        table = Table(title="engine presets (flexmesh serve engines NAME: its fields and their sources)",
                      title_justify="left")
        for col in ("preset", "engine", "versions", "what it does"):
            table.add_column(col, overflow="fold")
        for name, e in presets().items():
            what = e.label().split(": ", 1)[1].rstrip(")")
            table.add_row(f"{name} (default)" if name == DEFAULT_ENGINE else name, e.title, e.version or "-", what)
        console.print(table)
        return 0
    e = engine_spec(args.engine)
    console.print(e.label())
    cited = dict(e.sources)
    fields = e.to_dict()
    if "rates" not in fields:
        fields["rates"] = "1 (the device layer's kernels)"
    table = Table(title_justify="left")
    for col in ("field", "value", "source"):
        table.add_column(col, overflow="fold")
    for field, value in fields.items():
        if field in ("name", "title", "sources"):
            continue
        source = cited.get(field, "")
        if field == "overhead":
            source = source or e.overhead.source
        elif field == "rates" and not e.rates.unit:
            source = source or e.rates.source
        elif field in ("prefill_first", "chunked_prefill", "scheduler") and not source:
            source = cited.get("scheduler", "")
        table.add_row(field, _value(field, value), source or "-")
    console.print(table)
    return 0
