"""The main job behind ``orca-lab compare``: ORCA and the request-level baseline serve one paper-shaped
trace on the same model, at loads from light to past the baseline's capacity (a measured mini
Figure 10). The loads come from a short capacity probe of each system on this machine, so a slower
or faster machine moves the rates, not the picture.

The probe measures *offline* capacity: its requests are all there at t=0, so each system forms the
largest batches it can. Under Poisson arrivals the request-level baseline forms its batches from
whatever has arrived and holds them until their longest request ends, so it saturates below its
offline capacity: a load of 0.4 (of that capacity) need not be light load for it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import pandas as pd

from orca_lab.metrics import summarize
from orca_lab.workload import paper_trace

SYSTEMS = ("orca", "ft")
BASELINE_LOADS = (0.4, 1.0, 2.5)   # fractions of the baseline's capacity: light, at it, well past it
ORCA_LOAD = 0.8                    # one more point at this fraction of ORCA's capacity, when beyond them
KEPT_UP = 0.9                      # a Poisson run kept up when it served at least this share of the offered rate
COLUMNS = ["load", "throughput_rps", "throughput_tok_s", "norm_latency_median_ms", "norm_latency_p90_ms",
           "ttft_median_ms", "tokens_per_iteration", "wasted_rows_per_iteration"]


@dataclasses.dataclass
class Comparison:
    """Every timed run (``runs[(system, rate)]``), the probe's capacities and the summary table."""
    capacity_rps: dict
    runs: dict
    table: pd.DataFrame

    def past_capacity_rate(self) -> float:
        """The first rate past the baseline's capacity (the highest rate when none is)."""
        rates = sorted({rate for _, rate in self.runs})
        cap = self.capacity_rps.get("ft", math.inf)
        return next((r for r in rates if r > 1.2 * cap), rates[-1])

    def kept_up_rps(self) -> dict:
        """Per system, the highest offered rate whose Poisson run it kept up with (``KEPT_UP``), or None:
        its capacity under Poisson arrivals as far as the rates tried tell, read from the runs themselves."""
        out = {}
        for system, rows in self.table.groupby("system", observed=True):
            ok = rows[rows["throughput_rps"] >= KEPT_UP * rows["rate"]]
            out[str(system)] = float(ok["rate"].max()) if len(ok) else None
        return out

    def verdict(self) -> str:
        """The comparison in two sentences: at the lightest load, and past the baseline's capacity; or
        in one, at the one rate given (no capacity was measured to say where it lies)."""
        t = self.table
        lines = []
        points = (("lightest load", t["rate"].min()), ("past the baseline's capacity", self.past_capacity_rate())) \
            if self.capacity_rps else (("at the rate given", t["rate"].min()),)
        for label, rate in points:
            o, f = (t[(t["system"] == s) & (t["rate"] == rate)].iloc[0] for s in ("orca", "ft"))
            lines.append(f"{label} ({rate:.2f} req/s offered): ORCA {o.throughput_rps:.2f} vs baseline "
                         f"{f.throughput_rps:.2f} req/s ({o.throughput_rps / f.throughput_rps:.2f}x); "
                         f"median normalized latency {o.norm_latency_median_ms:.1f} vs "
                         f"{f.norm_latency_median_ms:.1f} ms/token")
        return "\n".join(lines)

    def figure(self):
        """``results/compare.html``'s figure: the measured curve, then the runs past the baseline's capacity."""
        from orca_lab.viz import compare_figure
        at = self.past_capacity_rate()
        return compare_figure([self.runs[(s, at)] for s in SYSTEMS], curve=self.table,
                              title=f"ORCA vs request-level batching (three right panels: {at:.2f} req/s offered)")


def trace_at(rate, n: int, seed: int, scale: float, vocab_size: int):
    """The same requests at every rate (the same lengths offline): only the arrival times scale with it."""
    return paper_trace(n, rate, seed, scale=scale, vocab_size=vocab_size)


def warm_up(llm, trace, systems=SYSTEMS):
    """Run each system once on the trace's first batch, two tokens each, before anything is timed: the
    first call of each shape pays for allocations and, on a GPU, for Triton's compilation
    (``sim.backends.warm_up_batch``: the baseline's prompts cut to its first iteration's)."""
    from orca_lab.sim.backends import warm_up_batch
    first = list(trace[:llm.engine_config.max_bs])
    longest = max(trace, key=lambda it: len(it.prompt))
    if longest not in first:           # the longest prompt too: the largest prefill shape
        first[-1] = longest
    for system in systems:
        llm.serve(warm_up_batch(first, system), system=system)


def probe_capacity(llm, trace, system: str, n: int) -> float:
    """Requests/s when the trace's first ``n`` requests are all there at once: the system's offline
    capacity (an upper bound on what it sustains under Poisson arrivals)."""
    offline = [dataclasses.replace(it, arrival=0.0) for it in trace[:n]]
    return summarize(llm.serve(offline, system=system))["throughput_rps"]


def rates_from(capacity: dict) -> list[float]:
    """Light load to past the baseline's capacity, and ORCA's knee when it lies further out."""
    rates = [capacity["ft"] * f for f in BASELINE_LOADS]
    if capacity["orca"] * ORCA_LOAD > rates[-1] * 1.2:
        rates.append(capacity["orca"] * ORCA_LOAD)
    return rates


def compare(llm, n_requests: int = 32, seed: int = 0, scale: float = 0.25, rates=None,
            probe_requests: int = 16, progress: bool = True) -> Comparison:
    """Warm up, probe each system's capacity (unless ``rates`` are given), then serve the trace at each
    rate with each system. ``load`` in the table is the rate over the baseline's offline capacity."""
    from orca_lab.config import uses_workers
    from orca_lab.distributed.pool import WorkerPool
    with WorkerPool(llm) if uses_workers(llm.engine_config) else contextlib.nullcontext():
        return _compare(llm, n_requests, seed, scale, rates, probe_requests, progress)


def _compare(llm, n_requests, seed, scale, rates, probe_requests, progress) -> Comparison:
    """``compare`` once the worker processes, if any, are up: every run shares them."""
    from tqdm.auto import tqdm
    vocab = llm.cfg.vocab_size
    offline = trace_at(None, n_requests, seed, scale, vocab)
    warm_up(llm, offline)
    bar = tqdm(total=(0 if rates else len(SYSTEMS)) + len(SYSTEMS) * (len(rates) if rates else 4),
               unit="run", disable=not progress, desc="warmed up" if rates else "capacity probe")
    capacity = {}
    if not rates:
        for system in SYSTEMS:
            capacity[system] = probe_capacity(llm, offline, system, min(probe_requests, n_requests))
            bar.update()
        rates = rates_from(capacity)
        bar.total = len(SYSTEMS) * (1 + len(rates))
    runs, rows = {}, []
    for rate in rates:
        trace = trace_at(rate, n_requests, seed, scale, vocab)
        for system in SYSTEMS:
            bar.set_description(f"{system} at {rate:.2f} req/s")
            runs[(system, rate)] = result = llm.serve(trace, system=system)
            rows.append({"rate": rate, "load": rate / capacity["ft"] if "ft" in capacity else math.nan,
                         **summarize(result)})
            bar.update()
    bar.close()
    table = pd.DataFrame(rows)
    table["system"] = pd.Categorical(table["system"], SYSTEMS)
    return Comparison(capacity, runs, table.sort_values(["system", "rate"]).reset_index(drop=True))
