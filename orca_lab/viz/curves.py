"""Figures of the paper's evaluation from sweep tables: latency vs throughput (Figures 10-11),
engine time per batch (Figure 9), and K/V memory holding real tokens."""
from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

# ORCA in blues, the baseline in reds; a darker shade for a larger max_bs.
_SHADES = {"orca": ["#9ecae1", "#6baed6", "#3182bd", "#08519c", "#08306b"],
           "ft": ["#fc9272", "#de2d26", "#a50f15", "#67000d"],
           "paged": ["#a1d99b", "#31a354", "#006d2c"],          # the policies after ORCA
           "chunked": ["#bcbddc", "#756bb1", "#54278f"]}
SCHEME_COLORS = {"max_seq_len": "#a50f15", "max_tokens": "#3182bd", "true_length": "#74c476", "paged": "#31a354"}


def curve_label(system, max_bs, mbs) -> str:
    """``Curve.label``'s, from a table's row: ``system(max_bs)``, ``system(max_bs,mbs)`` in micro-batches."""
    if not _given(max_bs):            # another server, measured over HTTP: its own name
        return str(system)
    return f"{system}({max_bs},{int(mbs)})" if _given(mbs) else f"{system}({max_bs})"


def _given(value) -> bool:
    """A table's number, not NaN nor 0 (``mbs`` of a curve without micro-batches, ``max_bs`` of a server
    that does not report it)."""
    return bool(pd.notna(value) and value)


def _colors(df: pd.DataFrame) -> dict:
    out = {}
    for system, shades in _SHADES.items():
        keys = sorted({(bs, 0 if pd.isna(m) else m) for bs, m in
                       df.loc[df["system"] == system, ["max_bs", "mbs"]].itertuples(index=False)})
        for i, (bs, m) in enumerate(keys):
            out[curve_label(system, bs, m)] = shades[min(i, len(shades) - 1)]
    return out


def latency_throughput_figure(df: pd.DataFrame, latency_col: str = "norm_latency_median_ms",
                              ylabel: str = "median normalized latency (ms/token)", title: str = "",
                              headlines=(), facet: str = "model") -> go.Figure:
    """One panel per ``facet`` value; one line per curve: throughput (req/s) vs ``latency_col`` on a
    log axis. ``headlines``: dicts of ``orca_lab.sim.headline.headline`` drawn on their model's panel."""
    panels = list(dict.fromkeys(df[facet]))
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[str(p) for p in panels],
                        horizontal_spacing=0.06)
    colors, shown = _colors(df), set()
    for col, panel in enumerate(panels, 1):
        sub = df[df[facet] == panel]
        for (system, bs, mbs), pts in sub.groupby(["system", "max_bs", "mbs"], dropna=False, sort=False):
            label = curve_label(system, bs, mbs)
            pts = pts.sort_values("rate")
            fig.add_trace(go.Scatter(x=pts["throughput_rps"], y=pts[latency_col], name=label, legendgroup=label,
                                     showlegend=label not in shown, mode="lines+markers",
                                     line=dict(color=colors.get(label, "#636363"),
                                               dash="dot" if _given(mbs) else "solid"),
                                     hovertemplate=f"{label}<br>rate %{{customdata:.3g}} req/s<br>"
                                                   "%{x:.3g} req/s, %{y:.4g} ms<extra></extra>",
                                     customdata=pts["rate"]), 1, col)
            shown.add(label)
        for h in headlines:
            if h["model"] == panel and facet == "model":
                _draw_headline(fig, h, col, sub, latency_col)
        fig.update_xaxes(title_text="throughput (req/s)", row=1, col=col)
        fig.update_yaxes(type="log", row=1, col=col, title_text=ylabel if col == 1 else None,
                         tickvals=log_ticks(sub[latency_col]))
    fig.update_layout(title=title, template="plotly_white", width=430 * len(panels) + 150, height=460,
                      legend_title_text="system(max_bs[,mbs])")
    return fig


def log_ticks(values) -> list[float]:
    """Labelled ticks of a log axis over ``values``: the powers of ten (1-2-5 steps when the
    values span less than two of them), and no label between them."""
    v = [x for x in values if x > 0 and math.isfinite(x)]
    if not v:
        return []
    lo, hi = math.floor(math.log10(min(v))), math.ceil(math.log10(max(v)))
    decades = [10.0 ** e for e in range(lo, hi + 1)]
    inside = [t for t in decades if min(v) <= t <= max(v)]
    return decades if len(inside) >= 2 else [m * t for t in decades for m in (1, 2, 5)]


def _draw_headline(fig, h: dict, col: int, sub: pd.DataFrame, latency_col: str):
    """The paper's comparison: a line at the latency, and where the best curves reach it (or, for a
    curve that saturates below it, its highest throughput)."""
    fig.add_hline(y=h["latency_ms"], line=dict(color="grey", dash="dash", width=1), row=1, col=col)
    for system, where in (("ft", "bottom right"), ("orca", "top left")):
        name, x = h[f"{system}_curve"], h[f"{system}_rps"]
        if name is None or math.isnan(x):
            continue
        y, text = h["latency_ms"], f"{name}: {x:.3g} req/s"
        if not h[f"{system}_reached"]:          # saturates below the line: mark its last point
            pts = sub[[curve_label(*k) == name for k in zip(sub["system"], sub["max_bs"], sub["mbs"])]]
            y, text = float(pts.loc[pts["throughput_rps"].idxmax(), latency_col]), text + " (saturated)"
        fig.add_trace(go.Scatter(x=[x], y=[y], mode="markers+text", marker=dict(symbol="x", size=11, color="black"),
                                 text=[text], textposition=where, showlegend=False, hoverinfo="skip"), 1, col)
    if not math.isnan(h.get("ratio", math.nan)):
        fig.layout.annotations[col - 1].text += f" ({h['ratio']:.1f}x at {h['latency_ms']:g} ms)"


def engine_time_figure(df: pd.DataFrame, title: str = "Engine time per batch (Figure 9)") -> go.Figure:
    """Rows: input lengths; columns: models; grouped bars ORCA vs FT per batch size. A batch whose
    K/V reservation does not fit is drawn as an "OOM" mark instead of a bar."""
    models, inputs = list(dict.fromkeys(df["model"])), sorted(df["input_len"].unique())
    fig = make_subplots(rows=len(inputs), cols=len(models), vertical_spacing=0.14, horizontal_spacing=0.06,
                        subplot_titles=[f"{m}, input {i}" for i in inputs for m in models])
    color = {"orca": _SHADES["orca"][3], "ft": _SHADES["ft"][1]}
    for r, inp in enumerate(inputs, 1):
        for c, model in enumerate(models, 1):
            sub = df[(df["model"] == model) & (df["input_len"] == inp)]
            for system in ("orca", "ft"):
                pts = sub[sub["system"] == system].sort_values("batch_size")
                x = pts["batch_size"].astype(str)
                fig.add_trace(go.Bar(x=x, y=pts["time_ms"], name=system, marker_color=color[system],
                                     legendgroup=system, showlegend=(r, c) == (1, 1), offsetgroup=system,
                                     text=["OOM" if o else "" for o in pts["oom"]], textposition="outside",
                                     textfont=dict(size=13, color=color["ft"])),
                              r, c)
            fig.update_yaxes(title_text="ms per batch" if c == 1 else None, rangemode="tozero", row=r, col=c)
            fig.update_xaxes(title_text="batch size", type="category", row=r, col=c)
    fig.update_layout(title=title, template="plotly_white", barmode="group",
                      width=420 * len(models) + 120, height=360 * len(inputs) + 80)
    return fig


def kv_memory_figure(occ: pd.DataFrame, util: pd.DataFrame, title: str = "K/V memory holding real tokens") -> go.Figure:
    """Left: slots reserved under each scheme but ``max_seq_len`` (far above the rest: see the
    bars) and slots holding real K/V, over time. Right: the time-weighted share of reserved slots
    holding real K/V, per scheme, one group of bars per arrival rate of ``util``."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4],
                        subplot_titles=("K/V slots over time", "reserved slots holding real tokens"))
    for scheme, color in SCHEME_COLORS.items():
        if scheme != "max_seq_len":
            fig.add_trace(go.Scatter(x=occ["time"], y=occ[scheme], name=f"reserved: {scheme}", mode="lines",
                                     line=dict(color=color, shape="hv", width=1), legendgroup=scheme), 1, 1)
    fig.add_trace(go.Scatter(x=occ["time"], y=occ["used"], name="holding real K/V", mode="lines",
                             line=dict(color="black", shape="hv", width=1.5)), 1, 1)
    rates = [f"{r:g} req/s" for r in util["rate"]] if "rate" in util else ["" for _ in range(len(util))]
    for scheme, color in SCHEME_COLORS.items():
        pick = (util["scheme"] == scheme).to_numpy()
        u = util.loc[pick, "utilization"]
        fig.add_trace(go.Bar(x=[r for r, p in zip(rates, pick) if p], y=u * 100, name=scheme, marker_color=color,
                             legendgroup=scheme, showlegend=scheme == "max_seq_len",
                             text=[f"{v:.0%}" for v in u], textposition="outside"), 1, 2)
    fig.update_xaxes(title_text="time (s)", row=1, col=1)
    fig.update_yaxes(title_text="token slots", row=1, col=1)
    fig.update_yaxes(title_text="% of reserved", range=[0, 110], row=1, col=2)
    fig.update_layout(title=title, template="plotly_white", width=1250, height=460, barmode="group")
    return fig
