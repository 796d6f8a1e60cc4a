"""The time an engine lives in: wall time, virtual time (the simulator's), and one stage's start and
end on its device (a CUDA event pair, so that timing does not synchronize the stream)."""
from __future__ import annotations

import time

import torch


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

