"""Entry points: serve one trace on a simulated (or real) engine, and sweep arrival rates into a
latency-throughput table (ORCA §6, Figures 9-11).

A *backend* serves a trace with one curve's settings and returns the engine's ``RunResult``:
``SimBackend`` assembles the real engine loop, scheduler and K/V slot manager around a
``SimExecutor``; ``RealBackend`` runs the GPT of ``orca_lab.llm`` on the machine at hand. The sweep
does not know which one it drives.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from orca_lab.config import EngineConfig, ModelConfig, check_choice, check_range, model_config
from orca_lab.engine.engine import Engine
from orca_lab.engine.policies import PAGED, new_kv, new_scheduler
from orca_lab.llm import LLM
from orca_lab.metrics import summarize
from orca_lab.sim.calibration import efficiency
from orca_lab.sim.cost import AnalyticalCost, Efficiency
from orca_lab.sim.executor import SimExecutor
from orca_lab.workload import TraceItem, homogeneous_trace, paper_trace, real_trace

# Fractions of a curve's capacity: points from light load to well past saturation, denser at the knee.
DEFAULT_LOADS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 2.0, 3.0)


CSV_COLUMNS = ["model", "system", "max_bs", "mbs", "rate", "throughput_rps", "norm_latency_median_ms"]


@dataclass(frozen=True)
class Curve:
    """One line of the paper's figures: ``orca(max_bs)`` or ``ft(max_bs, mbs)``; or a policy after
    ORCA, ``paged(max_bs)`` or ``chunked(max_bs)`` (``engine/policies.py``)."""
    system: str
    max_bs: int
    mbs: int | None = None

    def __post_init__(self):
        check_choice("system", self.system, ("orca", "ft", *PAGED))
        check_range("max_bs", self.max_bs, 1, 65536)
        if self.system == "ft":
            check_range("mbs", self.mbs, 1, self.max_bs)
        elif self.mbs is not None:
            raise ValueError(f"mbs={self.mbs} is only for ft curves: write {self.system}({self.max_bs})")

    @classmethod
    def parse(cls, text: str) -> "Curve":
        m = re.fullmatch(r"\s*(orca|paged|chunked)\((\d+)\)\s*|\s*(ft)\((\d+),\s*(\d+)\)\s*", str(text))
        if not m:
            raise ValueError(f"curve {text!r} is not allowed: write orca(max_bs) or ft(max_bs,mbs), "
                             "or paged(max_bs), chunked(max_bs): e.g. 'orca(8)', 'ft(8,8)', 'paged(8)'")
        if m.group(1):
            return cls(m.group(1), int(m.group(2)))
        return cls("ft", int(m.group(4)), int(m.group(5)))

    @property
    def label(self) -> str:
        return f"ft({self.max_bs},{self.mbs})" if self.system == "ft" else f"{self.system}({self.max_bs})"


# -- backends -----------------------------------------------------------------------------------
@dataclass
class SimBackend:
    """The engine of ``orca_lab`` on a cost model: ``AnalyticalCost`` of ``model`` on ``device`` with
    the paper's parallelism unless given, its parameters ``eff`` or those of the named ``cost``
    ("calibrated" on published GPU measurements, the default, or "analytical":
    ``orca_lab.sim.calibration``), or any object with ``iteration(batch)`` and ``n_stages``.
    Paged curves cut the same ``n_slots`` into blocks of ``block_size`` (the remainder, less than a
    block, unused); chunked ones take ``max_num_batched_tokens`` new tokens per iteration."""
    model: str | ModelConfig
    device: str = "a100-40gb"
    eff: Efficiency | None = None
    cost: object = "calibrated"
    n_slots: int | None = None
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 512
    speed: object = None        # a fitted.SpeedProfile (SimExecutor); None: the cost as it is
    prefix_caching: bool = False     # paged / chunked curves: a cached prefix is not prefilled again
    schedule_policy: str = "fcfs"    # or "lpm" with prefix_caching (engine/policies.py)

    def __post_init__(self):
        self.cfg = model_config(self.model)
        EngineConfig(block_size=self.block_size, max_num_batched_tokens=self.max_num_batched_tokens,
                     prefix_caching=self.prefix_caching, schedule_policy=self.schedule_policy)
        if self.cost is None or isinstance(self.cost, str):
            eff = self.eff or efficiency(self.cost or "calibrated")
            self.cost = AnalyticalCost(self.cfg, self.device, self.tensor_parallel, self.pipeline_parallel, eff)
        if self.n_slots is None:
            self.n_slots = self.cost.n_slots()
        check_range("n_slots", self.n_slots, 1, 1 << 40)

    @property
    def name(self) -> str:
        return self.cfg.name

    def new_engine(self, curve: Curve, eos_after=None) -> Engine:
        n_slots = self.n_slots - (self.n_slots % self.block_size if curve.system in PAGED else 0)
        kv = new_kv(curve.system, n_slots, self.block_size, prefix_caching=self.prefix_caching)   # accounting only
        executor = SimExecutor(self.cost, eos_after, self.speed)
        config = {"model": self.cfg.name, "system": curve.system, "max_bs": curve.max_bs, "mbs": curve.mbs,
                  "n_slots": n_slots, "n_workers": executor.n_workers, "simulated": True,
                  "block_size": self.block_size, "max_num_batched_tokens": self.max_num_batched_tokens,
                  "prefix_caching": self.prefix_caching, "schedule_policy": self.schedule_policy}
        scheduler = new_scheduler(curve.system, kv, curve.max_bs, self.cfg.max_seq_len, curve.mbs,
                                  self.max_num_batched_tokens, self.schedule_policy)
        return Engine(scheduler, executor, self.cfg.vocab_size, self.cfg.max_seq_len, config)

    def serve(self, curve: Curve, trace, **kw):
        return self.new_engine(curve, **kw).run(trace)


class RealBackend:
    """The real engine (``orca_lab.llm``) with ``preset``'s GPT, seeded random weights, on ``device``
    over ``tensor_parallel x pipeline_parallel`` GPUs (worker processes when above 1).

    Every shape is warmed up before it is timed: the first time a curve meets a trace of new lengths,
    a short untimed copy of it runs first (its first ``max_bs`` requests, two tokens each: one prefill
    and one decode iteration), so Triton's JIT and the first-call costs of the libraries stay out of
    the timed run; the device is synchronized before the run's clock starts."""

    def __init__(self, preset: str = "tiny", seed: int = 0, n_slots: int = 16384, device: str = "cpu",
                 dtype: str = "float32", tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 block_size: int = 16, max_num_batched_tokens: int = 512):
        self._engine = EngineConfig(n_slots=n_slots, device=device, dtype=dtype, tensor_parallel=tensor_parallel,
                                    pipeline_parallel=pipeline_parallel, block_size=block_size,
                                    max_num_batched_tokens=max_num_batched_tokens)
        self.llm = LLM(preset, seed=seed, engine=self._engine)
        self.cfg, self.n_slots = self.llm.cfg, n_slots
        self._warm: set = set()

    @property
    def name(self) -> str:
        return self.cfg.name

    def describe(self) -> dict:
        """What was measured, for a result's metadata."""
        ec = self._engine
        return {"preset": self.cfg.name, "device": ec.device, "dtype": ec.dtype, "n_slots": ec.n_slots,
                "tensor_parallel": ec.tensor_parallel, "pipeline_parallel": ec.pipeline_parallel}

    def serve(self, curve: Curve, trace):
        llm = LLM(gpt=self.llm.model, engine=self._engine.replace(max_bs=curve.max_bs))
        self.warm_up(llm, curve, trace)
        _synchronize(self._engine.device)
        return llm.serve(trace, system=curve.system, mbs=curve.mbs)

    def warm_up(self, llm, curve: Curve, trace):
        """Run the first ``max_bs`` requests of ``trace`` for two tokens, once per curve and lengths."""
        trace = list(trace)
        key = (curve, tuple(len(t.prompt) for t in trace[:curve.max_bs]))
        if key in self._warm or not trace:
            return
        self._warm.add(key)
        short = [TraceItem(0.0, t.prompt, min(t.max_gen_tokens, 2)) for t in trace[:curve.max_bs]]
        llm.serve(short, system=curve.system, mbs=curve.mbs)


