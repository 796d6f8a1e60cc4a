"""A cost model fitted to iteration timings the real engine measured on the machine at hand, so the
simulator predicts that machine (CPU or GPU).

An iteration's time is modelled as linear in what its ops scale with: a constant (launches, the
scheduler's Python), the rows of ``[sum L, H]`` (Linear, LayerNorm, GeLU), the (query, key) pairs
of attention and the context it reads, and the number of requests (per-request attention, the LM
head). ORCA's selective batches and the baseline's padded batches run different attention code,
so each gets its own coefficients. The target is the iteration's period (one stage-0 start to the
next on a busy engine), which includes the engine's own per-iteration work between iterations.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

from orca_lab.engine.executor import split_layers
from orca_lab.engine.policies import system
from orca_lab.sim.executor import IDLE_GAP, IterationCost

FEATURES = ("const", "tokens", "attn_pairs", "attn_context", "requests")


def features(starts, q_lens) -> list[float]:
    """One row of the design matrix for a batch with these per-request starts and new tokens."""
    pairs = ctx = 0
    for s, q in zip(starts, q_lens):
        pairs += q * s + q * (q + 1) // 2      # (query, key) pairs under the causal mask
        ctx += s + q
    return [1.0, float(sum(q_lens)), float(pairs), float(ctx), float(len(q_lens))]


@dataclass
class FittedCost:
    """``coef[kind]`` for kind ``selective`` (ORCA) and ``padded`` (baseline), over ``FEATURES``;
    ``speed`` multiplies every prediction (a shared machine is slower at some moments than others)."""
    coef: dict
    n_layers: int = 1
    n_stages: int = 1
    speed: float = 1.0

    def __post_init__(self):
        self.stage_share = [(hi - lo) / self.n_layers for lo, hi in split_layers(self.n_layers, self.n_stages)]

    def predict(self, starts, q_lens, padded: bool) -> float:
        return self._predict(features(starts, q_lens), padded)

    def _predict(self, x, padded: bool) -> float:
        """Seconds for one row ``x`` of the design matrix, at this fit's speed."""
        kind = _kind(padded)
        if kind not in self.coef:
            raise ValueError(f"this fitted model saw no {kind} batches: calibrate with "
                             f"{'ft' if padded else 'orca'} runs too")
        return self.speed * float(np.dot(self.coef[kind], x))

    def speed_of(self, runs, busy_only: bool = False) -> float:
        """How many times slower (> 1) than this fit the machine ran ``runs``: their measured
        iteration periods over the fit's predictions for the same batches."""
        rows = list(self._predicted(runs, busy_only))
        if not rows:
            raise ValueError("no iteration periods to compare: give runs with at least two iterations")
        return sum(y for *_, y in rows) / sum(p for _, _, p, _ in rows)

    def _predicted(self, runs, busy_only: bool = False):
        """(run, features, predicted seconds, measured seconds) of every iteration period of ``runs``."""
        for run in runs:
            for x, y, _ in iteration_periods(run, busy_only):
                yield run, x, self._predict(x, _padded(run)), y

    def speed_profile(self, run, window: float = 1.0) -> "SpeedProfile":
        """How many times slower than this fit the machine ran ``run``, window by window of
        ``window`` seconds (its busy periods, as ``speed_of``): a shared machine changes speed every
        few seconds, which one figure for the whole run averages away. A window with fewer than
        ``MIN_PERIODS`` busy periods takes the whole run's figure. Iterations that start after the
        engine idled get a factor of their own and a delay before they start (``_after_idle``), and
        stay out of the windows."""
        woken, after_idle, wake = self._after_idle(run)
        sums = defaultdict(lambda: [0.0, 0.0, 0])
        for x, y, t in iteration_periods(run, busy_only=True):
            if t not in woken:
                s = sums[int(t // window)]
                s[0], s[1], s[2] = s[0] + y, s[1] + self._predict(x, _padded(run)), s[2] + 1
        whole = sum(s[0] for s in sums.values()) / sum(s[1] for s in sums.values()) if sums else \
            self.speed_of([run], busy_only=True)
        n = max(sums, default=-1) + 1
        return SpeedProfile(window, tuple(sums[i][0] / sums[i][1] if sums[i][2] >= MIN_PERIODS else whole
                                          for i in range(n)), whole, after_idle, wake)

    def _after_idle(self, run) -> tuple[set, float, float]:
        """The starts of the iterations that began after the engine idled (``IDLE_GAP``); how much
        slower they ran than busy ones, both as (end - start) over the fit's prediction: a core left
        idle is clocked down (on the 2-core CI machine the first ~30 ms after each sleep ran 25-40%
        slower: RealClock); and the median time from the arrival that woke the engine to the start
        of its iteration. A busy iteration's period holds the engine's Python before the next start;
        after a sleep that Python runs before the start, on the woken core (~0.5 ms on the 2-core
        CPU, where busy iterations are 0.2-0.3 ms apart), and the request waits for it."""
        ratios, woken, waits = ([], []), set(), []
        arrival = {r.rid: r.arrival for r in run.requests}
        first = first_stage_iterations(run)
        for (prev, _), (it, x) in zip(first, first[1:]):
            idle = it.start - prev.end > IDLE_GAP
            ratios[idle].append((it.end - it.start) / self._predict(x, _padded(run)))
            if idle:
                woken.add(it.start)
                waits.append(it.start - max(arrival[r] for r in it.rids if arrival[r] <= it.start))
        busy, slow = ratios
        if len(slow) < MIN_PERIODS or not busy:
            return woken, 1.0, 0.0
        return woken, float(np.median(slow) / np.median(busy)), float(np.median(waits))

    def at_speed(self, speed: float) -> "FittedCost":
        """The same fit on a machine ``speed`` times slower (> 1) or faster (< 1)."""
        return replace(self, speed=speed)

    def iteration(self, batch) -> IterationCost:
        t = self.predict(batch.starts, batch.q_lens, batch.padded)
        return IterationCost(tuple(t * share for share in self.stage_share))

    @classmethod
    def fit(cls, runs, n_layers: int = 1, n_stages: int = 1) -> "FittedCost":
        """Least squares (coefficients kept >= 0) of the iteration periods of ``runs``: RunResults
        of the real engine on offline traces. Slow iterations are kept, not dropped as outliers: on
        a shared machine another process takes the core now and then, and the requests served
        later pay for that too, so the fit must predict the average iteration, not the best."""
        rows = defaultdict(lambda: ([], []))
        for run in runs:
            kind = _kind(_padded(run))
            for x, y, _ in iteration_periods(run):
                rows[kind][0].append(x)
                rows[kind][1].append(y)
        if not rows:
            raise ValueError("no iteration timings to fit: give runs with at least two iterations")
        coef = {k: _nnls(np.array(X), np.array(y)).tolist() for k, (X, y) in rows.items()}
        return cls(coef, n_layers, n_stages)

    def errors(self, runs):
        """Per-iteration measured vs predicted periods of ``runs`` (a DataFrame), to judge the fit."""
        import pandas as pd
        return pd.DataFrame([{"system": run.system, "tokens": x[1], "requests": x[4], "measured_ms": y * 1e3,
                              "predicted_ms": pred * 1e3} for run, x, pred, y in self._predicted(runs)])

    def to_json(self) -> dict:
        return {"features": FEATURES, "coef": self.coef, "n_layers": self.n_layers, "n_stages": self.n_stages,
                "speed": self.speed}

    def save(self, path):
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path) -> "FittedCost":
        d = json.loads(open(path).read())
        return cls(d["coef"], d["n_layers"], d["n_stages"], d.get("speed", 1.0))


MIN_PERIODS = 5     # busy periods a window needs for a speed of its own (and iterations after idle for theirs)


@dataclass(frozen=True)
class SpeedProfile:
    """A machine's speed (times slower than a fit) through a run: ``speeds[i]`` over
    [i * window, (i + 1) * window) seconds of the run's clock, ``rest`` before and after, times
    ``after_idle`` for an iteration that starts after the engine idled, which starts ``wake``
    seconds after the arrival that woke it."""
    window: float
    speeds: tuple
    rest: float
    after_idle: float = 1.0
    wake: float = 0.0

    def __call__(self, t: float, idle: bool = False) -> float:
        i = int(t // self.window)
        return (self.speeds[i] if 0 <= i < len(self.speeds) else self.rest) * (self.after_idle if idle else 1.0)


def _padded(run) -> bool:
    """Whether ``run``'s batches were padded: its system schedules whole requests."""
    return system(run.system).request_level


def _kind(padded: bool) -> str:
    """The baseline's padded batches and ORCA's selective ones run different attention code."""
    return "padded" if padded else "selective"


def first_stage_iterations(run) -> list[tuple[object, list[float]]]:
    """(record, features) of every first-stage iteration of ``run``, in order. Each request's start
    (tokens cached) is rebuilt by adding up the new tokens it brought to earlier iterations."""
    cached, out = defaultdict(int), []
    for it in sorted((it for it in run.iterations if it.stage == 0), key=lambda it: it.iteration):
        out.append((it, features([cached[r] for r in it.rids], it.q_lens)))
        for r, q in zip(it.rids, it.q_lens):
            cached[r] += q
    return out


def iteration_periods(run, busy_only: bool = False):
    """(features, seconds, start) of every iteration of ``run`` but the last: from its first stage's
    start to the next iteration's. ``busy_only`` keeps the periods in which the engine cannot have
    slept waiting for arrivals (some request goes on into the next iteration): in an online run the
    others may hold idle time."""
    first = first_stage_iterations(run)
    return [(x, nxt.start - it.start, it.start) for (it, x), (nxt, _) in zip(first, first[1:])
            if not busy_only or not set(it.rids).isdisjoint(nxt.rids)]


def _nnls(X, y):
    """Least squares with coefficients >= 0: a feature whose coefficient comes out negative
    explains nothing physical (time never shrinks with more work); drop it and refit."""
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef
