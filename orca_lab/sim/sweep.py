"""Sweeps of arrival rates into latency-throughput tables (ORCA §6, Figures 9-11): the curves, the
traces, one point, the capacity probe, and Figure 9's time per batch.

A *backend* (``backends.py``) serves a trace with one curve's settings and returns the engine's
``RunResult``; the sweep does not know which one it drives."""
from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace

import pandas as pd

from orca_lab.config import check_range
from orca_lab.engine.policies import REGISTRY, system as resolve
from orca_lab.metrics import summarize
from orca_lab.workload import homogeneous_trace, paper_trace, real_trace

# Fractions of a curve's capacity: points from light load to well past saturation, denser at the knee.
DEFAULT_LOADS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 2.0, 3.0)


CSV_COLUMNS = ["model", "system", "max_bs", "mbs", "rate", "throughput_rps", "norm_latency_median_ms"]


@dataclass(frozen=True)
class Curve:
    """One line of the paper's figures, for any system of the registry (``engine/policies.py``):
    ``orca(max_bs)``; a request-level one with its micro-batch size, ``ft(max_bs, mbs)``; or a policy
    after ORCA, ``paged(max_bs)``, ``chunked(max_bs)``."""
    system: str
    max_bs: int
    mbs: int | None = None

    def __post_init__(self):
        request_level = resolve(self.system).request_level
        check_range("max_bs", self.max_bs, 1, 65536)
        if request_level:
            check_range("mbs", self.mbs, 1, self.max_bs)
        elif self.mbs is not None:
            raise ValueError(f"mbs={self.mbs} is only for request-level systems (micro-batches): write "
                             f"{self.system}({self.max_bs})")

    @classmethod
    def parse(cls, text: str) -> "Curve":
        m = re.fullmatch(r"\s*([\w-]+)\((\d+)(?:,\s*(\d+))?\)\s*", str(text))
        if not m or m[1] not in REGISTRY or (m[3] is None) == REGISTRY[m[1]].request_level:
            forms = [f"{n}(max_bs,mbs)" if s.request_level else f"{n}(max_bs)" for n, s in REGISTRY.items()]
            raise ValueError(f"curve {text!r} is not allowed: write {', '.join(forms)}: e.g. "
                             f"{', '.join(repr(Curve.of(n, 8).label) for n in REGISTRY)}")
        return cls(m[1], int(m[2]), None if m[3] is None else int(m[3]))

    @classmethod
    def of(cls, system: str, max_bs: int) -> "Curve":
        """``system`` at ``max_bs``, a request-level one in micro-batches of max_bs (one batch in flight)."""
        return cls(system, max_bs, max_bs if resolve(system).request_level else None)

    @property
    def label(self) -> str:
        return f"{self.system}({self.max_bs})" if self.mbs is None else f"{self.system}({self.max_bs},{self.mbs})"


# -- traces ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceSpec:
    """A trace to draw at any rate: the paper's (``input_len``/``gen_len`` None), homogeneous, or
    shaped like a real workload (``shape``, one of ``workload.REAL_SHAPES``); ``cv`` > 1 makes
    arrivals bursty. The same seed gives the same lengths at every rate, and arrivals that only
    scale with it."""
    n_requests: int = 200
    seed: int = 0
    scale: float = 1.0
    input_len: int | None = None
    gen_len: int | None = None
    shape: str | None = None
    cv: float = 1.0

    def make(self, rate: float | None, vocab_size: int, max_len: int = 2048):
        if self.shape is not None:
            return real_trace(self.shape, self.n_requests, rate, self.seed, self.scale, max_len, vocab_size, self.cv)
        if self.input_len is None:
            return paper_trace(self.n_requests, rate, self.seed, scale=self.scale, vocab_size=vocab_size, cv=self.cv)
        return homogeneous_trace(self.n_requests, self.input_len, self.gen_len, rate, self.seed, vocab_size, self.cv)


# -- one point ------------------------------------------------------------------------------------
def measure_point(backend, curve: Curve, spec: TraceSpec, rate: float | None) -> dict:
    """Serve ``spec`` at ``rate`` (None: all at once) and summarize it as one row of a sweep."""
    return serve_point(backend, curve, spec, rate)[0]


def serve_point(backend, curve: Curve, spec: TraceSpec, rate: float | None):
    """``measure_point``'s row, and the ``RunResult`` it summarizes."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = backend.serve(curve, spec.make(rate, backend.cfg.vocab_size, backend.cfg.max_seq_len))
    return {"model": backend.name, **summarize(result), "system": curve.system, "max_bs": curve.max_bs,
            "mbs": curve.mbs, "rate": rate, "wall_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0}, result


def capacity(backend, curve: Curve, spec: TraceSpec) -> float:
    """Requests/s when every request of ``spec`` is there from the start: the curve's saturation."""
    return measure_point(backend, curve, spec, None)["throughput_rps"]


