"""Figures of whole runs: ORCA and the baseline side by side."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from orca_lab.metrics import per_request

COLORS = {"orca": "#1f77b4", "ft": "#d62728"}


def compare_figure(results, title: str = "ORCA vs request-level batching") -> go.Figure:
    """Three panels: normalized-latency CDF; requests doing real work in each iteration (the
    baseline's held finishers excluded); K/V slots reserved."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=(
        "normalized latency (CDF)", "requests working per iteration", "K/V slots reserved (n_rsrv)"))
    for r in results:
        color = COLORS.get(r.system, None)
        lat = np.sort(per_request(r)["norm_latency"].to_numpy() * 1e3)
        cdf = np.arange(1, len(lat) + 1) / max(len(lat), 1)
        fig.add_trace(go.Scatter(x=lat, y=cdf, name=r.system, mode="lines", line_color=color,
                                 legendgroup=r.system), 1, 1)
        it = r.iterations_df()
        it = it[it["stage"] == it["stage"].max()]
        common = dict(mode="lines", line_color=color, legendgroup=r.system, showlegend=False)
        working = it["phases"].map(lambda ph: sum(p != "held" for p in ph))
        fig.add_trace(go.Scatter(x=it["start"], y=working, line_shape="hv", **common), 1, 2)
        fig.add_trace(go.Scatter(x=it["start"], y=it["kv_reserved"], line_shape="hv", **common), 1, 3)
    fig.update_xaxes(title_text="ms / generated token", type="log", row=1, col=1)
    fig.update_xaxes(title_text="time (s)", row=1, col=2)
    fig.update_xaxes(title_text="time (s)", row=1, col=3)
    fig.update_yaxes(title_text="fraction of requests", row=1, col=1)
    fig.update_layout(title=title, template="plotly_white", width=1200, height=420)
    return fig
