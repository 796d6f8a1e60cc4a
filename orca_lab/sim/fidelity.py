"""Does the simulator predict the machine at hand? Serve the same traces with the real engine and
with the simulator on a cost model fitted to that engine's timings, and compare.

1. Calibrate: the trace is served offline (all requests at t=0) on the real engine by each curve
   and by the same system at smaller batch sizes (a fit needs batches of every size it will be
   asked about: at light load most batches hold one request); the iteration periods of those runs
   fit a ``FittedCost``, and each curve's offline throughput is its measured capacity.
2. Compare: at each load (a fraction of that capacity) the real engine and the simulator serve the
   same Poisson trace; the table holds both medians of normalized latency, both throughputs and
   their relative errors. With ``repeats > 1`` the real engine serves the trace that many times and
   the median of its results is kept: another process taking the core for a while skews one run.
"""
from __future__ import annotations

import pandas as pd

from orca_lab.sim.fitted import FittedCost
from orca_lab.sim.run import Curve, SimBackend, TraceSpec, measure_point


def calibration_curves(curves) -> list[Curve]:
    """The curves, and each system at max_bs 1, 2, 4... below them (ft with mbs = max_bs)."""
    out = set(curves)
    for c in curves:
        b = 1
        while b < c.max_bs:
            out.add(Curve(c.system, b, b if c.system == "ft" else None))
            b *= 2
    return sorted(out, key=lambda c: (c.system, c.max_bs, c.mbs or 0))


def calibrate(real, curves, spec: TraceSpec):
    """Offline runs of ``spec`` on the real engine: (fitted cost, capacity of each of ``curves``)."""
    trace = spec.make(None, real.cfg.vocab_size)
    runs = {c: real.serve(c, trace) for c in calibration_curves(curves)}
    caps = {c: len(runs[c].requests) / max(runs[c].duration, 1e-12) for c in curves}
    return FittedCost.fit(list(runs.values()), real.cfg.n_layers), caps


def compare(real, curves, spec: TraceSpec, loads, repeats: int = 1,
            progress: bool = True) -> tuple[pd.DataFrame, FittedCost]:
    """One row per (curve, load): measured vs simulated median normalized latency and throughput."""
    from tqdm.auto import tqdm
    cost, caps = calibrate(real, curves, spec)
    sim = SimBackend(real.cfg, cost=cost, n_slots=real.n_slots)
    rows = []
    with tqdm(total=len(curves) * len(loads), desc=f"{real.name}: real vs sim", disable=not progress) as bar:
        for c in curves:
            for load in loads:
                rate = load * caps[c]
                m = pd.DataFrame([measure_point(real, c, spec, rate) for _ in range(repeats)]).median(numeric_only=True)
                s = measure_point(sim, c, spec, rate)
                rows.append({"model": real.name, "curve": c.label, "load": load, "rate": rate,
                             "capacity_rps": caps[c],
                             "measured_ms": m["median_norm_latency_ms"], "simulated_ms": s["median_norm_latency_ms"],
                             "measured_rps": m["throughput_rps"], "simulated_rps": s["throughput_rps"]})
                bar.update()
    df = pd.DataFrame(rows)
    df["latency_error_pct"] = 100 * (df["simulated_ms"] / df["measured_ms"] - 1)
    df["throughput_error_pct"] = 100 * (df["simulated_rps"] / df["measured_rps"] - 1)
    return df, cost
