"""A measured Figure 10 sized to a time budget (``reproduce/fig_e2e.ipynb``'s ``budget_s``).

The real engine serves in real time, so a measured sweep costs what its traces take to arrive and be
served: gpt2 at 60 requests, 3 curves x 4 loads, did not end in 290 s of an H200. ``BudgetedSweep``
predicts every run of the sweep (each curve's offline capacity run, then each point) by simulating it
on a model of the device it runs on, and shrinks the sweep until the prediction fits the budget:
first the requests per trace (down to ``MIN_REQUESTS``), then the loads, the costliest first (the
lightest: its trace takes longest to arrive), then the requests again (down to ``MIN_N``). Every
curve keeps every load that is kept. The capacity runs then time the real engine on the trace
itself: the points are predicted again at the speed those runs showed (measured engine time over
simulated), and sized to the budget left, up to what was asked for.

The device models: on a GPU, the simulator's analytical model of it (``cost.DEVICES``, picked by the
device's name) with this engine's host time per iteration (``HOST_EAGER_S_PER_LAYER``,
``HOST_GRAPH_S``); on the CPU, the model fitted to this engine's iterations on the project's 2-core
machine (``CPU_FITS``). Times the simulation does not see (a run's set-up, the first calls of a
curve, the cells after the sweep) are the constants below, and a plan fills at most ``MARGIN`` of
the budget.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import pandas as pd

from orca_lab.config import check_range, model_config
from orca_lab.metrics import summarize
from orca_lab.sim.backends import SimBackend
from orca_lab.sim.calibration import efficiency
from orca_lab.sim.cost import AnalyticalCost, model_of_gpu
from orca_lab.sim.executor import IterationCost
from orca_lab.sim.fitted import FittedCost
from orca_lab.sim.sweep import Sweep, TraceSpec

MIN_REQUESTS = 16     # requests per trace shrunk to before any load is dropped (two ft(8,8) batches)
MIN_N = 4             # ... and the fewest, with MIN_LOADS loads, before the budget is refused
MIN_LOADS = 2         # loads kept at the least: one below saturation and one past it
MARGIN = 0.85         # share of the budget the prediction may fill
RUN_S = {"cpu": 0.05, "cuda": 0.3}    # per run: an engine built, the device synchronized, the row made
WARM_S = {"cpu": 0.5, "cuda": 4.0}    # per curve: its warm-up (graph captures, a K/V pool, LLM.warm_up)
# ... and once, on a GPU: Triton's JIT and launch tuning. On the H200 (docs/results/gpu_h200_2026-11-27_3f7e19b)
# they fell inside the first curve's capacity run: 27.2 s against the model's 2.7 s; with LLM.warm_up
# meeting every shape first (gpu_h200), that run still took 27 s.
FIRST_WARM_S = {"cpu": 0.0, "cuda": 25.0}
AFTER_S = 10.0        # the cells after the sweep: tables, the headline, the HTML figure (plotly
                      # imported and drawn: 8 s on the loaded 2-core CPU)
EXPORT_S = 5.0        # ... and each of PNG, SVG, PDF (a Chromium draws them)

# This engine's host time per iteration on a GPU's host, from the H200 run (docs/results/
# gpu_h200_2026-11-26): an iteration run eagerly costs about 1 ms per layer (the baseline's padded steps: 42 ms
# on gpt3-13b's 40 layers, 13.6 ms on gpt2's 12: 55 s for 4,047 steps); a decode iteration replayed
# from a CUDA graph about 2 ms (ORCA on 13B: 8.2 ms a token, 6.2 of it the HBM floor). Launches are
# asynchronous, so an iteration takes the longer of its host and device times.
HOST_EAGER_S_PER_LAYER = 1.0e-3
HOST_GRAPH_S = 2.0e-3

# Fits of this engine's iteration periods on the project's 2-core CPU, one torch thread
# (``FittedCost`` over ``fitted.FEATURES``; docs/results/sim_fidelity_cpu.json, 2026-11-22).
CPU_FITS = {
    "tiny": {"selective": [4.574e-3, 1.381e-4, 0.0, 6.049e-6, 0.0],
             "padded": [3.555e-3, 1.147e-4, 5.761e-7, 1.304e-6, 6.676e-5]},
    "gpt2": {"selective": [6.902e-2, 1.716e-3, 4.684e-5, 0.0, 8.677e-3],
             "padded": [5.902e-2, 1.803e-3, 3.980e-5, 6.198e-5, 1.115e-2]},
}


@dataclass
class HostAndDevice:
    """A GPU's analytical cost model plus this engine's host time: an iteration takes the longer of
    the two. One-token steps replay CUDA graphs (``model/cuda_graphs.py``): ORCA's decodes and the
    baseline's padded steps alike; prefills and chunks run eagerly."""
    device: AnalyticalCost
    n_layers: int

    @property
    def n_stages(self) -> int:
        return self.device.n_stages

    def iteration(self, batch) -> IterationCost:
        dev = self.device.iteration(batch)
        graphed = all(q == 1 for q in batch.q_lens) and self.n_stages == 1     # ``DecodeGraphs.takes``
        host = HOST_GRAPH_S if graphed else HOST_EAGER_S_PER_LAYER * self.n_layers
        share = host / len(dev.stages)
        return dev._replace(stages=tuple(max(t, share) for t in dev.stages))


