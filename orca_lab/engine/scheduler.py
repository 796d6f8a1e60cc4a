"""Schedulers behind one small interface: ``add``, ``select``, ``on_batch_return``.

``OrcaScheduler`` is Algorithm 1's ``Select`` (iteration level, FCFS); ``RequestLevelScheduler`` is the
FasterTransformer-style baseline (a batch enters and leaves whole). Neither knows which executor runs
its batches: the model in this process, worker processes, or a cost model.

Each keeps its requests in two queues, as vLLM and nano-vllm do: ``waiting`` (never scheduled, in
arrival order) and the requests it has scheduled. ``select`` visits the scheduled ones (at most a
few batches of them) and the head of ``waiting``, never the whole queue: a server with 100,000
requests waiting spends per iteration what it spends with ten.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from orca_lab.config import FieldError
from orca_lab.engine.batch import Batch
from orca_lab.engine.detokenizer import undecodable
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.request import Request, RequestState
from orca_lab.engine.sampling_params import SamplingParams


def arrival_order(req: Request) -> tuple[float, int]:
    return req.arrival, req.rid


def enqueue(queue, req: Request):
    """Append ``req`` to a queue in arrival order: at the end, unless it arrived before the last
    (a request added late with an earlier arrival time), then at its place."""
    if queue and arrival_order(req) < arrival_order(queue[-1]):
        bisect.insort(queue, req, key=arrival_order)
    else:
        queue.append(req)


def take_token(req: Request, tok, now: float | None) -> int | None:
    """Hand ``req`` its token, which runs its stop checks; the token, or None if the request failed
    instead: its row's sampling failed (``tok`` is then the error's text, ``sampler.sample``) or its
    stop check raised (a tokenizer that cannot decode it). Either way it fails alone, finish_reason
    "error"; its scheduler frees its K/V and the batch goes on."""
    if isinstance(tok, str):
        req.fail(tok)
        return None
    try:
        req.append(tok, now)
    except Exception as e:               # its own stop strings or tokenizer: not the engine's fault
        req.fail(undecodable(e))
        return None
    return tok


class Scheduler:
    name = "scheduler"

    def __init__(self, kv: KVSlotManager, max_bs: int):
        self.kv, self.max_bs = kv, max_bs
        self.n_finished = 0
        self.waiting: deque[Request] = deque()     # never scheduled, in arrival order

    def reservation(self, req: Request) -> int:
        """Slots reserved for ``req`` when it is first scheduled."""
        raise NotImplementedError

    def check_admissible(self, req: Request):
        """Refuse at submission a request that could never be scheduled: it would block FCFS forever.
        Named by the field at fault: the prompt if it cannot fit with one token to generate."""
        need, n = self.reservation(req), self.kv.n_slots
        if need > n:
            p, g = len(req.prompt), req.params.max_gen_tokens
            raise FieldError(f"prompt ({p} tokens) + max_gen_tokens ({g}) = {p + g} tokens, for which {self.name} "
                             f"reserves {need} K/V slots, more than the n_slots={n} the engine has: allowed "
                             f"reservation <= {n} slots", "prompt" if self._least(req.prompt) > n else "max_gen_tokens")

    def check_pool(self):
        """Refuse a K/V pool that cannot hold the smallest request (one prompt token, one to generate):
        an engine over it would refuse every request (the baseline reserves the model's whole length
        for each)."""
        need = self._least([0])
        if need > self.kv.n_slots:
            raise FieldError(f"n_slots={self.kv.n_slots} cannot hold one request of {self.name}: it reserves "
                             f"{need} K/V slots for the smallest; allowed n_slots >= {need}", "n_slots")

    def _least(self, prompt: list[int]) -> int:
        """Slots reserved for ``prompt`` with one token to generate: the least any request of it takes."""
        return self.reservation(Request(-1, prompt, SamplingParams(max_gen_tokens=1)))

    def add(self, req: Request):
        self.check_admissible(req)
        enqueue(self.waiting, req)

    @property
    def n_waiting(self) -> int:
        """Requests never scheduled yet."""
        return len(self.waiting)

    @property
    def n_rsrv(self) -> int:
        """Algorithm 1's n_rsrv: the slots reserved by requests in the system."""
        return self.kv.n_reserved

    def abort(self, req: Request, now: float) -> bool:
        """Cancel ``req`` (finish_reason "abort"); False if it had already finished."""
        raise NotImplementedError

    def take_delivered(self) -> list[tuple[Request, int]]:
        """Tokens delivered outside ``on_batch_return`` since the last call (none here)."""
        return []

    def _finish(self, req: Request, now: float):
        req.state, req.t_finish = RequestState.FINISHED, now
        if req.slots is not None:          # a request aborted before its first iteration holds none
            self.kv.release(req)
        self.n_finished += 1


