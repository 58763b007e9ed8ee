"""``flexmesh`` command line: one sub-command per module under flexmesh.commands.

Each command module defines ``add_parser(subparsers)`` returning its parser with ``func`` set to a
callable taking the parsed args and returning an exit code. User errors (FlexmeshError) print one
clear message and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from flexmesh.commands.args import DefaultsHelpFormatter, examples
from flexmesh.console import plain_console, styled
from flexmesh.errors import FlexmeshError
from flexmesh.runtime.launch import die_with_launcher

# Sub-commands in the order `flexmesh --help` lists them; a module missing here is skipped.
COMMANDS = ("plan", "simulate", "train", "export", "profile", "serve", "demo")

# What each command's --help ends with: commands as a user types them (tests/test_cli_help.py parses them).
EXAMPLES = {
    "plan": ("flexmesh plan --model llama3-8b --cluster 8xH100 --seq-len 8192 --out plan.json",
             "flexmesh plan --cluster 64x8xH100+64x8xA100-40GB --explain",
             "flexmesh plan --check plan.json"),
    "simulate": ("flexmesh simulate --plan plan.json --lengths wikipedia --policies hdp,milp",
                 "flexmesh simulate --model llama2-7b --cluster 8x8xA100-40GB --seq-len 131072 --slow 3=0.5"),
    "train": ("flexmesh train --plan plan.json --corpus stdlib --max-steps 100 --out run --nproc 2",
              "torchrun --nproc-per-node 2 -m flexmesh train --plan plan.json --corpus docs --max-steps 9 --out run"),
    "export": ("flexmesh export --checkpoint run --out run-hf",),
    "profile": ("flexmesh profile hardware --nproc 2 --out hardware.json",
                "flexmesh profile model --model tiny --quick --out model-tiny.json",
                "flexmesh profile engine --model tiny --quick --out engine-tiny.json"),
    "serve": ("flexmesh serve simulate --model llama3.1-8b --cluster 8xH100 --trace azure-conv "
              "--slo ttft=2s,tpot=100ms",
              "flexmesh serve simulate --cluster 1x8xH100+2x8xA100-40GB --replicas 2xtp4-prefill@H100,4xtp4-decode@1 "
              "--rates 10,20,40 --out serve-out",
              "flexmesh serve run --model tiny --engines 2 --port 8000",
              "flexmesh serve bench --trace azure-conv --rate 2,4,8 --requests 100 --out bench-tiny"),
    "demo": ("flexmesh demo", "flexmesh demo --quick --out /tmp/demo"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexmesh",
        description="Plan and run hybrid-parallel transformer training with uneven sequence lengths and devices.",
    )
    parser.add_argument("--version", action="version", version=f"flexmesh {_version()}")
    parser.set_defaults(func=None)  # no command given: the help
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"flexmesh.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"flexmesh.commands.{name}":
                continue
            raise
        command = mod.add_parser(sub)
        command.formatter_class = DefaultsHelpFormatter
        command.epilog = examples(*EXAMPLES.get(name, ()))
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
    if args.func is None:
        parser.print_help()
        return 1
    die_with_launcher()  # a rank of `flexmesh ... --nproc N` does not outlive its launcher
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (training stops on its own: `flexmesh train`)
        plain_console(stderr=True).print("interrupted")
        return 130
    except OSError as e:  # a path the user named that cannot be read or written: one line, not a traceback
        where = f" ({e.filename})" if e.filename else ""
        plain_console(stderr=True, soft_wrap=True).print(
            styled("error:", "bold red", f" {e.strerror or e}{where}; check the path and its permissions"))
        return 2
    except FlexmeshError as e:
        # verbatim: messages quote model names, paths and torch errors, which may hold [brackets] or :codes:
        plain_console(stderr=True, soft_wrap=True).print(styled("error:", "bold red", f" {e}"))
        return 2


if __name__ == "__main__":
    sys.exit(main())
