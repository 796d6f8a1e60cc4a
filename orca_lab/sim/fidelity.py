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

The prediction comes first: the simulator at the speed of *probes* (the first requests of the
trace, offline, same curve, for at least half the run's length) timed just before and after each
run (``speed``, ``simulated_ms``, ``latency_error_pct``), told nothing of the run itself; and at the
fit's own speed (``simulated_unscaled_ms``). When the two probes differ by more than ``STEADY`` the
machine changed speed during the run (``steady``); with ``max_tries > 1`` the run is then measured
again, and calibration is held to the same rule.

A shared machine changes speed by tens of percent from one second to the next (other tenants on
the same physical cores: on this project's 2-core machine a fixed matmul loop switches between
about 6.3 and 8.6 ms every few seconds, each core on its own), which no model of the engine can
predict. So a replay comes second, named as one: each real run against the simulator at the speed
that run itself ran at, second by second (``SPEED_WINDOW``: its busy iteration periods in each
window over the fit's predictions for the same batches, ``FittedCost.speed_profile``; the
simulator's iteration started at time t runs at that window's speed, and one started after the
engine idled by the factor the run's own such iterations show, after the delay they show from the
arrival that woke the engine). It reads the run it is compared with, so it checks the scheduling,
batching and queueing, not the prediction of time. The same at one speed for the whole run
(``run_speed``, ``FittedCost.speed_of``) is a further column. Each point is run ``repeats`` times;
the table keeps the median errors, the replay's spread over the repeats, and the real engine's own
spread from one repeat to the next, the yardstick for the error. Besides the median normalized
latency the replay compares the statistics the field reports (``STATS``: Vidur's P95 of normalized
latency, LLMServingSim's mean and P90 TTFT, TPOT and end-to-end latency).
"""
from __future__ import annotations

import math

import pandas as pd

from orca_lab.config import check_range
from orca_lab.metrics import summarize
from orca_lab.sim.fitted import FittedCost
from orca_lab.sim.sweep import Curve, TraceSpec, serve_point
from orca_lab.sim.backends import SimBackend

PROBE_REQUESTS = 8
PROBE_SECONDS = 0.5     # a probe repeats until it has run at least this long
PROBE_SHARE = 0.5       # ... or this share of the run it brackets: the machine's speed spells last
                        # seconds, and a probe a tenth of a gpt2 run long missed its speed by up to 12%
CALIBRATION_REQUESTS = 16   # the smaller batch sizes are fitted on the trace's first requests
STEADY = 0.1            # the probes around a run may differ by this fraction
SPEED_WINDOW = 1.0      # seconds: the run's own speed is measured window by window (FittedCost.speed_profile)
TRIES = 4


def calibration_curves(curves) -> list[Curve]:
    """Each system at max_bs 1, 2, 4... below ``curves`` (ft with mbs = max_bs), not the curves."""
    out = set()
    for c in curves:
        b = 1
        while b < c.max_bs:
            out.add(Curve.of(c.system, b))
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


def until_steady(attempt, tries: int | None = None):
    """``attempt() -> (result, steady)``, repeated until steady or ``tries`` (default ``TRIES``)
    times: (the last result, tries, whether it was steady)."""
    tries = check_range("max_tries", TRIES if tries is None else tries, 1, 100)
    for n in range(1, tries + 1):
        result, ok = attempt()
        if ok:
            break
    return result, n, ok


def calibrate(real, curves, trace, max_tries: int | None = None):
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

    (cost, runs), _, _ = until_steady(attempt, max_tries)
    return cost, {c: len(runs[c].requests) / max(runs[c].duration, 1e-12) for c in curves}


# The field's statistics, each for the real run and the simulator at that run's speed: Vidur's (the
# P95 of normalized end-to-end latency, reported at 85% of capacity) and LLMServingSim's (mean and
# percentile TTFT, TPOT and end-to-end latency), beside the median normalized latency.
STATS = ("norm_latency_median", "norm_latency_p95", "ttft_mean", "ttft_p90", "tpot_mean", "tpot_p90",
         "e2e_mean", "e2e_p90")


def request_stats(result) -> dict:
    """``STATS`` of one run, in ms (read by ``metrics.summarize``)."""
    row = summarize(result)
    return {name: row[f"{name}_ms"] for name in STATS}


def compare(real, curves, spec: TraceSpec, loads, repeats: int = 1, progress: bool = True,
            max_tries: int | None = None) -> tuple[pd.DataFrame, FittedCost]:
    """One row per (curve, load): measured vs simulated latency and throughput. Each of ``repeats``
    real runs is predicted at the probed and the fit's speeds (medians over the repeats), and
    replayed at that run's own speed (the ``_min``/``_max`` columns give the replay error's spread
    over the repeats); ``measured_spread_pct`` is the real engine's own spread:
    (max - min) / median of its median normalized latency over the repeats."""
    from tqdm.auto import tqdm
    offline = spec.make(None, real.cfg.vocab_size)       # calibration and probes serve it all at once
    cost, caps = calibrate(real, curves, offline, max_tries)
    rows = []
    with tqdm(total=len(curves) * len(loads), desc=f"{real.name}: real vs sim", disable=not progress) as bar:
        for c in curves:
            for load in loads:
                rate = load * caps[c]
                runs = [until_steady(lambda: _measure(real, cost, c, spec, rate, offline), max_tries)
                        for _ in range(repeats)]
                m = pd.DataFrame([{**r, "tries": t, "steady": ok} for r, t, ok in runs])
                rows.append({"model": real.name, "curve": c.label, "load": load, "rate": rate,
                             "capacity_rps": caps[c], "repeats": repeats, **_summarize(m)})
                bar.update()
    df = pd.DataFrame(rows)
    for name, col in (("", "simulated_ms"), ("_unscaled", "simulated_unscaled_ms")):
        df[f"latency_error{name}_pct"] = 100 * (df[col] / df["measured_ms"] - 1)
    df["throughput_error_pct"] = 100 * (df["simulated_rps"] / df["measured_rps"] - 1)
    df["run_load"] = df["load"] * df["run_speed"]      # against the capacity the machine had during the run
    return df, cost


def _summarize(m: pd.DataFrame) -> dict:
    """The repeats of one point: medians, and the spread of the primary error and of the real runs."""
    err = m["latency_error_at_run_speed_pct"]
    out = m.drop(columns="steady").median().to_dict()
    out.update({"latency_error_at_run_speed_min_pct": err.min(), "latency_error_at_run_speed_max_pct": err.max(),
                "measured_spread_pct": 100 * (m["measured_ms"].max() - m["measured_ms"].min()) / m["measured_ms"].median(),
                "steady": bool(m["steady"].all())})
    return out


def _measure(real, cost, curve, spec, rate, offline) -> tuple[dict, bool]:
    """One real run between two probes; the simulations of the same trace at the probed speed, at
    the fit's (predictions) and at the run's own (the replay); the replay's errors for every
    statistic; and whether the machine held its speed."""
    seconds = max(PROBE_SECONDS, PROBE_SHARE * spec.n_requests / rate)
    before = cost.speed_of(probe(real, curve, offline, seconds))
    m, run = serve_point(real, curve, spec, rate)
    after = cost.speed_of(probe(real, curve, offline, seconds))
    speed, run_speed = (before + after) / 2, cost.speed_of([run], busy_only=True)
    sim = lambda c, profile=None: serve_point(SimBackend(real.cfg, cost=c, n_slots=real.n_slots, speed=profile),
                                              curve, spec, rate)
    (s, _), (u, _), (w, _) = sim(cost.at_speed(speed)), sim(cost), sim(cost.at_speed(run_speed))
    r, r_run = sim(cost, cost.speed_profile(run, SPEED_WINDOW))
    row = {"speed": speed, "run_speed": run_speed, "measured_ms": m["norm_latency_median_ms"],
           "simulated_ms": s["norm_latency_median_ms"], "simulated_unscaled_ms": u["norm_latency_median_ms"],
           "simulated_at_run_speed_ms": r["norm_latency_median_ms"],
           "simulated_at_mean_run_speed_ms": w["norm_latency_median_ms"], "measured_rps": m["throughput_rps"],
           "simulated_rps": s["throughput_rps"]}
    row["latency_error_at_run_speed_pct"] = error_pct(row["simulated_at_run_speed_ms"], row["measured_ms"])
    row["latency_error_at_mean_run_speed_pct"] = error_pct(row["simulated_at_mean_run_speed_ms"], row["measured_ms"])
    measured, simulated = request_stats(run), request_stats(r_run)
    for k in STATS:
        row[f"measured_{k}_ms"] = measured[k]
        row[f"{k}_error_pct"] = error_pct(simulated[k], measured[k])
    return row, steady([before], [after])


def error_pct(simulated: float, measured: float) -> float:
    """The relative error (%). A statistic that is 0 in both agrees (ft's TPOT: the request-level
    baseline hands a request all its tokens at once); 0 in the real run alone has none (nan)."""
    if measured == 0:
        return 0.0 if simulated == 0 else math.nan
    return 100 * (simulated / measured - 1)


def field_summary(df: pd.DataFrame, vidur_load: float = 0.85) -> pd.DataFrame:
    """|error| (%) of each statistic at the run's speed, as the field reports it: the median and the
    largest over the points below saturation during their run (``run_load`` < 1), and Vidur's own
    figure, the P95 of normalized latency at ``vidur_load`` of capacity (the points at the load
    nearest it)."""
    below = df[df["run_load"] < 1]
    cols = ["latency_error_at_run_speed_pct"] + [f"{k}_error_pct" for k in STATS]
    rows = [{"statistic": c.removesuffix("_pct"), "median_abs_pct": below[c].abs().median(),
             "max_abs_pct": below[c].abs().max(), "points": int(below[c].notna().sum())} for c in cols]
    nearest = df.loc[(df["load"] - vidur_load).abs() == (df["load"] - vidur_load).abs().min()]
    rows.append({"statistic": f"vidur: norm_latency_p95 error at load {nearest['load'].iloc[0]:g}",
                 "median_abs_pct": nearest["norm_latency_p95_error_pct"].abs().median(),
                 "max_abs_pct": nearest["norm_latency_p95_error_pct"].abs().max(), "points": len(nearest)})
    return pd.DataFrame(rows)
