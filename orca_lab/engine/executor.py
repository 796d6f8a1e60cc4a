"""Executors run a Batch and hand back one token per request; the scheduler cannot tell them apart.

Interface: ``submit(batch)`` never waits; ``wait(timeout)`` returns the oldest batch in flight once it
is done (or None at the timeout); ``clock`` is the time the engine lives in; ``close()`` frees all.
Here: the model in this process. Worker processes and the simulator's cost model live elsewhere.

Threads: orca_lab never calls ``torch.set_num_threads`` (importing or running a library should not
change its process); the caller picks. On a small CPU shared with other processes, one intra-op
thread is the safe choice for this engine: its ops are small, and with two OpenMP threads each op
waits at a barrier for a thread a neighbour may be holding (small ops measured 20-100x slower on a
busy 2-core machine). The benchmarks take ``--threads`` (default 1) and record it with the results.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from orca_lab.config import check_range
from orca_lab.engine.batch import Batch
from orca_lab.engine.sampler import sample


class RealClock:
    """Wall time. Idle, the engine sleeps until ``POLL`` seconds before the next arrival and polls
    from there, as a serving loop polling its queue would: the host clocks a sleeping core down, and
    on the 2-core CI machine the first ~30 ms of work after each sleep ran 25-40% slower."""
    POLL = 0.05

    def __init__(self):
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def sleep_until(self, t: float):
        if t - self.now() > self.POLL:
            time.sleep(t - self.now() - self.POLL)
        while self.now() < t:
            pass


class VirtualClock:
    """Simulated time: it moves only when told to."""
    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep_until(self, t: float):
        self.t = max(self.t, t)


@dataclass(frozen=True)
class StageTime:
    stage: int
    start: float
    end: float


@dataclass
class Completion:
    batch: Batch
    tokens: list[int]
    stages: list[StageTime]


def split_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Equal contiguous partitions of the layers, one per pipeline stage (ORCA §4.3)."""
    check_range("pipeline_parallel", n_stages, 1, n_layers)
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class LocalExecutor:
    """The model in this process. With ``n_workers > 1`` it keeps that many batches in flight and
    runs the layers of each as ``n_workers`` stages, one after another: the schedule of a pipeline
    without its concurrency (the worker processes give the concurrency)."""

    def __init__(self, model, kv, n_workers: int = 1, device="cpu"):
        self.model, self.kv, self.device = model, kv, torch.device(device)
        self.n_workers = n_workers
        self.stages = split_layers(model.cfg.n_layers, n_workers)
        self.clock = RealClock()
        self.in_flight: deque[Batch] = deque()

    def submit(self, batch: Batch):
        self.in_flight.append(batch)

    @torch.inference_mode()
    def wait(self, timeout: float | None = None) -> Completion | None:
        batch = self.in_flight.popleft()
        bt = batch.tensors(self.device)
        times, x = [], None
        for s, (lo, hi) in enumerate(self.stages):
            start = self.clock.now()
            x = self.model.run_layers(self.model.embed(bt) if s == 0 else x, bt, self.kv, lo, hi)
            if s == len(self.stages) - 1:
                tokens = sample(self.model.head(x, bt), batch.requests)   # .tolist() syncs the device
            times.append(StageTime(s, start, self.clock.now()))
        return Completion(batch, tokens, times)

    def close(self):
        self.in_flight.clear()
