"""``flexmesh`` command line: one sub-command per module under flexmesh.commands.

Each command module defines ``add_parser(subparsers)`` returning its parser with ``func`` set to a
callable taking the parsed args and returning an exit code. User errors (FlexmeshError) print one
clear message and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rich.console import Console
from rich.markup import escape

from flexmesh.errors import FlexmeshError

# Sub-commands in the order `flexmesh --help` lists them; a module missing here is skipped.
COMMANDS = ("plan", "simulate", "train", "export", "profile", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexmesh",
        description="Plan and run hybrid-parallel transformer training with uneven sequence lengths and devices.",
    )
    parser.add_argument("--version", action="version", version=f"flexmesh {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"flexmesh.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"flexmesh.commands.{name}":
                continue
            raise
        mod.add_parser(sub)
    return parser


def _version() -> str:
    """The installed package's version (a source checkout that was never installed says so)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flexmesh")
    except PackageNotFoundError:
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (training stops on its own: `flexmesh train`)
        Console(stderr=True).print("interrupted", highlight=False)
        return 130
    except FlexmeshError as e:
        # escaped: messages quote paths and torch errors with [brackets] that rich reads as markup
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
