"""The engine loop of Algorithm 1: keep ``n_workers`` batches in flight, take results as they return.

Requests arrive from a trace (on the executor's clock) or are added by hand; each iteration leaves a
record per pipeline stage, and each request a record of its timestamps: together a ``RunResult``.
"""
from __future__ import annotations

import dataclasses
import json
from collections import deque
from dataclasses import dataclass, field

from orca_lab.engine.request import Request, SamplingParams


@dataclass(frozen=True)
class IterationRecord:
    """One pipeline stage of one iteration (a batch, or a micro-batch for the baseline)."""
    iteration: int
    stage: int
    start: float
    end: float
    rids: tuple[int, ...]
    phases: tuple[str, ...]       # per request: prefill / decode / held
    q_lens: tuple[int, ...]       # new tokens per request
    n_tokens: int                 # rows of the [sum L, H] tensor (B*L when padded)
    in_flight: int                # batches in flight once this one was submitted
    kv_reserved: int              # Algorithm 1's n_rsrv after selection
    kv_used: int                  # slots holding real K/V after selection


@dataclass(frozen=True)
class RequestRecord:
    rid: int
    arrival: float
    prompt_len: int
    n_generated: int
    t_scheduled: float | None
    t_first_token: float | None
    t_finish: float | None
    n_iterations: int
    output: tuple[int, ...]
    n_preemptions: int = 0        # paged policies: times its K/V was freed and recomputed


@dataclass
class RunResult:
    system: str
    requests: list[RequestRecord]
    iterations: list[IterationRecord]
    config: dict = field(default_factory=dict)
    duration: float = 0.0        # first arrival to last finish, on the run's clock

    def requests_df(self):
        import pandas as pd
        return pd.DataFrame([dataclasses.asdict(r) for r in self.requests])

    def iterations_df(self):
        import pandas as pd
        return pd.DataFrame([dataclasses.asdict(r) for r in self.iterations])

    def to_json(self) -> dict:
        return {"system": self.system, "config": self.config, "duration": self.duration,
                "requests": [dataclasses.asdict(r) for r in self.requests],
                "iterations": [dataclasses.asdict(r) for r in self.iterations]}

    def save(self, path):
        with open(path, "w") as f:
            json.dump(self.to_json(), f)


