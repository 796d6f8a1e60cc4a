"""Does the simulator predict the machine at hand? Serve the same traces with the real engine and
with the simulator on a cost model fitted to that engine's timings, and compare.

1. Calibrate: the trace is served offline (all requests at t=0) on the real engine by each curve
   and by the same system at smaller batch sizes (a fit needs batches of every size it will be
   asked about: at light load most batches hold one request); the iteration periods of those runs
   fit a ``FittedCost``, and each curve's offline throughput is its measured capacity. A warm-up
   run goes first: a process's first runs are slow (allocations, first-call kernel choices).
2. Compare: at each load (a fraction of that capacity) the real engine and the simulator serve the
   same Poisson trace; the table holds both medians of normalized latency, both throughputs and
   their relative errors.

A shared machine changes speed by tens of percent from one minute to the next (other tenants; on
this project's 2-core machine an offline run took 195 ms for half a minute, then 135 ms), which no
model of the engine can predict. So a *probe* (the first requests of the trace, offline, with the
same curve) is timed just before and just after each real run, and the simulator runs that point
at the machine's speed of the moment (``FittedCost.at_speed``): the mean of the two probes over the
probe at calibration. The probes are not the run they correct. When the two probes differ by more
than ``STEADY``, the machine changed speed during the run and the point is measured again (up to
``TRIES`` times; the table says how many it took and whether the last was steady). Calibration is
held to the same rule. The table keeps the uncorrected prediction too. With ``repeats > 1`` each
point is measured that many times and the medians are compared.
"""
from __future__ import annotations

import statistics

import pandas as pd

from orca_lab.sim.fitted import FittedCost
from orca_lab.sim.run import Curve, SimBackend, TraceSpec, measure_point

PROBE_REQUESTS = 8
PROBE_SECONDS = 0.5     # a probe repeats until it has run this long: one hiccup must not set the speed
STEADY = 0.1            # the probes around a run may differ by this fraction
TRIES = 4


def calibration_curves(curves) -> list[Curve]:
    """The curves, and each system at max_bs 1, 2, 4... below them (ft with mbs = max_bs)."""
    out = set(curves)
    for c in curves:
        b = 1
        while b < c.max_bs:
            out.add(Curve(c.system, b, b if c.system == "ft" else None))
            b *= 2
    return sorted(out, key=lambda c: (c.system, c.max_bs, c.mbs or 0))


def probe(real, curve: Curve, trace) -> float:
    """Seconds the real engine takes to serve the first requests of ``trace`` offline (the median
    of as many runs as fit in ``PROBE_SECONDS``, at least one)."""
    times = []
    while not times or sum(times) < PROBE_SECONDS:
        times.append(real.serve(curve, trace[:PROBE_REQUESTS]).duration)
    return statistics.median(times)


def steady(before, after) -> bool:
    return all(abs(a / b - 1) <= STEADY for b, a in zip(before, after))


def until_steady(attempt):
    """``attempt() -> (result, steady)``, repeated until steady or ``TRIES`` times:
    (the last result, tries, whether it was steady)."""
    for tries in range(1, TRIES + 1):
        result, ok = attempt()
        if ok:
            break
    return result, tries, ok


def calibrate(real, curves, trace):
    """Offline runs of ``trace`` on the real engine: (fitted cost, capacity of each of ``curves``,
    probe seconds of each of ``curves``)."""
    for c in curves:                                   # warm-up, left out of the fit
        real.serve(c, trace)

    def attempt():
        before = {c: probe(real, c, trace) for c in curves}
        runs = {c: real.serve(c, trace) for c in calibration_curves(curves)}
        after = {c: probe(real, c, trace) for c in curves}
        probes = {c: (before[c] + after[c]) / 2 for c in curves}
        return (runs, probes), steady(before.values(), after.values())

    (runs, probes), _, _ = until_steady(attempt)
    caps = {c: len(runs[c].requests) / max(runs[c].duration, 1e-12) for c in curves}
    return FittedCost.fit(list(runs.values()), real.cfg.n_layers), caps, probes


def compare(real, curves, spec: TraceSpec, loads, repeats: int = 1,
            progress: bool = True) -> tuple[pd.DataFrame, FittedCost]:
    """One row per (curve, load): measured vs simulated median normalized latency and throughput."""
    from tqdm.auto import tqdm
    offline = spec.make(None, real.cfg.vocab_size)       # calibration and probes serve it all at once
    cost, caps, probes = calibrate(real, curves, offline)
    rows = []
    with tqdm(total=len(curves) * len(loads), desc=f"{real.name}: real vs sim", disable=not progress) as bar:
        for c in curves:
            for load in loads:
                rate = load * caps[c]
                runs = [until_steady(lambda: _measure(real, cost, c, spec, rate, offline, probes[c]))
                        for _ in range(repeats)]
                m = pd.DataFrame([{**r, "tries": t, "steady": ok} for r, t, ok in runs])
                rows.append({"model": real.name, "curve": c.label, "load": load, "rate": rate,
                             "capacity_rps": caps[c], **m.drop(columns="steady").median().to_dict(),
                             "steady": bool(m["steady"].all())})
                bar.update()
    df = pd.DataFrame(rows)
    df["latency_error_pct"] = 100 * (df["simulated_ms"] / df["measured_ms"] - 1)
    df["latency_error_unscaled_pct"] = 100 * (df["simulated_unscaled_ms"] / df["measured_ms"] - 1)
    df["throughput_error_pct"] = 100 * (df["simulated_rps"] / df["measured_rps"] - 1)
    return df, cost


def _measure(real, cost, curve, spec, rate, offline, reference) -> tuple[dict, bool]:
    """One real run between two probes, the simulations of the same trace at the probed speed and
    at the fit's, and whether the machine held its speed."""
    before = probe(real, curve, offline)
    m = measure_point(real, curve, spec, rate)
    after = probe(real, curve, offline)
    speed = (before + after) / 2 / reference
    sim = lambda f: measure_point(SimBackend(real.cfg, cost=f, n_slots=real.n_slots), curve, spec, rate)
    s, u = sim(cost.at_speed(speed)), sim(cost)
    row = {"speed": speed, "measured_ms": m["median_norm_latency_ms"], "simulated_ms": s["median_norm_latency_ms"],
           "simulated_unscaled_ms": u["median_norm_latency_ms"], "measured_rps": m["throughput_rps"],
           "simulated_rps": s["throughput_rps"]}
    return row, steady([before], [after])
