"""Figures of whole runs: ORCA and the baseline side by side."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from orca_lab.metrics import per_request

COLORS = {"orca": "#1f77b4", "ft": "#d62728"}


def compare_figure(results, title: str = "ORCA vs request-level batching", curve=None) -> go.Figure:
    """Three panels of one load: normalized-latency CDF; requests doing real work in each iteration
    (the baseline's held finishers excluded); K/V slots reserved. With ``curve`` (a table with
    ``system``, ``rate``, ``throughput_rps``, ``norm_latency_median_ms``), a measured mini Figure 10
    comes first: median normalized latency against throughput, one line per system."""
    titles = ("normalized latency (CDF)", "requests working per iteration", "K/V slots reserved (n_rsrv)")
    first = 1 if curve is None else 2
    fig = make_subplots(rows=1, cols=first + 2, subplot_titles=(
        ("latency vs throughput (measured)",) if curve is not None else ()) + titles)
    if curve is not None:
        _latency_curve(fig, curve)
    for r in results:
        color = COLORS.get(r.system, None)
        lat = np.sort(per_request(r)["norm_latency"].to_numpy() * 1e3)
        cdf = np.arange(1, len(lat) + 1) / max(len(lat), 1)
        fig.add_trace(go.Scatter(x=lat, y=cdf, name=r.system, mode="lines", line_color=color,
                                 legendgroup=r.system, showlegend=curve is None), 1, first)
        it = r.iterations_df()
        it = it[it["stage"] == it["stage"].max()]
        common = dict(mode="lines", line_color=color, legendgroup=r.system, showlegend=False)
        working = it["phases"].map(lambda ph: sum(p != "held" for p in ph))
        fig.add_trace(go.Scatter(x=it["start"], y=working, line_shape="hv", **common), 1, first + 1)
        fig.add_trace(go.Scatter(x=it["start"], y=it["kv_reserved"], line_shape="hv", **common), 1, first + 2)
    fig.update_xaxes(title_text="ms / generated token", type="log", row=1, col=first)
    fig.update_xaxes(title_text="time (s)", row=1, col=first + 1)
    fig.update_xaxes(title_text="time (s)", row=1, col=first + 2)
    fig.update_yaxes(title_text="fraction of requests", row=1, col=first)
    fig.update_layout(title=title, template="plotly_white", width=400 * (first + 2), height=420)
    return fig


def _latency_curve(fig, curve):
    for system, pts in curve.groupby("system", sort=False, observed=True):
        pts = pts.sort_values("rate")
        fig.add_trace(go.Scatter(x=pts["throughput_rps"], y=pts["norm_latency_median_ms"], name=str(system),
                                 legendgroup=str(system), mode="lines+markers", line_color=COLORS.get(system),
                                 customdata=pts["rate"], hovertemplate="offered %{customdata:.2f} req/s<br>"
                                 "%{x:.2f} req/s, %{y:.3g} ms/token<extra></extra>"), 1, 1)
    fig.update_xaxes(title_text="throughput (req/s)", row=1, col=1)
    fig.update_yaxes(title_text="median normalized latency (ms/token)", type="log", row=1, col=1)