def device_model(preset: str, device: str, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 gpu_name: str | None = None):
    """(the cost model of ``preset`` served by this engine on ``device``, what it is in words)."""
    cfg = model_config(preset)
    if device == "cpu":
        fit = CPU_FITS.get(cfg.name)
        said = f"the fit of this engine on a 2-core CPU ({cfg.name})"
        if fit is None:   # another preset: gpt2's fit, each term scaled by the parameters
            k = cfg.n_params / model_config("gpt2").n_params
            fit = {kind: [k * c for c in coef] for kind, coef in CPU_FITS["gpt2"].items()}
            said = f"the fit of this engine on a 2-core CPU (gpt2's, x{k:.3g} for {cfg.name}'s parameters)"
        return FittedCost(fit, cfg.n_layers, pipeline_parallel), said
    if gpu_name is None:
        import torch
        gpu_name = torch.cuda.get_device_name(device)
    key = model_of_gpu(gpu_name)
    said = f"the simulator's {key} model with this engine's host time"
    if key is None:
        key, said = "a100-40gb", f"no model of {gpu_name!r}: the a100-40gb model with this engine's host time"
    cost = AnalyticalCost(cfg, key, tensor_parallel, pipeline_parallel, efficiency("calibrated"))
    return HostAndDevice(cost, cfg.n_layers), said


def after_sweep_s(formats) -> float:
    """The cells after the sweep: the tables and the HTML, and each figure a Chromium draws."""
    return AFTER_S + EXPORT_S * sum(f != "html" for f in formats)


@dataclass
class Plan:
    """A sweep's size and every run's predicted seconds: ``runs[(curve label, load or rate)]``, the
    capacity runs under ``None``; ``fixed_s`` what the model adds (the warm-ups still to come, the cells
    after the sweep), ``spent_s`` the notebook's time already spent when the plan was made. The plan
    fits if ``predicted_s``, all three, is at most ``MARGIN`` of ``budget_s``."""
    n_requests: int
    xs: list[float]               # the loads (or rates) every curve is measured at
    runs: dict
    fixed_s: float
    spent_s: float
    budget_s: float
    asked: tuple                  # (n_requests, xs) asked for
    by: str = "loads"
    stage: str = "planned"        # "planned" on the model; "corrected" at the capacity runs' speed
    speeds: dict = field(default_factory=dict)   # curve label -> measured / simulated engine time

    @property
    def modelled_s(self) -> float:
        """The runs and what the model adds: the budget's share the plan was sized into, less the spent."""
        return self.fixed_s + sum(self.runs.values())

    @property
    def predicted_s(self) -> float:
        return self.spent_s + self.modelled_s

    def shrunk(self) -> list[str]:
        n, xs = self.asked
        out = [f"n_requests {n} -> {self.n_requests}"] if self.n_requests != n else []
        dropped = [x for x in xs if x not in self.xs]
        return out + ([f"{self.by} {_fmt(xs)} -> {_fmt(self.xs)} (dropped {_fmt(dropped)})"] if dropped else [])

    def describe(self) -> str:
        shrunk = "; ".join(self.shrunk()) or "nothing shrunk"
        speeds = "".join(f"; {c} ran x{s:.2f} the model's time" for c, s in self.speeds.items())
        over = "" if self.fits else f", OVER the {MARGIN:.0%} planned: the least sweep"
        return (f"{self.stage}: {self.n_requests} requests at {self.by} {_fmt(self.xs)}, predicted "
                f"{self.predicted_s:.1f} s of budget_s={self.budget_s:g}{over} ({shrunk}{speeds})")

    @property
    def fits(self) -> bool:
        return self.predicted_s <= MARGIN * self.budget_s

    def to_json(self) -> dict:
        return {"stage": self.stage, "n_requests": self.n_requests, self.by: self.xs, "budget_s": self.budget_s,
                "predicted_s": self.predicted_s, "fits": self.fits, "fixed_s": self.fixed_s, "spent_s": self.spent_s,
                "modelled_s": self.modelled_s, "shrunk": self.shrunk(),
                "asked": {"n_requests": self.asked[0], self.by: self.asked[1]}, "speeds": self.speeds,
                "runs": [{"curve": c, self.by[:-1]: x, "predicted_s": s} for (c, x), s in self.runs.items()]}


