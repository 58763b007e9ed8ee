"""``flexmesh serve``: serving on uneven hardware, one sub-command per module ``flexmesh.commands.serve_<name>``.

Sub-commands: simulate (requests over time on any GPU mix, simulated), plan (the cheapest deployment that meets an
SLO on the GPUs one can get; docs/serve-plan.md), run (real engine processes on this machine behind flexmesh's
router) and bench (a trace window replayed against them at given rates, measured beside predicted;
docs/serving-engines.md), export (a plan as vLLM / SGLang launch commands and a router config), engines (the engine
presets serving is priced by, or one description's fields with their sources; docs/engines.md); docs/cli-serve.md.
"""

from __future__ import annotations

import argparse
import importlib

from flexmesh.commands.args import DefaultsHelpFormatter

# Sub-commands in the order `flexmesh serve --help` lists them; each module defines add_parser(subparsers).
SUBCOMMANDS = ("simulate", "plan", "run", "bench", "export", "engines")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``flexmesh serve`` and its sub-commands."""
    p = sub.add_parser("serve", help="serve requests on uneven hardware: simulate a fleet, plan a deployment, or run "
                                     "real engines here",
                       description=__doc__.split("\n\n")[1], formatter_class=DefaultsHelpFormatter)
    inner = p.add_subparsers(dest="serve_command", metavar="SUBCOMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"flexmesh.commands.serve_{name}").add_parser(inner)

    def usage(args: argparse.Namespace) -> int:
        p.print_help()
        return 1

    p.set_defaults(func=usage)
    return p
