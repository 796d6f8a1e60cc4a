"""ORCA beside the policies that followed it (``engine/policies.py``), on the same traces: one row
per run with what their users compare (TTFT and TPOT tails, preemptions), how many requests the
K/V memory held at once, and how much of the memory held was real K/V (reproduce/policies.ipynb)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from orca_lab.metrics import per_request, summarize
from orca_lab.sim.sweep import capacity, serve_point


def run_row(result) -> dict:
    """``metrics.summarize`` plus tails, preemptions, batch sizes and the share of real K/V."""
    df = per_request(result)
    first = [it for it in result.iterations if it.stage == 0]
    batch = np.array([len(it.rids) for it in first])
    used = np.array([it.kv_used for it in first], dtype=float)
    held = np.array([it.kv_reserved for it in first], dtype=float)
    return {**summarize(result),
            "n_preemptions": int(df["n_preemptions"].sum()),
            "max_batch": int(batch.max()), "mean_batch": float(batch.mean()),
            "kv_real_share": float(used.sum() / max(held.sum(), 1.0)),   # of the slots held, iteration-weighted
            "peak_kv_held": int(held.max())}


def compare(backend, curves, specs: dict, load: float | None = None, reference=None):
    """Serve each trace of ``specs`` (name -> ``TraceSpec``) with each curve, offline (``load``
    None) or at ``load`` times the capacity of ``reference`` (a curve; default the first) on that
    trace, so every system sees the same arrivals. Returns the table and the runs by (trace, label)."""
    rows, runs = [], {}
    for name, spec in specs.items():
        rate = None if load is None else load * capacity(backend, reference or curves[0], spec)
        for curve in curves:
            _, result = serve_point(backend, curve, spec, rate)
            rows.append({"model": backend.name, "trace": name, "curve": curve.label, "rate": rate, **run_row(result)})
            runs[(name, curve.label)] = result
    return pd.DataFrame(rows), runs


def kv_over_time(runs: dict) -> pd.DataFrame:
    """K/V slots held and holding real tokens at each iteration's scheduling, per run."""
    rows = [{"trace": trace, "curve": label, "time": it.start, "held": it.kv_reserved, "used": it.kv_used}
            for (trace, label), result in runs.items() for it in result.iterations if it.stage == 0]
    return pd.DataFrame(rows)


TRACES = ("paper", "sharegpt", "azure-conv", "azure-code")


def trace_specs(names, n_requests: int, seed: int = 0, scale: float = 1.0, cv: float = 1.0) -> dict:
    """``TraceSpec`` of each name: the paper's uniform lengths, or a real-shaped trace."""
    from orca_lab.config import check_choice
    from orca_lab.sim.sweep import TraceSpec
    for name in names:
        check_choice("traces", name, TRACES)
    return {name: TraceSpec(n_requests, seed, scale, shape=None if name == "paper" else name, cv=cv)
            for name in names}
