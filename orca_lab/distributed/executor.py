"""The executor interface (``engine/executor.py``) over a pool of worker processes: the engine
master's side of ORCA's distributed execution (§4.1)."""
from __future__ import annotations

import time
from collections import deque

from orca_lab.distributed.messages import ControlMessage, reservation
from orca_lab.distributed.pool import WorkerPool
from orca_lab.engine.clock import RealClock
from orca_lab.engine.executor import Completion, StageTime
from orca_lab.engine.request import RequestState
from orca_lab.model import logprobs


class WorkerExecutor:
    """The executor interface over a WorkerPool (see ``executor.py``). The last stage samples with
    each request's prompt and output and computes its log-probabilities, as ``LocalExecutor`` does."""
    has_logits = True

    def __init__(self, pool: WorkerPool, owns_pool: bool = False):
        self.pool, self.owns_pool = pool, owns_pool
        self.n_workers = pool.pp
        self.clock = RealClock()
        self._wall0 = time.time() - self.clock.now()    # workers stamp wall-clock time
        self.in_flight: deque = deque()                 # (iteration id, batch), oldest first
        self.known: dict = {}                           # rid -> (Request, the slots the workers hold)
        pool.claim(self)

    @classmethod
    def for_llm(cls, llm, pool: WorkerPool | None) -> "WorkerExecutor":
        """Over ``pool`` (the one attached to ``llm``: ``pool.attached``), or when None a pool of its
        own that ``close()`` stops."""
        if pool is not None:
            return cls(pool)
        return cls(WorkerPool(llm, attach=False), owns_pool=True)

    def submit(self, batch):
        self._check_owner()
        release = [rid for rid, (r, _) in self.known.items() if r.state is RequestState.FINISHED]
        for rid in release:
            del self.known[rid]
        reserve = {}
        for r in batch.requests:
            if self.known.get(r.rid, (None, None))[1] is not r.slots:   # new, or its blocks changed
                self.known[r.rid] = (r, r.slots)
                reserve[r.rid] = reservation(r)
        iteration = self.pool.next_iteration()
        self.pool.send(ControlMessage.of(batch, iteration, reserve, release))
        self.in_flight.append((iteration, batch))

    def wait(self, timeout: float | None = None) -> Completion | None:
        self._check_owner()
        iteration, batch = self.in_flight[0]
        reports = self.pool.collect(iteration, timeout)
        if reports is None:
            return None
        self.in_flight.popleft()
        record_scores(batch, reports[-1].scores)
        stages = [StageTime(r.stage, r.start - self._wall0, r.end - self._wall0) for r in reports]
        return Completion(batch, reports[-1].tokens, stages)

    def _check_owner(self):
        if self.pool.owner is not self:
            raise RuntimeError("another engine has taken over this worker pool; create a new engine")

    def close(self):
        self.in_flight.clear()
        if self.owns_pool:
            self.pool.close()
        elif self.pool.owner is self:
            self.pool.owner = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def record_scores(batch, scores):
    """Hand the log-probabilities the last stage computed to the engine's own requests, where the
    in-process sampler would have written them."""
    if not scores:                  # no request of the batch asked: nothing to look up
        return
    by_rid = {r.rid: r for r in batch.requests}
    for rid, sampled, prompt in scores:
        req = by_rid[rid]
        if sampled is not None:
            req.logprobs.append(logprobs.from_plain(sampled))
        req.prompt_logprobs.extend(logprobs.from_plain(e) for e in prompt)