def _fmt(xs) -> str:
    return "[" + ", ".join(f"{x:g}" for x in xs) + "]"


def fit_to(n_max: int, xs: list, predict, room: float, floor: int, pivot: float | None = 1.0):
    """The largest sweep of at most ``n_max`` requests and ``xs`` whose ``predict(n)`` (seconds per
    run, a dict keyed (curve, x), x None for runs every point needs) fits ``room``: (n, xs, runs).
    The requests shrink to ``floor`` first, then ``xs`` are dropped, the costliest first, keeping one
    below ``pivot`` and one at or past it (a load below and one past saturation), then the requests
    shrink to ``MIN_N``; where loads were dropped, the requests grow back into the time they freed."""
    total = lambda runs: sum(s for (_, x), s in runs.items() if x is None or x in xs)

    def shrink(n, runs, least):
        while total(runs) > room and n > least:
            n = max(least, min(n - 1, int(n * room / total(runs))))
            runs = predict(n)
        return n, runs

    xs = list(xs)
    n, runs = shrink(n_max, predict(n_max), min(n_max, floor))
    cost = lambda x: sum(s for (_, y), s in runs.items() if y == x)
    while total(runs) > room and len(xs) > MIN_LOADS and _droppable(xs, pivot):
        xs.remove(max(_droppable(xs, pivot), key=cost))
        if total(runs) <= room and n < n_max:          # grow back, if the estimate fits
            grown = min(n_max, int(n * room / total(runs)))
            if grown > n and total(bigger := predict(grown)) <= room:
                n, runs = grown, bigger
    n, runs = shrink(n, runs, min(n_max, MIN_N))
    return n, xs, {k: s for k, s in runs.items() if k[1] is None or k[1] in xs}


def _droppable(xs, pivot):
    """``xs`` but the last one below ``pivot`` and the last one at or past it."""
    if pivot is None:
        return list(xs)
    below, past = [x for x in xs if x < pivot], [x for x in xs if x >= pivot]
    return [x for x in xs if not ((x < pivot and len(below) == 1) or (x >= pivot and len(past) == 1))]


