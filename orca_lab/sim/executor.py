"""The simulator's executor: a cost model instead of a GPT, a virtual clock instead of the wall.

It keeps the executor interface (``submit``, ``wait(timeout)``, ``clock``, ``n_workers``, ``close``),
so the engine loop, both schedulers and the K/V slot manager run unchanged on top of it. Each
pipeline stage is a resource that runs one batch at a time: stage ``s`` of a batch starts when stage
``s`` is free and stage ``s - 1`` of the same batch is done (ORCA §4.2). In-flight batches, the
baseline's micro-batches and the bubbles of a pipeline therefore come out of the simulation.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

from orca_lab.engine.executor import Completion, StageTime
from orca_lab.engine.clock import VirtualClock

IDLE_GAP = 1e-3     # seconds between two iterations that count as the engine having idled


class IterationCost(NamedTuple):
    """What a cost model says about one iteration of one batch, in seconds."""
    stages: tuple[float, ...]   # busy time of each pipeline stage (GPU work it cannot overlap)
    dispatch: float = 0.0       # before stage 0: the control message that starts the iteration
    collect: float = 0.0        # after the last stage: the output tokens' trip back to the scheduler


class SimExecutor:
    """Returns each batch's tokens after the time its cost model gives, on a ``VirtualClock``.

    ``cost.iteration(batch) -> IterationCost``; ``cost.n_stages`` is the pipeline depth, which is
    Algorithm 1's ``n_workers``. ``speed``, if given, is a ``fitted.SpeedProfile`` (a machine slower
    at some moments than others, and after a sleep): ``speed(now, idle)`` scales an iteration
    started at ``now``, ``idle`` when the engine had nothing in flight for more than ``IDLE_GAP``
    before it, and an idle start also waits ``speed.wake`` seconds (the engine's Python between
    waking and launching).
    Tokens are placeholders (the paper's workload ignores EOS); with ``eos_after(request) -> int |
    None`` a request emits ``eos_token_id`` after that many tokens.
    """

    def __init__(self, cost, eos_after=None, speed=None):
        self.cost, self.eos_after, self.speed = cost, eos_after, speed
        self.n_workers = cost.n_stages
        self.clock = VirtualClock()
        self.stage_free = [0.0] * self.n_workers   # when each stage finishes the work queued on it
        self.in_flight: deque[tuple[float, Completion]] = deque()   # (ready time, completion)
        self.last_ready: float | None = None       # when the last batch came back

    def submit(self, batch):
        now = self.clock.now()
        cost = self.cost.iteration(batch)
        idle = not self.in_flight and self.last_ready is not None and now - self.last_ready > IDLE_GAP
        k, wake = (1.0, 0.0) if self.speed is None else (self.speed(now, idle), self.speed.wake if idle else 0.0)
        t, stages = now + wake + k * cost.dispatch, []
        for s, busy in enumerate(cost.stages):
            start = max(t, self.stage_free[s])
            t = self.stage_free[s] = start + k * busy
            stages.append(StageTime(s, start, t))
        # the tokens' return trip delays this batch but keeps no stage busy
        self.in_flight.append((t + k * cost.collect, Completion(batch, self._tokens(batch), stages)))

    def wait(self, timeout: float | None = None) -> Completion | None:
        """The oldest batch once it is done, or None if ``timeout`` comes first. Stages are FIFO and
        the return trip is the same for all, so batches complete in submission order."""
        ready, done = self.in_flight[0]
        if timeout is not None and self.clock.now() + timeout < ready:
            self.clock.sleep_until(self.clock.now() + timeout)
            return None
        self.clock.sleep_until(ready)
        self.last_ready = ready
        return self.in_flight.popleft()[1]

    def _tokens(self, batch) -> list[int]:
        if self.eos_after is None:
            return [0] * len(batch.requests)
        return [_token(req, self.eos_after(req)) for req in batch.requests]

    def close(self):
        self.in_flight.clear()


def _token(req, stop: int | None) -> int:
    """EOS once the request has ``stop`` tokens, else any other id."""
    eos = req.params.eos_token_id
    if stop is not None and eos is not None and len(req.output) + 1 >= stop:
        return eos
    return 1 if eos == 0 else 0