class Engine:
    """Algorithm 1's loop around one scheduler and one executor."""

    def __init__(self, scheduler, executor, vocab_size: int, max_seq_len: int, config: dict | None = None):
        self.scheduler, self.executor = scheduler, executor
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.config = config or {}
        self.n_workers = executor.n_workers
        self.requests: list[Request] = []
        self.records: list[IterationRecord] = []
        self.n_scheduled = 0                      # batches in flight (Algorithm 1)
        self._next_rid = 0
        self._iteration = 0
        self._pending: deque = deque()           # trace items not arrived yet

    @property
    def clock(self):
        return self.executor.clock

    # -- submission: bad input is refused here, and the engine keeps serving the others ----------
    def add_request(self, prompt, params: SamplingParams, arrival: float | None = None) -> Request:
        prompt = self._check_prompt(prompt)
        if len(prompt) + params.max_gen_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_gen_tokens ({params.max_gen_tokens}) "
                             f"= {len(prompt) + params.max_gen_tokens} exceeds the model's max length: "
                             f"allowed <= {self.max_seq_len}")
        if params.eos_token_id is not None and not 0 <= params.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id={params.eos_token_id} is out of range: allowed "
                             f"[0, {self.vocab_size - 1}]")
        req = Request(self._next_rid, prompt, params, self.clock.now() if arrival is None else arrival)
        self.scheduler.add(req)
        self._next_rid += 1
        self.requests.append(req)
        return req

    def _check_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise TypeError(f"prompt must be a list of token ids, got {type(prompt).__name__}")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt is empty: allowed length [1, max_seq_len - max_gen_tokens]")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of the vocabulary: allowed "
                             f"[0, {self.vocab_size - 1}]")
        return prompt

    # -- the loop -----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work() or self.n_scheduled > 0

    def step(self) -> list[tuple[Request, int]]:
        """One turn of Algorithm 1's loop: schedule a batch if one can be formed; wait for a
        returning batch once n_workers are in flight (or when nothing else can be done)."""
        self._admit_arrivals()
        now = self.clock.now()
        batch = self.scheduler.select(now)
        if batch is not None:
            batch.iteration, self._iteration = self._iteration, self._iteration + 1
            self.executor.submit(batch)
            self.n_scheduled += 1
            batch.at_submit = self._kv_snapshot()
        if self.n_scheduled and (self.n_scheduled == self.n_workers or batch is None):
            timeout = None if batch is not None or not self._pending else \
                max(0.0, self._pending[0][0] - self.clock.now())
            done = self.executor.wait(timeout)
            if done is not None:
                self.n_scheduled -= 1
                self._record(done)
                return self.scheduler.on_return(done.batch, done.tokens, self.clock.now())
        elif batch is None and self._pending:
            self.clock.sleep_until(self._pending[0][0])      # idle until the next arrival
        elif batch is None and self.scheduler.has_work():
            raise RuntimeError("no request can be scheduled and none is in flight")  # guarded by add()
        return []

    def _admit_arrivals(self):
        now = self.clock.now()
        while self._pending and self._pending[0][0] <= now:
            arrival, prompt, params = self._pending.popleft()
            self.add_request(prompt, params, arrival)

    def _kv_snapshot(self):
        kv = self.scheduler.kv
        stats = kv.stats()
        return (self.n_scheduled, kv.n_reserved, stats.used)

    def _record(self, done):
        b = done.batch
        in_flight, reserved, used = b.at_submit
        for st in done.stages:
            self.records.append(IterationRecord(
                b.iteration, st.stage, st.start, st.end, tuple(r.rid for r in b.requests),
                tuple(b.phases), tuple(b.q_lens), b.n_tokens, in_flight, reserved, used))

    def run(self, trace=(), progress: bool = False) -> RunResult:
        """Serve ``trace`` (items with ``arrival``, ``prompt``, ``max_gen_tokens``, or full
        ``params``) from time 0 on the executor's clock, plus any request already added."""
        start = self.clock.now()
        items = sorted(trace, key=lambda it: it.arrival)
        self._pending.extend((start + it.arrival, list(it.prompt), it.sampling_params()) for it in items)
        bar = _progress(len(items) + sum(1 for r in self.requests if r.t_finish is None), progress)
        done = self.scheduler.n_finished
        while self.has_work():
            self.step()
            if bar is not None and self.scheduler.n_finished > done:
                bar.update(self.scheduler.n_finished - done)
                done = self.scheduler.n_finished
        if bar is not None:
            bar.close()
        return self.result(start)

    def result(self, start: float = 0.0) -> RunResult:
        reqs = [RequestRecord(r.rid, r.arrival - start, len(r.prompt), len(r.output),
                              _rel(r.t_scheduled, start), _rel(r.t_first_token, start),
                              _rel(r.t_finish, start), r.n_iterations, tuple(r.output),
                              n_preemptions=r.n_preemptions)
                for r in self.requests]
        iters = [dataclasses.replace(it, start=it.start - start, end=it.end - start) for it in self.records] \
            if start else list(self.records)     # a simulated run starts at 0: nothing to shift
        end = max((r.t_finish for r in reqs if r.t_finish is not None), default=0.0)
        first = min((r.arrival for r in reqs), default=0.0)
        return RunResult(self.scheduler.name, reqs, iters, dict(self.config), end - first)

    def close(self):
        self.executor.close()


def _rel(t, start):
    return None if t is None else t - start


def _progress(total: int, on: bool):
    if not on:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="req", leave=False)
