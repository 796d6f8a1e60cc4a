"""The engine loop of Algorithm 1: keep ``n_workers`` batches in flight, take results as they return.

Requests arrive from a trace (on the executor's clock) or are added by hand; each iteration leaves a
record per pipeline stage, and each request a record of its timestamps: together a ``RunResult``.

How a server drives it (ORCA §3, Figure 4: the endpoint puts requests in the pool, the engine loop
runs iterations over it). The engine is not thread-safe: one thread owns it and loops (``orca_lab.serving.engine_core``)::

    while serving:
        for msg in drain(inbox, block=not engine.has_work()):   # block only when idle
            add: req = engine.add_request(prompt_ids, params)   # ValueError/TypeError: refuse it
            cancel: engine.abort(rid)                            # waiting, between or in flight
        for req, token in engine.step(timeout=0.01):
            send (req.rid, token, req.finish_reason) to its client   # finish_reason None: more to come

``add_request`` and ``abort`` may be called between any two steps, with batches in flight. ``step``
returns at once when there is nothing to do; ``timeout`` bounds how long it waits for a returning
batch when it could still submit another (worker processes with ``n_workers`` > 1), so new arrivals
are scheduled without waiting for the oldest batch. A request that ends (length, EOS, stop token, stop
string) shows ``req.finished`` and ``req.finish_reason`` in the step that returns its last token; an
aborted one at once, and its ``abort`` event is the caller's own. ``req.text`` is its output as text,
safe to stream by differences. ``stats()`` gives the gauges a /metrics endpoint reports.
"""
from __future__ import annotations

import dataclasses
import json
from collections import deque
from dataclasses import dataclass, field

from orca_lab.config import FieldError
from orca_lab.engine.fields import as_token, check_arrival, check_context, check_token
from orca_lab.engine.sampling_params import HOST_STATE, SamplingParams
from orca_lab.engine.request import Request


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
    finish_reason: str | None = None     # "length", "stop", "abort"; None if it never finished
    prefix_hit_tokens: int = 0    # prefix caching: prompt tokens whose K/V it found cached


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


@dataclass(frozen=True)
class EngineStats:
    """What the engine holds right now: the gauges a serving endpoint reports."""
    waiting: int           # requests never scheduled yet
    running: int           # scheduled, not finished (in flight or between iterations)
    kv_reserved: int       # Algorithm 1's n_rsrv
    kv_used: int           # slots holding real K/V
    kv_total: int          # n_slots
    n_finished: int
    prefix_hit_tokens: int = 0     # prefix caching, since the engine started: prompt tokens found cached
    prefix_query_tokens: int = 0   # ... and prompt tokens looked up (each request once, at admission)


