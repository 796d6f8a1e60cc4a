"""Plotly figures that read a RunResult or a sweep table, widgets, and export (DESIGN.md layer 6)."""
from orca_lab.viz.export import export
from orca_lab.viz.figures import compare_figure

__all__ = ["compare_figure", "export"]