class BudgetedSweep:
    """A measured sweep of ``real`` (a ``RealBackend``) sized to end within ``budget_s`` seconds of
    ``started`` (``time.perf_counter()`` when the notebook began), ``formats`` exported after it;
    ``keep``: as ``Sweep``'s, for its points."""

    def __init__(self, real, curves, spec: TraceSpec, rates, loads, budget_s: float, formats=("html",),
                 started: float | None = None, model=None, progress: bool = True, keep=None):
        self.budget_s = check_range("budget_s", budget_s, 1.0, 1e6, kind=float)
        self.real, self.curves, self.spec, self.progress, self.keep = real, list(curves), spec, progress, keep
        self.started = time.perf_counter() if started is None else started
        self.by, xs = ("rates", list(rates)) if rates is not None else ("loads", list(loads))
        self.asked = (spec.n_requests, xs)
        self.after_s = after_sweep_s(formats)
        ec = real.describe()
        kind = "cpu" if ec["device"] == "cpu" else "cuda"
        self.run_s, self.warm_s = RUN_S[kind], FIRST_WARM_S[kind] / max(1, len(self.curves)) + WARM_S[kind]
        cost, self.model_said = model or device_model(ec["preset"], ec["device"], ec["tensor_parallel"],
                                                      ec["pipeline_parallel"])
        self.sim = SimBackend(real.cfg, cost=cost, n_slots=real.n_slots)
        self._sims: dict = {}
        self.plan = self._plan()
        self.first_plan = self.plan

    # -- the simulator's runs, each once ----------------------------------------------------------
    def simulate(self, curve, n: int, rate: float | None):
        """The simulator's run of ``curve`` on ``n`` requests at ``rate`` (None: offline)."""
        key = (curve, n, rate)
        if key not in self._sims:
            spec = dataclasses.replace(self.spec, n_requests=n)
            self._sims[key] = self.sim.serve(curve, spec.make(rate, self.sim.cfg.vocab_size, self.sim.cfg.max_seq_len))
        return self._sims[key]

    def _capacity(self, curve, n: int) -> float:
        return n / max(self.simulate(curve, n, None).duration, 1e-12)

    def _rate(self, curve, x: float, n_cap: int) -> float:
        return x if self.by == "rates" else x * self._capacity(curve, n_cap)

    def _predict(self, n: int, n_cap: int | None, speeds: dict) -> dict:
        """Seconds of each run at ``n`` requests: the capacity runs at ``n`` too when ``n_cap`` is
        None, else only the points, at rates from the capacity of ``n_cap`` requests."""
        runs = {}
        for c in self.curves:
            k = speeds.get(c.label, 1.0)
            if n_cap is None and self.by == "loads":
                runs[(c.label, None)] = k * self.simulate(c, n, None).duration + self.run_s
            for x in self.asked[1]:
                rate = self._rate(c, x, n if n_cap is None else n_cap)
                runs[(c.label, x)] = k * self.simulate(c, n, rate).duration + self.run_s
        return runs

    def _plan(self) -> Plan:
        """Sized on the model alone: warm-ups, capacity runs and points; refused if even the least
        sweep does not fit the budget (the time already spent aside: a slow start runs the least)."""
        fixed, spent = self.after_s + self.warm_s * len(self.curves), self._spent()
        n, xs, runs = fit_to(self.asked[0], self.asked[1], lambda n: self._predict(n, None, {}),
                             MARGIN * self.budget_s - fixed - spent, self._floor(), self._pivot())
        plan = Plan(n, xs, runs, fixed, spent, self.budget_s, self.asked, self.by)
        if plan.modelled_s > MARGIN * self.budget_s:
            least = plan.modelled_s / MARGIN
            raise ValueError(f"budget_s={self.budget_s:g} is too small for this sweep on {self.model_said}: "
                             f"the least one ({n} requests, {self.by} {_fmt(xs)}) is predicted to take "
                             f"{plan.modelled_s:.0f} s, {MARGIN:.0%} of {least:.0f}; allowed budget_s >= "
                             f"{least:.0f}, or fewer curves, a smaller scale or preset")
        return plan

    def _corrected(self, cap_rows: dict) -> Plan:
        """The points sized again, to the budget left, at the speed the capacity runs showed."""
        n_cap = self.plan.n_requests
        speeds = {c.label: cap_rows[(self.real.name, c)]["duration_s"] / self.simulate(c, n_cap, None).duration
                  for c in self.curves}
        spent = self._spent()
        n, xs, runs = fit_to(self.asked[0], self.asked[1], lambda n: self._predict(n, n_cap, speeds),
                             MARGIN * self.budget_s - self.after_s - spent, self._floor(), self._pivot())
        return Plan(n, xs, runs, self.after_s, spent, self.budget_s, self.asked, self.by, "corrected",
                    {k: round(v, 3) for k, v in speeds.items()})

    def _spent(self) -> float:
        return time.perf_counter() - self.started

    def _pivot(self) -> float | None:
        return 1.0 if self.by == "loads" else None

    def _floor(self) -> int:
        return max(MIN_REQUESTS, *(c.max_bs for c in self.curves))

    # -- the sweep ----------------------------------------------------------------------------------
    def run(self) -> pd.DataFrame:
        """Capacity runs at the plan's size, then the points at the corrected plan's."""
        p = self.plan
        sweep = Sweep([self.real], self.curves, dataclasses.replace(self.spec, n_requests=p.n_requests),
                      None if self.by == "loads" else p.xs, p.xs if self.by == "loads" else [], progress=self.progress,
                      keep=self.keep)
        caps = sweep.capacities()
        if caps:
            self.plan = self._corrected(caps)
            sweep.spec = dataclasses.replace(self.spec, n_requests=self.plan.n_requests)
            sweep.loads = self.plan.xs
        return sweep.frame(sweep.points(caps), caps)

    def predicted(self) -> pd.DataFrame:
        """The simulator's rows for the plan's points on the model of this device (its own capacity)."""
        n_cap, n = self.first_plan.n_requests, self.plan.n_requests
        rows = [{"model": self.sim.name, **summarize(self.simulate(c, n, r)), "system": c.system, "max_bs": c.max_bs,
                 "mbs": c.mbs, "rate": r} for c in self.curves for r in [self._rate(c, x, n_cap) for x in self.plan.xs]]
        return pd.DataFrame(rows).assign(mbs=lambda d: d["mbs"].astype("Int64"))