class OrcaScheduler(Scheduler):
    """Iteration-level FCFS scheduling (ORCA §4.2, Algorithm 1)."""
    name = "orca"

    def __init__(self, kv: KVSlotManager, max_bs: int):
        super().__init__(kv, max_bs)
        # Scheduled and not finished, in arrival order. Admission is FCFS, so every one of them
        # arrived before every waiting request: together they are Algorithm 1's pool, in order.
        self.running: list[Request] = []

    def reservation(self, req: Request) -> int:
        return req.max_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def select(self, now: float = 0.0) -> Batch | None:
        """Algorithm 1's Select: earliest arrivals first, up to max_bs, reserving max_tokens slots for
        a request's first iteration. It breaks (not skips) on the first request that does not fit,
        so a later, smaller request never overtakes an earlier one."""
        batch = [r for r in self.running if r.state is RequestState.INCREMENT][:self.max_bs]
        while len(batch) < self.max_bs and self.waiting:
            req = self.waiting[0]
            if not self.kv.can_reserve(req.max_tokens):
                break
            self._admit()
            self.kv.reserve(req, req.max_tokens)
            req.t_scheduled = now
            batch.append(req)
        if not batch:
            return None
        for req in batch:
            req.state = RequestState.RUNNING
        return Batch.selective(batch)

    def _admit(self) -> Request:
        """The head of ``waiting`` joins the scheduled requests."""
        req = self.waiting.popleft()
        enqueue(self.running, req)
        return req

    def on_batch_return(self, batch: Batch, tokens: list[int], now: float) -> list[tuple[Request, int]]:
        """A batch came back: every request got one token (all but a prefill chunk short of its
        context's end, ``policies.py``: ``batch.yields``); finished ones leave and free their slots.
        A request aborted while the batch was in flight leaves now, and its token is dropped; one
        that failed (``take_token``) leaves with ``(req, None)``."""
        events, left = [], False
        for req, tok, kv_len, yields in zip(batch.requests, tokens, batch.kv_lens, batch.yields):
            if req.finish_reason == "abort":
                self._finish(req, now)
                left = True
                continue
            if not isinstance(tok, str):      # a failed row's K/V is not offered to the prefix cache
                self.kv.cache(req, kv_len)
            req.n_iterations += 1
            req.state = RequestState.INCREMENT
            if not yields:
                continue
            events.append((req, take_token(req, tok, now)))
            if req.finished:
                self._finish(req, now)
                left = True
        if left:                           # one pass for all that left, not one per request
            self.running = [r for r in self.running if r.state is not RequestState.FINISHED]
        return events

    def abort(self, req: Request, now: float) -> bool:
        """Waiting or between iterations: it leaves the pool and frees its slots now. In flight: it
        leaves when its batch returns (within one iteration), as ``on_batch_return`` drops its token."""
        if req.finished:
            return False
        req.finish_reason = "abort"
        if req.state is not RequestState.RUNNING:
            (self.waiting if req.t_scheduled is None else self.running).remove(req)
            self._finish(req, now)
        return True


@dataclass(eq=False)
class _MicroBatch:
    requests: list[Request]
    start: int              # position of the next token the micro-batch feeds
    q_len: int              # the batch's shortest prompt first, then one token per iteration
    in_flight: bool = False
    batches: list = field(default_factory=list)