# -- sweeps ---------------------------------------------------------------------------------------
@dataclass
class Sweep:
    """Latency-throughput points of ``curves`` on each backend, at ``rates`` (req/s) or, when
    ``rates`` is None, at ``loads`` times each curve's capacity (so every curve gets points up to
    and past its own saturation, whatever its speed). Capacity is the throughput of an offline run
    (every request there at t=0) of the trace, or of its first ``capacity_requests`` requests.

    A point at ``rate`` serves ``max(spec.n_requests, rate * span_s)`` requests (None: always
    ``spec.n_requests``), so the trace grows with the load: below saturation it outlasts the queue's
    transients, and past it every point's queue builds over the same span of arrivals, instead of
    the fast curves' traces ending seconds after they saturate. ``keep(rows)``: called with the
    points done so far as each ends (a measured run saves them, so a cut run keeps them)."""
    backends: list
    curves: list[Curve]
    spec: TraceSpec
    rates: list[float] | None = None
    loads: list[float] = field(default_factory=lambda: list(DEFAULT_LOADS))
    capacity_requests: int | None = None
    n_procs: int = 1
    progress: bool = True
    span_s: float | None = None
    keep: Callable[[list[dict]], None] | None = None

    def run(self) -> pd.DataFrame:
        with _pool(self.n_procs) as pool:
            caps = self.capacities(pool)
            return self.frame(self.points(caps, pool), caps)

    def capacities(self, pool=None) -> dict:
        """The offline run of each (backend name, curve) that sets its capacity, a row each; none
        when ``rates`` are given."""
        if self.rates is not None:
            return {}
        n_cap = min(self.capacity_requests or self.spec.n_requests, self.spec.n_requests)
        cap_spec = dataclasses.replace(self.spec, n_requests=n_cap)
        jobs = [(b, c, cap_spec, None) for b in self.backends for c in self.curves]
        return {(b.name, c): row for (b, c, *_), row in zip(jobs, _map(pool, jobs, "capacity", self.progress))}

    def points(self, caps: dict, pool=None) -> list[dict]:
        """A row per (backend, curve, rate): ``rates``, or ``loads`` times the capacity in ``caps``."""
        jobs = [(b, c, self.spec_at(r), r) for b in self.backends for c in self.curves
                for r in self._rates(_throughput(caps.get((b.name, c))))]
        return _map(pool, jobs, "sweep", self.progress, self.keep)

    def frame(self, rows: list[dict], caps: dict) -> pd.DataFrame:
        """The sweep's table: ``rows`` with each curve's capacity and each point's load."""
        df = pd.DataFrame(rows)
        df["capacity_rps"] = [_throughput(caps.get((m, curve_of(s, bs, mbs))), math.nan)
                              for m, s, bs, mbs in zip(df["model"], df["system"], df["max_bs"], df["mbs"])]
        df["load"] = df["rate"] / df["capacity_rps"]
        df["mbs"] = df["mbs"].astype("Int64")
        return df

    def _rates(self, cap):
        return list(self.rates) if cap is None else [cap * f for f in self.loads]

    def spec_at(self, rate: float) -> TraceSpec:
        """The trace of the point at ``rate``: at least ``span_s`` seconds of arrivals."""
        if self.span_s is None:
            return self.spec
        check_range("span_s", self.span_s, 0.0, None, kind=float)
        return replace(self.spec, n_requests=max(self.spec.n_requests, math.ceil(rate * self.span_s)))


def _throughput(row, default=None):
    return default if row is None else row["throughput_rps"]


def curve_of(system, max_bs, mbs):
    return Curve(system, int(max_bs), None if mbs is None or pd.isna(mbs) else int(mbs))


def _point(job):
    return measure_point(*job)


def _map(pool, jobs, what: str, progress: bool, keep=None) -> list[dict]:
    """Run ``jobs`` (in ``pool`` if any) with a progress bar; rows come back in job order, and
    ``keep`` sees those done so far as each ends."""
    from tqdm.auto import tqdm
    bar = tqdm(total=len(jobs), desc=what, unit="run", disable=not progress)
    rows = [None] * len(jobs)

    def done(i, row):
        rows[i] = row
        bar.update()
        if keep is not None:
            keep([r for r in rows if r is not None])

    if pool is None:
        for i, job in enumerate(jobs):
            done(i, _point(job))
    else:
        futures = {pool.submit(_point, job): i for i, job in enumerate(jobs)}
        for f in as_completed(futures):
            done(futures[f], f.result())
    bar.close()
    return rows


class _pool:
    """A process pool for simulated sweeps (``n_procs > 1``); forkserver workers start from a clean
    interpreter, not from a copy of a notebook kernel's threads."""
    def __init__(self, n_procs: int):
        check_range("n_procs", n_procs, 1, 256)
        self.n_procs, self.pool = n_procs, None

    def __enter__(self):
        if self.n_procs > 1:
            import multiprocessing as mp
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["orca_lab.sim.sweep"])
            self.pool = ProcessPoolExecutor(self.n_procs, mp_context=ctx)
        return self.pool

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


# -- Figure 9: engine time per batch --------------------------------------------------------------
def batch_time(backend, system: str, batch_size: int, input_len: int, gen_len: int = 32) -> dict:
    """Time to run one batch of equal requests from start to end (the paper's Figure 9), or an
    out-of-memory mark when the batch's K/V reservation does not fit ``backend.n_slots``."""
    curve = Curve.of(system, batch_size)
    per_request_slots = backend.cfg.max_seq_len if resolve(system).request_level else input_len + gen_len
    row = {"model": backend.name, "system": system, "batch_size": batch_size, "input_len": input_len,
           "gen_len": gen_len, "kv_slots_needed": batch_size * per_request_slots, "n_slots": backend.n_slots}
    row["oom"] = row["kv_slots_needed"] > backend.n_slots
    if row["oom"]:
        return {**row, "time_ms": math.nan}
    trace = homogeneous_trace(batch_size, input_len, gen_len, None, 0, backend.cfg.vocab_size)
    return {**row, "time_ms": backend.serve(curve, trace).duration * 1e3}

