"""K/V slot occupancy and tokens per iteration, one column per run (ORCA §4.2, Algorithm 1).

Occupancy is read when each iteration is scheduled: ``used`` slots hold a real token's K/V,
``reserved`` ones are held for tokens not generated yet (Algorithm 1 reserves ``max_tokens`` up
front; the baseline reserves the model's whole ``max_seq_len``), the rest is ``free``. The gap
between used and reserved is the waste that paging (vLLM) later removed.
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from orca_lab.viz._runs import PHASE_PATTERN, as_list, by_iteration, n_slots_of

KV_COLORS = {"used": "#1f77b4", "reserved": "#ff7f0e", "free": "#d9d9d9"}
KV_NAMES = {"used": "used (real K/V)", "reserved": "reserved, not used yet", "free": "free"}
PHASE_COLORS = {"prefill": "#9467bd", "decode": "#2ca02c", "held": "#7f7f7f"}
X_AXES = {"time": "time (s)", "iteration": "iteration"}


def kv_occupancy(result, n_slots: int | None = None) -> list[dict]:
    """One row per iteration: when it was scheduled, slots used / reserved-but-unused / free."""
    n_slots = n_slots_of(result, n_slots)
    if n_slots is None:
        raise ValueError("the run does not record n_slots: pass n_slots=")
    rows = []
    for i, stages in by_iteration(result).items():
        rec = stages[0]
        rows.append(dict(iteration=i, time=rec.start, used=rec.kv_used,
                         reserved=rec.kv_reserved - rec.kv_used, free=n_slots - rec.kv_reserved))
    return rows


def kv_occupancy_figure(results, x: str = "time", n_slots: int | None = None,
                        names=None) -> go.Figure:
    """Stacked used / reserved / free slots over time (or iterations), one column per run."""
    if x not in X_AXES:
        raise ValueError(f"x={x!r} is not allowed: choose one of {tuple(X_AXES)}")
    results = as_list(results)
    fig = _columns(results, names, shared_y=False)     # runs may have pools of different sizes
    for col, r in enumerate(results, 1):
        rows = kv_occupancy(r, n_slots)
        for kind, color in KV_COLORS.items():
            fig.add_trace(go.Scatter(
                x=[row[x] for row in rows], y=[row[kind] for row in rows], name=KV_NAMES[kind],
                stackgroup="kv", line_shape="hv", line_color=color, fillcolor=color,
                legendgroup=kind, showlegend=col == 1), 1, col)
    fig.update_yaxes(title_text="K/V slots", col=1, rangemode="tozero")
    fig.update_xaxes(title_text=X_AXES[x])
    return fig.update_layout(title="K/V slot occupancy")


def tokens_figure(results, names=None) -> go.Figure:
    """Rows of the ``[sum L, H]`` tensor per iteration, split by phase: what each iteration batched."""
    results = as_list(results)
    fig = _columns(results, names, shared_y=True)
    for col, r in enumerate(results, 1):
        per_phase = {p: [] for p in PHASE_PATTERN}
        its = by_iteration(r)
        for stages in its.values():
            rec = stages[0]
            for p in per_phase:
                per_phase[p].append(sum(q for q, ph in zip(rec.q_lens, rec.phases) if ph == p))
        for p, ys in per_phase.items():
            fig.add_trace(go.Bar(x=list(its), y=ys, name=p, marker_color=PHASE_COLORS[p],
                                 marker_line_width=0, legendgroup=p, showlegend=col == 1), 1, col)
    fig.update_yaxes(title_text="tokens in the iteration", col=1)
    fig.update_xaxes(title_text="iteration")
    return fig.update_layout(title="tokens per iteration", barmode="stack", bargap=0.05)


def _columns(results, names, shared_y: bool):
    names = names or [r.system for r in results]
    fig = make_subplots(rows=1, cols=len(results), subplot_titles=list(names), shared_yaxes=shared_y,
                        horizontal_spacing=0.04 if shared_y else 0.07)
    return fig.update_layout(template="plotly_white", height=360, width=min(1200, 160 + 420 * len(results)),
                             margin=dict(l=60, r=20, t=70, b=40))
