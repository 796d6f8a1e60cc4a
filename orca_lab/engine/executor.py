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
from orca_lab.engine import logprobs
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


class StageClock:
    """Marks taken between a stage's launches, read as host times that mean what they say.

    On a GPU, ops return once queued: a host timestamp after one says when it was queued, not when it
    ran (a ``dist.recv`` in a worker, a layer here). So each mark is a CUDA event on the stream, and
    ``times()`` synchronizes on the last one and places every mark on the host clock by its elapsed
    time to that last one. On CPU, ops are synchronous and a mark is the host clock itself.
    """

    def __init__(self, device, now):
        self.cuda, self.now, self.marks = torch.device(device).type == "cuda", now, []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(self.now())

    def times(self) -> list[float]:
        if not self.cuda:
            return list(self.marks)
        last = self.marks[-1]
        last.synchronize()
        end = self.now()
        return [end - event.elapsed_time(last) / 1e3 for event in self.marks]


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
    without its concurrency (the worker processes give the concurrency). ``graphs`` (a
    ``DecodeGraphs``) runs decode-only iterations from padded CUDA graphs. It samples in the engine's
    process, on the engine's own ``Request`` objects: penalties and logprobs read and write them."""
    samples_here = True

    def __init__(self, model, kv, n_workers: int = 1, device="cpu", graphs=None):
        self.model, self.kv, self.device = model, kv, torch.device(device)
        self.n_workers = n_workers
        self.stages = split_layers(model.cfg.n_layers, n_workers)
        self.clock = RealClock()
        self.in_flight: deque[Batch] = deque()
        self.graphs = graphs if n_workers == 1 else None

    def submit(self, batch: Batch):
        self.in_flight.append(batch)

    @torch.inference_mode()
    def wait(self, timeout: float | None = None) -> Completion | None:
        batch = self.in_flight.popleft()
        clock = StageClock(self.device, self.clock.now)
        clock.mark()
        logits = self.graphs.run(batch) if self.graphs is not None and self.graphs.takes(batch) else None
        if logits is not None:
            tokens = sample(logits, batch)
            clock.mark()
        else:
            bt, x = batch.tensors(self.device), None
            for s, (lo, hi) in enumerate(self.stages):
                x = self.model.run_layers(self.model.embed(bt) if s == 0 else x, bt, self.kv, lo, hi)
                if s == len(self.stages) - 1:
                    tokens = sample(self.model.head(x, bt), batch)  # .tolist() syncs the device
                    if logprobs.wants_prompt(batch):
                        logprobs.record_prompt(self.model.head_at, x, batch)
                clock.mark()
        t = clock.times()
        return Completion(batch, tokens, [StageTime(s, a, b) for s, (a, b) in enumerate(zip(t, t[1:]))])

    def close(self):
        self.in_flight.clear()
