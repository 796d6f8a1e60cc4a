"""Plotly figures that read a RunResult or a sweep table, widgets, and export (docs/design.md, layer 7)."""
from orca_lab.viz.animation import Frame, ScheduleAnimation, ScheduleFrames, animate
from orca_lab.viz.export import export
from orca_lab.viz.figures import compare_figure
from orca_lab.viz.kv import kv_occupancy, kv_occupancy_figure, tokens_figure
from orca_lab.viz.render import show
from orca_lab.viz.timeline import busy_fraction, timeline_figure

__all__ = ["Frame", "ScheduleAnimation", "ScheduleFrames", "animate", "busy_fraction", "compare_figure",
           "export", "kv_occupancy", "kv_occupancy_figure", "show", "timeline_figure", "tokens_figure"]