def _synchronize(device: str):
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize(device)


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
    the fast curves' traces ending seconds after they saturate."""
    backends: list
    curves: list[Curve]
    spec: TraceSpec
    rates: list[float] | None = None
    loads: list[float] = field(default_factory=lambda: list(DEFAULT_LOADS))
    capacity_requests: int | None = None
    n_procs: int = 1
    progress: bool = True
    span_s: float | None = None

    def run(self) -> pd.DataFrame:
        n_cap = min(self.capacity_requests or self.spec.n_requests, self.spec.n_requests)
        cap_spec = dataclasses.replace(self.spec, n_requests=n_cap)
        pairs = [(b, c) for b in self.backends for c in self.curves]
        with _pool(self.n_procs) as pool:
            caps = {}
            if self.rates is None:
                jobs = [(b, c, cap_spec, None) for b, c in pairs]
                caps = {(b.name, c): row["throughput_rps"]
                        for (b, c, *_), row in zip(jobs, _map(pool, jobs, "capacity", self.progress))}
            jobs = [(b, c, self.spec_at(r), r) for b, c in pairs for r in self._rates(caps.get((b.name, c)))]
            rows = _map(pool, jobs, "sweep", self.progress)
        df = pd.DataFrame(rows)
        df["capacity_rps"] = [caps.get((m, _curve(s, bs, mbs)), math.nan)
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


def _curve(system, max_bs, mbs):
    return Curve(system, int(max_bs), None if mbs is None or pd.isna(mbs) else int(mbs))


def _point(job):
    return measure_point(*job)


def _map(pool, jobs, what: str, progress: bool) -> list[dict]:
    """Run ``jobs`` (in ``pool`` if any) with a progress bar; rows come back in job order."""
    from tqdm.auto import tqdm
    bar = tqdm(total=len(jobs), desc=what, unit="run", disable=not progress)
    rows = [None] * len(jobs)
    if pool is None:
        for i, job in enumerate(jobs):
            rows[i] = _point(job)
            bar.update()
    else:
        futures = {pool.submit(_point, job): i for i, job in enumerate(jobs)}
        for f in as_completed(futures):
            rows[futures[f]] = f.result()
            bar.update()
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
            ctx.set_forkserver_preload(["orca_lab.sim.run"])
            self.pool = ProcessPoolExecutor(self.n_procs, mp_context=ctx)
        return self.pool

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


# -- the paper's headline -------------------------------------------------------------------------
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
                best = (_curve(system, bs, mbs).label, thr, reached)
        out.update({f"{system}_curve": best[0], f"{system}_rps": best[1], f"{system}_reached": best[2]})
    out["ratio"] = out["orca_rps"] / out["ft_rps"] if out["ft_rps"] else math.nan
    return out


# -- Figure 9: engine time per batch --------------------------------------------------------------
def batch_time(backend, system: str, batch_size: int, input_len: int, gen_len: int = 32) -> dict:
    """Time to run one batch of equal requests from start to end (the paper's Figure 9), or an
    out-of-memory mark when the batch's K/V reservation does not fit ``backend.n_slots``."""
    curve = Curve(system, batch_size, batch_size if system == "ft" else None)
    per_request_slots = backend.cfg.max_seq_len if system == "ft" else input_len + gen_len
    row = {"model": backend.name, "system": system, "batch_size": batch_size, "input_len": input_len,
           "gen_len": gen_len, "kv_slots_needed": batch_size * per_request_slots, "n_slots": backend.n_slots}
    row["oom"] = row["kv_slots_needed"] > backend.n_slots
    if row["oom"]:
        return {**row, "time_ms": math.nan}
    trace = homogeneous_trace(batch_size, input_len, gen_len, None, 0, backend.cfg.vocab_size)
    return {**row, "time_ms": backend.serve(curve, trace).duration * 1e3}

