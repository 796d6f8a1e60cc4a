"""The paper's headline (ORCA §6.2): each system's best throughput at one median normalized
latency, read off a sweep's curves, and their ratio."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from orca_lab.sim.sweep import curve_of


def throughput_at(points: pd.DataFrame, latency_ms: float, col: str = "norm_latency_median_ms") -> tuple[float, bool]:
    """Throughput of one curve where its median latency reaches ``latency_ms``: the highest-rate
    point under it, interpolated (log latency) towards the first point over it; and whether the
    curve reached it. A curve that saturates below it (within the sweep) gives its highest
    throughput; one that starts above it gives NaN."""
    p = points.sort_values("rate")
    lat, thr = p[col].to_numpy(), p["throughput_rps"].to_numpy()
    if not len(lat) or lat[0] > latency_ms:
        return math.nan, False
    over = np.nonzero(lat > latency_ms)[0]
    if not len(over):
        return float(thr.max()), False
    j = over[0]
    f = (math.log(latency_ms) - math.log(lat[j - 1])) / (math.log(lat[j]) - math.log(lat[j - 1]))
    return float(thr[j - 1] + f * (thr[j] - thr[j - 1])), True


def headline(df: pd.DataFrame, model: str, latency_ms: float = 190.0) -> dict:
    """ORCA §6.2's comparison: the best FT curve and the best ORCA curve at the same median
    normalized latency, and their throughput ratio (the paper: 175B, 190 ms/token, 36.9x)."""
    sub = df[df["model"] == model]
    if sub.empty:
        raise ValueError(f"model {model!r} is not in the sweep: it has {sorted(df['model'].unique())}")
    out = {"model": model, "latency_ms": latency_ms}
    for system in ("ft", "orca"):
        best = (None, math.nan, False)
        for (bs, mbs), pts in sub[sub["system"] == system].groupby(["max_bs", "mbs"], dropna=False):
            thr, reached = throughput_at(pts, latency_ms)
            if not math.isnan(thr) and not thr <= best[1]:
                best = (curve_of(system, bs, mbs).label, thr, reached)
        out.update({f"{system}_curve": best[0], f"{system}_rps": best[1], f"{system}_reached": best[2]})
    out["ratio"] = out["orca_rps"] / out["ft_rps"] if out["ft_rps"] else math.nan
    return out


def describe(h: dict) -> str:
    """``headline``'s result as one line, saying which curve never reached the latency within the
    sweep: its highest throughput counts, so a sweep that stays far below the latency compares the
    peaks it reached, not throughput at the paper's point."""
    line = (f"{h['model']} at {h['latency_ms']:g} ms/token: best FT {h['ft_curve']} {h['ft_rps']:.3g} req/s, "
            f"best ORCA {h['orca_curve']} {h['orca_rps']:.3g} req/s: {h['ratio']:.1f}x")
    short = [name for name in ("ft", "orca") if not h[f"{name}_reached"]]
    if short:
        names = " and ".join(name.upper() for name in short)
        line += (f" ({names} never reached {h['latency_ms']:g} ms/token in this sweep: "
                 f"{'each' if len(short) > 1 else 'its'} highest throughput counted)")
    return line