def eos_ids(eos_token_id) -> tuple:
    """A model's EOS ids as a tuple: none, one, or a list of them."""
    if eos_token_id is None:
        return ()
    return tuple(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else (eos_token_id,)


class Engine:
    """Algorithm 1's loop around one scheduler and one executor.

    ``tokenizer`` (anything with ``decode``) lets requests stop at strings and gives ``req.text``;
    ``eos_token_id`` is the EOS a request that does not ignore it stops at unless its params name one;
    a model may have several (Llama 3's config.json lists them): the first becomes the request's
    ``eos_token_id``, the others join its ``stop_token_ids`` (as vLLM does with a generation config's).
    """

    def __init__(self, scheduler, executor, vocab_size: int, max_seq_len: int, config: dict | None = None,
                 tokenizer=None, eos_token_id: int | tuple[int, ...] | None = None):
        self.scheduler, self.executor = scheduler, executor
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.config = config or {}
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_ids(eos_token_id)
        self.n_workers = executor.n_workers
        self.requests: list[Request] = []
        self.live: dict[int, Request] = {}        # rid -> request not finished yet
        self.records: list[IterationRecord] = []
        self.n_scheduled = 0                      # batches in flight (Algorithm 1)
        self._next_rid = 0
        self._iteration = 0
        self._pending: deque = deque()           # trace items not arrived yet
        self.closed: str | None = None            # why it no longer serves, once closed

    @property
    def clock(self):
        return self.executor.clock

    # -- submission: bad input is refused here, and the engine keeps serving the others ----------
    def add_request(self, prompt, params: SamplingParams, arrival: float | None = None) -> Request:
        return self.add_requests([(prompt, params, arrival)])[0]

    def add_requests(self, items) -> list[Request]:
        """``(prompt, params, arrival)`` each, all or none: every one is checked before any is added
        (a completion with several prompts is refused whole)."""
        self._check_open()
        checked = [(*self._checked(prompt, params), None if arrival is None else check_arrival(arrival))
                   for prompt, params, arrival in items]
        return [self._add(*item) for item in checked]

    def check_requests(self, items):
        """Raise what ``add_requests`` would for ``(prompt, params)`` each, adding nothing (beam
        search asks this of its longest beams before its first step)."""
        self._check_open()
        for prompt, params in items:
            self._checked(prompt, params)

    def _add(self, prompt: list[int], params: SamplingParams, arrival: float | None) -> Request:
        req = Request(self._next_rid, prompt, params, self.clock.now() if arrival is None else arrival,
                      detokenize=None if self.tokenizer is None else self.tokenizer.decode)
        self.scheduler.add(req)
        self._next_rid += 1
        self.requests.append(req)
        self.live[req.rid] = req
        return req

    def _checked(self, prompt, params: SamplingParams) -> tuple[list[int], SamplingParams]:
        prompt = self._check_prompt(prompt)
        check_context(len(prompt), params.max_gen_tokens, self.max_seq_len)
        params = self._check_params(params)
        self.scheduler.check_admissible(Request(-1, prompt, params))
        return prompt, params

    def _check_params(self, params: SamplingParams) -> SamplingParams:
        """Token ids in the vocabulary, stop strings only with a tokenizer, a token left to sample;
        the engine's EOS filled in."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not params.ignore_eos and params.eos_token_id is None and self.eos_token_ids:
            eos, *more = self.eos_token_ids
            params = dataclasses.replace(params, eos_token_id=eos, stop_token_ids=params.stop_token_ids + tuple(
                t for t in more if t not in params.stop_token_ids))
        if params.eos_token_id is not None:
            check_token("eos_token_id", params.eos_token_id, self.vocab_size)
        for t, _ in params.logit_bias:
            check_token("logit_bias", t, self.vocab_size, "logit_bias token id")
        for t in params.stop_token_ids:
            check_token("stop_token_ids", t, self.vocab_size)
        self._check_a_token_is_left(params)
        if params.stop and self.tokenizer is None:
            raise FieldError(f"stop={list(params.stop)!r} needs a tokenizer to read the output as text: "
                             "give the LLM one, or use stop_token_ids", "stop")
        if params.needs_host_state and not getattr(self.executor, "has_logits", False):
            asked = [f"{name}={getattr(params, name)!r}" for name, off in HOST_STATE if getattr(params, name) != off]
            raise ValueError(f"{', '.join(asked)}: needs a model's logits, which the simulator's cost model "
                             "does not compute")
        return params

    def _check_a_token_is_left(self, params: SamplingParams):
        """Until ``min_tokens`` are out, EOS and the stop token ids are masked (``model/penalties.py``):
        if they are the whole vocabulary, no token could ever be drawn."""
        ends = set(params.stop_token_ids) | ({params.eos_token_id} if not params.ignore_eos else set())
        if params.min_tokens and len(ends - {None}) >= self.vocab_size:
            raise FieldError(f"stop_token_ids hold the whole vocabulary ({self.vocab_size} ids, with EOS): with "
                             f"min_tokens={params.min_tokens} it leaves no token to sample; stop on fewer ids",
                             "stop_token_ids")

    def abort(self, request) -> bool:
        """Cancel a request (a ``Request`` or its rid) wherever it is, with finish_reason "abort":
        waiting, it leaves the pool; between iterations, its K/V slots are freed now; in flight, its
        token is dropped and its slots freed when that batch returns. The request-level baseline holds
        it in its batch, as FT would. Returns False if it had already finished (one finished but held
        in the baseline's batch stays running until the batch ends)."""
        rid = request.rid if isinstance(request, Request) else request
        req = self.live.get(rid)
        if req is None:
            if isinstance(rid, int) and 0 <= rid < self._next_rid:
                return False
            raise ValueError(f"rid={rid!r} names no request of this engine")
        if not self.scheduler.abort(req, self.clock.now()):
            return False
        del self.live[rid]
        return True

    def forget(self, keep_requests: int, keep_iterations: int):
        """Bound what a long-lived engine keeps (a server runs for days): the oldest finished requests
        past the last ``keep_requests`` and the iteration records past the last ``keep_iterations``
        are dropped; requests not finished stay. ``result()`` then covers what is left."""
        old = len(self.requests) - keep_requests
        if old > 0:
            self.requests = [r for i, r in enumerate(self.requests) if i >= old or r.rid in self.live]
        del self.records[:max(0, len(self.records) - keep_iterations)]

    def stats(self) -> EngineStats:
        """O(1): counters kept as requests come and go (a server reads them every iteration)."""
        waiting, kv = self.scheduler.n_waiting, self.scheduler.kv
        return EngineStats(waiting, len(self.live) - waiting, kv.n_reserved, kv.n_used, kv.n_slots,
                           self.scheduler.n_finished, getattr(kv, "hit_tokens", 0), getattr(kv, "query_tokens", 0))

    def _check_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise TypeError(f"prompt must be a list of token ids, got {type(prompt).__name__}")
        prompt = [as_token(t) for t in prompt]
        if not prompt:
            raise FieldError("prompt is empty: allowed length [1, max_seq_len - max_gen_tokens]", "prompt")
        for t in prompt:
            if type(t) is not int or not 0 <= t < self.vocab_size:
                check_token("prompt", t, self.vocab_size, "prompt token id")
        return prompt

    # -- the loop -----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work() or self.n_scheduled > 0

    def step(self, timeout: float | None = None) -> list[tuple[Request, int]]:
        """One turn of Algorithm 1's loop: schedule a batch if one can be formed; wait for a
        returning batch once n_workers are in flight (or when nothing else can be done, then for at
        most ``timeout`` seconds, or until the trace's next arrival). Returns at once when idle."""
        self._check_open()
        self._admit_arrivals()
        now = self.clock.now()
        batch = self.scheduler.select(now)
        ready = self.scheduler.take_delivered()
        if batch is not None:
            self.submit(batch)
        if self.n_scheduled and (self.n_scheduled == self.n_workers or batch is None):
            done = self.wait(None if batch is not None else self._wait_limit(timeout))
            if done is not None:
                ready += self.scheduler.on_batch_return(done.batch, done.tokens, self.clock.now())
        elif batch is None and self._pending:
            self.clock.sleep_until(self._pending[0][0])      # idle until the next arrival
        elif batch is None and self.scheduler.has_work() and not ready:
            raise RuntimeError("no request can be scheduled and none is in flight")  # guarded by add()
        return self.retire(ready)

    def retire(self, ready: list) -> list:
        """``ready`` (``(request, token)`` pairs), its finished requests no longer live: ``step``'s, or
        those of a loop that calls the scheduler itself (a learner's, ``course/arrivals.py``)."""
        for req, _ in ready:
            if req.finished:
                self.live.pop(req.rid, None)
        return ready

    def submit(self, batch):
        """Hand ``batch`` to the executor, numbered, with what the K/V held at its submit recorded
        (``step`` does, and a learner's loop through the course's executor, notebook 03)."""
        batch.iteration, self._iteration = self._iteration, self._iteration + 1
        self.executor.submit(batch)
        self.n_scheduled += 1
        batch.at_submit = self._kv_snapshot()

    def wait(self, timeout: float | None = None):
        """The oldest batch in flight back from the executor (None past ``timeout``), its iteration
        recorded; the caller hands its tokens to the scheduler."""
        done = self.executor.wait(timeout)
        if done is not None:
            self.n_scheduled -= 1
            self._record(done)
        return done

    def _wait_limit(self, timeout: float | None) -> float | None:
        """How long an otherwise idle step waits for a batch: ``timeout``, the next arrival, or both."""
        limits = [] if timeout is None else [timeout]
        if self._pending:
            limits.append(max(0.0, self._pending[0][0] - self.clock.now()))
        return min(limits, default=None)

    def _admit_arrivals(self):
        now = self.clock.now()
        while self._pending and self._pending[0][0] <= now:
            arrival, prompt, params = self._pending.popleft()
            self.add_request(prompt, params, arrival)

    def _kv_snapshot(self):
        kv = self.scheduler.kv
        return (self.n_scheduled, kv.n_reserved, kv.n_used)

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
        for i, it in enumerate(trace):       # before sorting: a nan arrival sorts anywhere
            check_arrival(it.arrival, f"trace[{i}].arrival")
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

    def result(self, start: float = 0.0, since: float | None = None) -> RunResult:
        """The run's records, times from ``start``; with ``since`` (the clock's time), only what is
        new since then: requests not finished by then, iterations that ended after it."""
        new = lambda t: since is None or t is None or t > since
        reqs = [RequestRecord(r.rid, r.arrival - start, len(r.prompt), len(r.output),
                              _rel(r.t_scheduled, start), _rel(r.t_first_token, start),
                              _rel(r.t_finish, start), r.n_iterations, tuple(r.output), finish_reason=r.finish_reason,
                              n_preemptions=r.n_preemptions, prefix_hit_tokens=r.n_prefix_hit)
                for r in self.requests if new(r.t_finish)]
        records = [it for it in self.records if new(it.end)]
        iters = [dataclasses.replace(it, start=it.start - start, end=it.end - start) for it in records] \
            if start else records                # a simulated run starts at 0: nothing to shift
        end = max((r.t_finish for r in reqs if r.t_finish is not None), default=0.0)
        first = min((r.arrival for r in reqs), default=0.0)
        return RunResult(self.scheduler.name, reqs, iters, dict(self.config), end - first)

    def close(self, reason: str = "it was closed"):
        """Stop serving: the executor lets go of what it holds (worker processes it started; its
        LLM's K/V pool goes to the next engine). ``result()`` still reads the run."""
        if self.closed is None:
            self.closed = reason
            self.executor.close()

    def _check_open(self):
        if self.closed is not None:
            raise RuntimeError(f"this engine no longer serves: {self.closed}; create a new engine")


def _rel(t, start):
    return None if t is None else t - start


def _progress(total: int, on: bool):
    if not on:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="req", leave=False)
