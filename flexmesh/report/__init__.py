"""Reports of measured runs: markdown with PNG plots (loss, balance, timeline, predicted vs measured)."""

from flexmesh.report.plots import balance_png, loss_png, predicted_vs_measured_png, timeline_png
from flexmesh.report.report import Report, median_abs_error

__all__ = ["Report", "balance_png", "loss_png", "median_abs_error", "predicted_vs_measured_png", "timeline_png"]
