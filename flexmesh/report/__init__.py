"""Reports of measured runs: markdown with PNG plots (loss, balance, timeline, predicted vs measured).

The plots are imported on first use (PEP 562 ``__getattr__``): matplotlib costs about a CPU-second to
import, and every ``flexmesh`` process (each training rank among them) imports modules of this package
to build its command line, where nothing plots.
"""

from typing import Any

from flexmesh.report.report import Report, median_abs_error

_PLOTS = ("balance_png", "loss_png", "predicted_vs_measured_png", "timeline_png")

__all__ = ["Report", "balance_png", "loss_png", "median_abs_error", "predicted_vs_measured_png", "timeline_png"]


def __getattr__(name: str) -> Any:
    if name in _PLOTS:
        from flexmesh.report import plots

        return getattr(plots, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
