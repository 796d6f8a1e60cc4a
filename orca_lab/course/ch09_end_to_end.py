"""Chapter 09, end to end: the grader of the paper's metric, the median normalized latency."""
from __future__ import annotations

import random
import statistics

from orca_lab.course.bounded import a_number, refuse_package_code, run_bounded
from orca_lab.course.forked import grader
from orca_lab.course.harness import N_CASES, correct, differ, read
from orca_lab.engine.engine import RequestRecord, RunResult
from orca_lab.metrics import per_request


@grader
def check_median_norm_latency(fn, seed: int = 0):
    """``fn(records) -> ms``: the median over requests of (finish - arrival) / tokens generated,
    against ``metrics.per_request`` on random records."""
    refuse_package_code(fn, per_request)
    rng = random.Random(seed)
    for case in range(N_CASES):
        recs = []
        for rid in range(rng.randint(1, 9)):
            arrival = rng.uniform(0, 5)
            n = rng.randint(1, 40)
            recs.append(RequestRecord(rid, arrival, 4, n, arrival, arrival + 0.1, arrival + rng.uniform(0.1, 9),
                                      n, (0,) * n))
        expected = statistics.median(per_request(RunResult("orca", recs, [])).norm_latency) * 1e3
        label = f"case {case} ({len(recs)} requests)"
        got = read("the median normalized latency (ms)", label,
                   run_bounded(fn, recs, case=label, references=(per_request,)), a_number, "a number of milliseconds")
        if not abs(got - expected) <= 1e-6 * max(1.0, expected):      # (NaN differs from every answer)
            differ("the median normalized latency (ms)", label, expected, got, _median_hint(expected, got))
    correct(N_CASES, "orca_lab.metrics.per_request")


def _median_hint(expected: float, got: float) -> str:
    if abs(got - expected / 1e3) <= 1e-6 * max(1.0, expected):
        return "in milliseconds: seconds * 1e3"
    return "per request (t_finish - arrival) / n_generated, then the median over requests (not the mean)"
