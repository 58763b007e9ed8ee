"""Uneven devices: mixed clusters and stragglers, in three parts, each its own module and RESULTS.md section:

(a) ``bench.mixed_plan``: planned throughput and search time on mixed clusters against the
    ``uniform`` and ``proportional`` baselines and the sum of the parts planned alone;
(b) ``bench.stragglers``: simulated stragglers on 64 and 1024 GPUs, static plan against
    re-planned against the capacity bound;
(c) ``bench.stragglers_measured``: measured on this machine, 2 processes with one emulated at half
    speed, static against adaptive tokens/s, steps until recovery, predicted against measured;
(d) ``bench.mixed_dispatch``: simulated, a mixed cluster's plan of replica groups, its fixed shares
    against each step's sequences dispatched over the groups, and the per-step lower bound;
(e) ``bench.mixed_measured``: measured on this machine, a plan of two replica groups with one rank
    emulated at half speed, fixed shares against per-step dispatch, predicted against measured.

``python -m bench.uneven_devices`` runs all five (``--only a,b`` picks parts); each prints its table and
records its own section.
"""

from __future__ import annotations

import argparse
import importlib
import sys

PARTS = {"a": "bench.mixed_plan", "b": "bench.stragglers", "c": "bench.stragglers_measured",
         "d": "bench.mixed_dispatch", "e": "bench.mixed_measured"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts to run (default: all)")
    args = parser.parse_args()
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    for p in parts:
        module = importlib.import_module(PARTS[p])
        sys.argv = [PARTS[p]]  # each part parses its own (default) arguments
        module.main()


if __name__ == "__main__":
    main()
