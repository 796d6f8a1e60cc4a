"""Does the simulator predict the machine at hand? Serve the same traces with the real engine and
with the simulator on a cost model fitted to that engine's timings, and compare.

1. Calibrate: the trace is served offline (all requests at t=0) on the real engine by each curve,
   and its first requests by the same system at smaller batch sizes (a fit needs batches of every
   size it will be asked about: at light load most batches hold one request); the iteration
   periods of those runs fit a ``FittedCost``, and each curve's offline throughput is its measured
   capacity. A warm-up run goes first: a process's first runs are slow (allocations, first-call
   kernel choices).
2. Compare: at each load (a fraction of that capacity) the real engine and the simulator serve the
   same Poisson trace; the table holds both medians of normalized latency, both throughputs and
   their relative errors.

A shared machine changes speed by tens of percent from one second to the next (other tenants on
the same physical cores: on this project's 2-core machine a fixed matmul loop switches between
about 6.3 and 8.6 ms every few seconds, each core on its own), which no model of the engine can
predict. So a *probe* (the first requests of the trace, offline, with the same curve, for at least
half the run's length: a long run outlasts many speed spells) is timed just before and just
after each real run, and the simulator runs that point at the machine's speed of the moment
(``FittedCost.at_speed``): the probes' iteration periods over the fit's predictions for the same
batches (``FittedCost.speed_of``), so the fit itself is the reference. The probes are not the run
they correct. When the two probes differ by more than ``STEADY``, the machine changed speed during
the run and the point is measured again (up to ``TRIES`` times; the table says how many it took
and whether the last was steady). Calibration is held to the same rule. With ``repeats > 1`` each
point is measured that many times and the medians are compared.

Two more predictions stay in the table to read the error by: at the fit's own speed
(``simulated_unscaled_ms``), and, as a diagnostic only, at the speed the real run itself ran at
(``run_speed``: its busy iterations over the fit's predictions), which leaves the simulator only
the scheduling, batching and queueing to get right; it uses the measured run, so it is not a
prediction.
"""
from __future__ import annotations

import pandas as pd

from orca_lab.sim.fitted import FittedCost
from orca_lab.sim.run import Curve, SimBackend, TraceSpec, measure_point, serve_point

PROBE_REQUESTS = 8
PROBE_SECONDS = 0.5     # a probe repeats until it has run at least this long
PROBE_SHARE = 0.5       # ... or this share of the run it brackets: the machine's speed spells last
                        # seconds, and a probe a tenth of a gpt2 run long missed its speed by up to 12%
CALIBRATION_REQUESTS = 16   # the smaller batch sizes are fitted on the trace's first requests
STEADY = 0.1            # the probes around a run may differ by this fraction
TRIES = 4


def calibration_curves(curves) -> list[Curve]:
    """Each system at max_bs 1, 2, 4... below ``curves`` (ft with mbs = max_bs), not the curves."""
    out = set()
    for c in curves:
        b = 1
        while b < c.max_bs:
            out.add(Curve(c.system, b, b if c.system == "ft" else None))
            b *= 2
    return sorted(out - set(curves), key=lambda c: (c.system, c.max_bs, c.mbs or 0))


def probe(real, curve: Curve, trace, seconds: float = PROBE_SECONDS) -> list:
    """The real engine's runs of the first requests of ``trace`` offline, as many as fit in
    ``seconds`` (at least one)."""
    runs = []
    while not runs or sum(r.duration for r in runs) < seconds:
        runs.append(real.serve(curve, trace[:PROBE_REQUESTS]))
    return runs


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
    """Offline runs of ``trace`` on the real engine (of its first ``CALIBRATION_REQUESTS`` for the
    smaller batch sizes): (fitted cost, capacity of each of ``curves``)."""
    for c in curves:                                   # warm-up, left out of the fit
        real.serve(c, trace)

    def attempt():
        before = [probe(real, c, trace) for c in curves]
        runs = {c: real.serve(c, trace) for c in curves}
        runs.update({c: real.serve(c, trace[:CALIBRATION_REQUESTS]) for c in calibration_curves(curves)})
        after = [probe(real, c, trace) for c in curves]
        cost = FittedCost.fit(list(runs.values()), real.cfg.n_layers)
        speeds = lambda probes: [cost.speed_of(p) for p in probes]
        return (cost, runs), steady(speeds(before), speeds(after))

    (cost, runs), _, _ = until_steady(attempt)
    return cost, {c: len(runs[c].requests) / max(runs[c].duration, 1e-12) for c in curves}


def compare(real, curves, spec: TraceSpec, loads, repeats: int = 1,
            progress: bool = True) -> tuple[pd.DataFrame, FittedCost]:
    """One row per (curve, load): measured vs simulated median normalized latency and throughput."""
    from tqdm.auto import tqdm
    offline = spec.make(None, real.cfg.vocab_size)       # calibration and probes serve it all at once
    cost, caps = calibrate(real, curves, offline)
    rows = []
    with tqdm(total=len(curves) * len(loads), desc=f"{real.name}: real vs sim", disable=not progress) as bar:
        for c in curves:
            for load in loads:
                rate = load * caps[c]
                runs = [until_steady(lambda: _measure(real, cost, c, spec, rate, offline))
                        for _ in range(repeats)]
                m = pd.DataFrame([{**r, "tries": t, "steady": ok} for r, t, ok in runs])
                rows.append({"model": real.name, "curve": c.label, "load": load, "rate": rate,
                             "capacity_rps": caps[c], **m.drop(columns="steady").median().to_dict(),
                             "steady": bool(m["steady"].all())})
                bar.update()
    df = pd.DataFrame(rows)
    for name, col in (("", "simulated_ms"), ("_unscaled", "simulated_unscaled_ms"),
                      ("_at_run_speed", "simulated_at_run_speed_ms")):
        df[f"latency_error{name}_pct"] = 100 * (df[col] / df["measured_ms"] - 1)
    df["throughput_error_pct"] = 100 * (df["simulated_rps"] / df["measured_rps"] - 1)
    df["run_load"] = df["load"] * df["run_speed"]      # against the capacity the machine had during the run
    return df, cost


def _measure(real, cost, curve, spec, rate, offline) -> tuple[dict, bool]:
    """One real run between two probes; the simulations of the same trace at the probed speed, at
    the fit's and at the run's own; and whether the machine held its speed."""
    seconds = max(PROBE_SECONDS, PROBE_SHARE * spec.n_requests / rate)
    before = cost.speed_of(probe(real, curve, offline, seconds))
    m, run = serve_point(real, curve, spec, rate)
    after = cost.speed_of(probe(real, curve, offline, seconds))
    speed, run_speed = (before + after) / 2, cost.speed_of([run], busy_only=True)
    sim = lambda s: measure_point(SimBackend(real.cfg, cost=cost.at_speed(s), n_slots=real.n_slots), curve, spec, rate)
    s, u, r = sim(speed), sim(1.0), sim(run_speed)
    row = {"speed": speed, "run_speed": run_speed, "measured_ms": m["median_norm_latency_ms"],
           "simulated_ms": s["median_norm_latency_ms"], "simulated_unscaled_ms": u["median_norm_latency_ms"],
           "simulated_at_run_speed_ms": r["median_norm_latency_ms"], "measured_rps": m["throughput_rps"],
           "simulated_rps": s["throughput_rps"]}
    return row, steady([before], [after])