class RequestLevelScheduler(Scheduler):
    """FasterTransformer behind a request-level scheduler (ORCA §6 baseline, ``ft(max_bs, mbs)``).

    Up to ``max_bs`` queued requests form one batch that runs until every request in it is done.
    Its first iteration treats every prompt as the batch's shortest; the rest of the longer prompts is
    fed one token per iteration. Finished requests keep computing and are returned only when the
    batch ends; so are all the tokens of every request, its first token included, as
    FasterTransformer hands a batch's output back whole (TTFT and streaming follow from that). K/V is reserved for ``max_seq_len`` tokens per request. The batch is split into
    micro-batches of ``mbs`` requests, which a pipeline of workers runs one after another.
    """
    name = "ft"

    def __init__(self, kv: KVSlotManager, max_bs: int, max_seq_len: int, mbs: int | None = None):
        super().__init__(kv, max_bs)
        self.max_seq_len, self.mbs = max_seq_len, mbs or max_bs
        self.active: list[Request] = []
        self.micro: list[_MicroBatch] = []
        self.n_positions = 0      # positions the active batch feeds: its longest request's, less one
        self._delivered: list = []    # tokens of a batch that ended outside on_batch_return (see select)

    def reservation(self, req: Request) -> int:
        return self.max_seq_len

    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def select(self, now: float = 0.0) -> Batch | None:
        """The next step of the idle micro-batch that has run the fewest steps (they take turns
        through the pipeline), until the batch's longest request has produced its last token."""
        self._delivered += self._end_batch(now)     # a batch whose last running request was aborted
        if not self.active:
            self._form_batch(now)
        if self._batch_done():
            return None
        idle = [m for m in self.micro if not m.in_flight and m.start < self.n_positions]
        mb = min(idle, key=lambda m: len(m.batches), default=None)
        if mb is None:
            return None
        mb.in_flight = True
        batch = Batch.padded_step(mb.requests, mb.start, mb.q_len)
        mb.batches.append(batch)
        for req in mb.requests:
            req.state = RequestState.RUNNING
        return batch

    def form_batch(self) -> tuple[list[Request], int]:
        """The next batch: requests taken from the head of ``waiting`` while it is under ``max_bs`` and
        ``max_seq_len`` slots can be reserved for one more (and are), and its first iteration's new
        tokens, the shortest prompt's length (a learner's plugs in here, notebook 02)."""
        batch = []
        while self.waiting and len(batch) < self.max_bs and self.kv.can_reserve(self.max_seq_len):
            req = self.waiting.popleft()
            self.kv.reserve(req, self.max_seq_len)
            batch.append(req)
        return batch, min((len(r.prompt) for r in batch), default=0)

    def _form_batch(self, now: float):
        batch, shortest = self.form_batch()
        self.active = list(batch)
        for req in self.active:
            req.t_scheduled = now
        if self.active:
            self.n_positions = max(r.max_tokens for r in self.active) - 1   # FT's fixed step count
            self.micro = [_MicroBatch(self.active[i:i + self.mbs], 0, shortest)
                          for i in range(0, len(self.active), self.mbs)]

    def _batch_done(self) -> bool:
        return all(r.finished for r in self.active)

    def on_batch_return(self, batch: Batch, tokens: list[int], now: float) -> list[tuple[Request, int]]:
        mb = next(m for m in self.micro if m.batches and m.batches[-1] is batch)
        last_pos = mb.start + mb.q_len - 1
        for req, tok, yields in zip(batch.requests, tokens, batch.yields):
            if req.finished:
                continue                       # held (or aborted in flight): no token
            req.n_iterations += 1
            self.kv.cache(req, last_pos + 1)
            req.state = RequestState.INCREMENT
            if yields:                         # past its prompt: a real token, kept until the batch ends
                take_token(req, tok, None)
        mb.start, mb.q_len, mb.in_flight = last_pos + 1, 1, False
        return self._end_batch(now)

    def _end_batch(self, now: float) -> list[tuple[Request, int]]:
        """Once every request of the batch is done and none of its micro-batches is in flight, the
        whole batch returns at once, every token with it (FT delivers a request's tokens, the first
        included, when its batch ends), and frees its slots. Aborted requests deliver nothing, failed
        ones the tokens they made before their fault, then their end, ``(req, None)``: each was held
        like a request that finished early."""
        if not (self.active and self._batch_done() and not any(m.in_flight for m in self.micro)):
            return []
        events = []
        for req in self.active:
            if req.finish_reason != "abort":
                req.t_first_token = now if req.output else None
                events += [(req, tok) for tok in req.output]
            if req.finish_reason == "error":
                events.append((req, None))
            self._finish(req, now)
        self.active, self.micro = [], []
        return events

    def take_delivered(self) -> list[tuple[Request, int]]:
        ready, self._delivered = self._delivered, []
        return ready

    def abort(self, req: Request, now: float) -> bool:
        """Queued: it leaves the queue. In the batch: it is held like a request that finished early
        (computes padding, returns nothing more) and its slots free when the batch ends, as in FT."""
        if req.finished:
            return False
        req.finish_reason = "abort"
        if req.t_scheduled is None:        # still waiting
            self.waiting.remove(req)
            self._finish(req, now)
        return True
