"""``flexmesh serve run|bench``: serving on this machine (docs/serving-engines.md).

``run`` starts real engine processes behind flexmesh's router; ``bench`` replays a trace window against
them at given rates and reports measured latencies.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from flexmesh.commands.serve_engines import add_bench_parser, add_run_parser

    p = subparsers.add_parser("serve", help="serve a model: real engines behind flexmesh's router, replayed traces",
                              description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    kinds = p.add_subparsers(dest="serve_kind", metavar="KIND")
    add_run_parser(kinds)
    add_bench_parser(kinds)
    p.set_defaults(func=lambda a: (p.print_help(), 1)[1])
    return p
