"""The timeline of a run: one lane per pipeline stage (worker), one bar per iteration on that stage.

Each bar is split into one slice per request of the batch, in the request's colour, hatched while
the request is in its initiation phase (prefill), solid in its increment phase (decode) and crossed
when the request-level baseline keeps computing a request that has already finished (held). Gaps
in a lane are the worker idling: the pipeline bubbles of the paper's Figure 8.
"""
from __future__ import annotations

import plotly.graph_objects as go

from orca_lab.viz._runs import PHASE_PATTERN, by_iteration, n_stages, prefill_notes, request_color, request_labels

PHASE_OPACITY = {"prefill": 1.0, "decode": 1.0, "held": 0.4}   # held work is wasted: faded
TIME_UNITS = {"s": 1.0, "ms": 1e3, "units": 1.0}   # "units": a clock where one stage takes 1


def timeline_figure(result, time_unit: str = "s", first: int | None = None, title: str | None = None,
                    height: int | None = None) -> go.Figure:
    """Iterations of ``result`` per worker; ``first`` keeps only the first that many iterations."""
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time_unit={time_unit!r} is not allowed: choose one of {tuple(TIME_UNITS)}")
    scale, labels, notes = TIME_UNITS[time_unit], request_labels(result), prefill_notes(result)
    points = {phase: dict(base=[], x=[], y=[], width=[], color=[], text=[], hover=[])
              for phase in PHASE_PATTERN}
    for i, stages in list(by_iteration(result).items())[:first]:
        for rec in stages:
            n = len(rec.rids)
            for k, (rid, phase, q) in enumerate(zip(rec.rids, rec.phases, rec.q_lens)):
                p = points[phase]
                # the lane (height 0.8) is shared by the batch's requests, one slice each
                p["y"].append(rec.stage - 0.4 + (k + 0.5) * 0.8 / n)
                p["width"].append(0.8 / n)
                p["base"].append(rec.start * scale)
                p["x"].append((rec.end - rec.start) * scale)
                p["color"].append(request_color(rid))
                note = notes.get((i, rid), "")       # a chunk of a prompt, or a recomputation
                p["text"].append(labels[rid] + ("*" if "recompute" in note else "'" if note else ""))
                p["hover"].append(f"iteration {i}, worker {rec.stage + 1}<br>request {labels[rid]}: "
                                  f"{phase}{' (' + note + ')' if note else ''}, {q} new token(s)<br>{rec.start * scale:.4g} to "
                                  f"{rec.end * scale:.4g} {time_unit}")
    fig = go.Figure()
    for phase, p in points.items():
        fig.add_trace(go.Bar(
            orientation="h", base=p["base"], x=p["x"], y=p["y"], width=p["width"], text=p["text"],
            hovertext=p["hover"], hoverinfo="text", textposition="inside", insidetextanchor="middle",
            marker=dict(color=p["color"], line=dict(color="white", width=1),
                        pattern=dict(shape=PHASE_PATTERN[phase], fgcolor="rgba(0,0,0,0.45)")),
            opacity=PHASE_OPACITY[phase], name=phase, showlegend=False))
        # the legend shows the phases in grey: the colours belong to the requests
        fig.add_trace(go.Bar(x=[None], y=[None], orientation="h", name=phase, opacity=PHASE_OPACITY[phase],
                             marker=dict(color="#bbbbbb", pattern=dict(shape=PHASE_PATTERN[phase],
                                                                       fgcolor="#444"))))
    stages = n_stages(result)
    fig.update_yaxes(tickvals=list(range(stages)), ticktext=[f"worker {s + 1}" for s in range(stages)],
                     autorange="reversed")
    fig.update_xaxes(title_text=f"time ({time_unit})")
    fig.update_layout(
        barmode="overlay", template="plotly_white", uniformtext=dict(minsize=8, mode="hide"),
        title=title or f"{result.system}: iterations per worker", height=height or 140 + 70 * stages,
        margin=dict(l=80, r=20, t=50, b=40), legend=dict(orientation="h", y=1.02, x=1, xanchor="right",
                                                         yanchor="bottom"))
    return fig


def busy_fraction(result) -> list[float]:
    """Per worker: the fraction of the run (first start to last end) it spent computing."""
    recs = result.iterations
    if not recs:
        return []
    span = max(r.end for r in recs) - min(r.start for r in recs)
    busy = [0.0] * n_stages(result)
    for r in recs:
        busy[r.stage] += r.end - r.start
    return [b / span if span > 0 else 0.0 for b in busy]
