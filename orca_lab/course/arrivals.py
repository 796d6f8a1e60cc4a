"""The learner's loop (notebooks 03 and 08) driving an engine while requests keep arriving: a trace's
Poisson arrivals (the capstone's gap, measured on this machine) or a server's clients (``orca-lab
serve --plugins``).

Their loop runs ``while scheduler.has_work(): select, submit, wait, on_batch_return``: it knows only
the requests already in the scheduler. ``Arriving`` is the scheduler as that loop sees it: before
``has_work`` answers, what has arrived is admitted (``admit``), and when nothing can run it waits for
the next arrival rather than answering no while more will come (``more``); the tokens each batch
gives back, and those the scheduler hands over at a select, go to ``deliver`` (a server's streams).
The loop itself, the scheduler and the executor are the learner's and the engine's, unchanged.
"""
from __future__ import annotations

import pandas as pd

from orca_lab.course.ch03_iteration_level_scheduling import run_loop
from orca_lab.course.guards import watched
from orca_lab.course.plug import assemble
from orca_lab.metrics import summarize


class Arriving:
    """``engine``'s scheduler for a learner's loop while requests arrive. ``admit(wait)`` adds what
    has come (``wait``: nothing can run, so first wait for something to come); ``more()``: whether
    more may come; ``deliver(events)``: the ``(request, token)`` pairs that became ready."""

    def __init__(self, engine, admit, more, deliver=lambda events: None):
        self.engine, self.scheduler = engine, engine.scheduler
        self.admit, self.more, self.deliver = admit, more, deliver

    def __getattr__(self, name):
        return getattr(self.scheduler, name)

    def _busy(self) -> bool:
        return self.scheduler.has_work() or self.engine.n_scheduled > 0

    def has_work(self) -> bool:
        while True:
            self.admit(not self._busy())
            if self._busy():
                return True
            if not self.more():
                return False

    def select(self, now: float = 0.0):
        batch = self.scheduler.select(now)
        self._ready(self.scheduler.take_delivered())
        return batch

    def on_batch_return(self, batch, tokens, now: float):
        return self._ready(self.scheduler.on_batch_return(batch, tokens, now))

    def _ready(self, events):
        if events:
            self.deliver(self.engine.retire(events))
        return events


class TraceArrivals:
    """A trace's requests, each added to ``engine`` once its arrival time (from the loop's start) has come."""

    def __init__(self, engine, trace):
        self.engine, self.pending, self.start = engine, sorted(trace, key=lambda it: it.arrival), None

    def admit(self, wait: bool):
        clock = self.engine.clock
        self.start = clock.now() if self.start is None else self.start
        if wait and self.pending:
            clock.sleep_until(self.start + self.pending[0].arrival)
        while self.pending and self.start + self.pending[0].arrival <= clock.now():
            it = self.pending.pop(0)
            self.engine.add_request(list(it.prompt), it.sampling_params(), arrival=self.start + it.arrival)

    def more(self) -> bool:
        return bool(self.pending)


def run_arriving(engine, loop, trace):
    """Serve ``trace`` at its arrival times with the learner's ``loop`` driving ``engine``: its ``RunResult``."""
    arrivals = TraceArrivals(engine, trace)
    scheduler = Arriving(engine, arrivals.admit, arrivals.more)
    result = run_loop(engine, loop, [], scheduler)
    if arrivals.more():
        raise AssertionError(f"your loop returned with {len(arrivals.pending)} requests of the trace still to "
                             "arrive: loop while scheduler.has_work() (it waits for them)")
    return result


def gap(llm, pieces: dict, trace, systems=("orca", "ft")) -> pd.DataFrame:
    """``trace`` (Poisson arrivals) served on this machine by each system twice: the package's engine,
    and the learner's (every piece of ``pieces`` plugged, their ``loop`` driving it). Throughput and
    median normalised latency (``orca-lab compare``'s columns), one row per (engine, system). Both run
    in a thread of their own, as the learner's must (``guards.watched``): like for like."""
    rows = []
    for system in systems:
        rows.append({"engine": "package", **summarize(watched(llm.serve, trace, system=system))})
        engine = llm.new_engine(system)
        try:
            assemble(engine, pieces)
            rows.append({"engine": "yours", **summarize(run_arriving(engine, pieces["loop"], trace))})
        finally:
            engine.close()
    table = pd.DataFrame(rows).set_index(["engine", "system"])
    return table[["n_requests", "throughput_rps", "throughput_tok_s", "norm_latency_median_ms", "n_iterations"]]
