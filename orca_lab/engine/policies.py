"""Scheduling after ORCA, beside Algorithm 1 and behind the same ``add / select / on_batch_return``.

- ``PagedScheduler`` (``system="paged"``, vLLM's PagedAttention): K/V in blocks given out as a context
  grows (``blocks.py``) instead of ``max_tokens`` reserved at admission. A waiting request is admitted
  first-come-first-served while free blocks cover its prompt plus a small watermark. When a request
  needs a block and none is free, the most recently arrived request holding blocks is preempted (the
  request itself when it is that one; never a request that arrived before it): its blocks are freed
  and it waits again, to recompute its prompt and the tokens it has generated in one pass (vLLM's
  recompute preemption: those tokens are kept, so the output does not change).
- ``ChunkedScheduler`` (``system="chunked"``, Sarathi-Serve's stall-free batching, vLLM V1's default):
  paging plus a budget of ``max_num_batched_tokens`` new tokens per iteration (``fill_budget``).
  Decodes go first; the prefill chunks of the oldest waiting or partly prefilled requests fill what
  is left, so a long prompt spans several iterations and never stalls the decodes. A chunk that does
  not finish the context produces no token and is not sampled (``Batch.yields``): a seeded request
  draws nothing for it, so it gets the tokens it gets unchunked, as in vLLM and SGLang.

- Prefix caching (``prefix_caching=True``, ``prefix_cache.py``, vLLM's automatic prefix caching) is a
  flag of both, not a scheduler: a request admitted from ``waiting`` starts with the cached blocks of
  its context and prefills the rest. ``schedule_policy="lpm"`` admits the waiting request with the
  longest cached prefix first (SGLang's default) instead of the earliest arrival.

A chunk, like a recomputation or a prompt past its cached prefix, is a request whose new tokens
start past position 0: the ragged attention already takes ``q_len < kv_len``. With ``n_workers``
batches in flight, a request in flight is never preempted (its blocks are being written and its
token is on the way); if a later request holds blocks but is in flight, the one that needs a block
waits for a later iteration, keeping its own.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

from orca_lab.config import SCHEDULE_POLICIES, check_choice
from orca_lab.engine.batch import Batch
from orca_lab.engine.blocks import BlockManager
from orca_lab.engine.kv_manager import KVMemory, KVSlotManager
from orca_lab.engine.prefix_cache import PrefixCachingBlockManager
from orca_lab.engine.request import Request, RequestState
from orca_lab.engine.scheduler import OrcaScheduler, RequestLevelScheduler, arrival_order, enqueue

# SGLang's bound: past it, looking up every waiting request's prefix each iteration costs more than
# the order saves, and "lpm" admits in arrival order (O(batch) per iteration again)
LPM_MAX_WAITING = 128


def fill_budget(decodes, prompts, budget, max_bs: int, run):
    """One iteration under Sarathi-Serve's token budget (stall-free batching): every decode first, one
    token each, then the prompts in arrival order, each cut to what is left of ``budget``, until the
    budget is spent or ``max_bs`` requests run. ``decodes`` and ``prompts`` yield ``(request, tokens
    it still has to feed)``; ``run(request, n) -> bool`` puts it in the batch with ``n`` new tokens,
    False when it cannot run now (no room; the scheduler says why): it takes nothing then. ``budget``
    is ``math.inf`` for whole prompts (``system="paged"``). Notebook 11 has a learner write it."""
    left, n_run = budget, 0
    for req, n_tokens in itertools.chain(decodes, prompts):
        n = min(n_tokens, left)
        if run(req, n):
            left, n_run = left - n, n_run + 1
            if left == 0 or n_run == max_bs:
                return


class PagedScheduler(OrcaScheduler):
    name = "paged"
    budget: int | None = None       # new tokens per iteration; None: whole prompts (no chunking)
    fill_budget = staticmethod(fill_budget)   # how many new tokens each request feeds (a learner's plugs in)

    def __init__(self, kv: BlockManager, max_bs: int, schedule_policy: str = "fcfs"):
        super().__init__(kv, max_bs)
        self.n_preemptions = 0
        self.schedule_policy = schedule_policy    # "fcfs", or "lpm": longest cached prefix first

    def reservation(self, req: Request) -> int:
        """What a request needs to run at all: blocks for its whole context, alone in the pool."""
        return self.kv.blocks_for(req.max_tokens) * self.kv.block_size

    def select(self, now: float = 0.0) -> Batch | None:
        """Decodes first, then in arrival order the scheduled requests that are not decoding (a
        prompt in chunks, a preempted request to recompute) and the head of ``waiting``, offered to
        ``fill_budget``, which says how many new tokens each feeds. A preempted request stays among
        the scheduled ones, at its place in arrival order: it arrived before every waiting request,
        and is admitted again before any of them."""
        forming = _Forming(self, now)
        lpm = self.schedule_policy == "lpm" and len(self.waiting) <= LPM_MAX_WAITING
        order = self._longest_prefix_first if lpm else None
        decodes = forming.offer([r for r in self.running if _decoding(r)])
        prompts = forming.offer(_then_waiting([r for r in self.running if not _decoding(r)], self.waiting,
                                              lambda: forming.admitting, order))
        self.fill_budget(decodes, prompts, self.budget or math.inf, self.max_bs, forming.run)
        if not forming.batch:
            return None
        for req in forming.batch:
            req.state = RequestState.RUNNING
        return Batch.selective(forming.batch, forming.q_lens)

    def victims(self, running: list[Request], chosen: set[int]) -> "Victims":
        """Who may be preempted during one ``select`` (a learner's choice plugs in here, notebook 11)."""
        return Victims(running, chosen)

    def _admit_waiting(self, req: Request):
        if self.waiting[0] is req:
            self._admit()
        else:                              # "lpm" admits past the head
            self.waiting.remove(req)
            enqueue(self.running, req)

    def _longest_prefix_first(self, waiting) -> list[Request]:
        """SGLang's "lpm" order: the waiting requests with the longest cached prefix first, in arrival
        order among equals. It looks up every waiting request each iteration, so past
        ``LPM_MAX_WAITING`` of them ``select`` goes FCFS, as SGLang does. A request that shares nothing
        waits while requests that share keep arriving: it may starve (``tests/test_prefix_caching.py``
        measures it)."""
        hits = {r.rid: len(self.kv.lookup(r)) for r in waiting}
        return sorted(waiting, key=lambda r: (-hits[r.rid], arrival_order(r)))

    def _make_room(self, req: Request, n_tokens: int, victims: "Victims", preempted: set) -> bool:
        """Preempt the latest arrivals after ``req`` holding blocks (not in flight, not in this batch)
        until ``req`` can grow to ``n_tokens``. None left: ``req`` preempts itself if it is the latest
        request holding blocks (vLLM's order); if a later one holds blocks it cannot give up now (in
        flight, or in this batch), ``req`` keeps its own and waits for it. A request never gives way
        to a later one: else two could take each other's blocks for ever (a livelock seen with two
        batches in flight). False when ``req`` does not run this iteration."""
        while not self.kv.can_grow(req, n_tokens):
            victim = victims.next(req)
            if victim is None:
                if victims.held_after(req):
                    return False
                victim = req
            self._preempt(victim)
            preempted.add(victim.rid)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request):
        """Recompute preemption: free the blocks; the generated tokens stay and are fed again."""
        self.kv.release(req)
        self.kv.cache(req, 0)
        req.state = RequestState.INITIATION
        req.n_preemptions += 1
        self.n_preemptions += 1


class Victims:
    """The requests that may give up their blocks for ``req``, latest arrival first: arrived after
    it, holding blocks, between iterations (not in flight) and not in the batch being formed.
    Within one ``select`` no request becomes a victim again once passed over (one in flight stays in
    flight, one in the batch stays there), so one walk back through the scheduled requests (in
    arrival order) serves every preemption of the select."""

    def __init__(self, running: list[Request], chosen: set[int]):
        self.running, self.chosen, self.i = running, chosen, len(running)

    def next(self, req: Request) -> Request | None:
        while self.i > 0 and arrival_order(self.running[self.i - 1]) > arrival_order(req):
            self.i -= 1
            r = self.running[self.i]
            if r.slots is not None and r.state is RequestState.INCREMENT and r.rid not in self.chosen:
                return r
        return None

    def held_after(self, req: Request) -> bool:
        """Whether a request that arrived after ``req`` holds blocks (in flight or in this batch, once
        ``next`` found none to preempt): a scan from the latest arrival back to ``req``."""
        for r in reversed(self.running):
            if arrival_order(r) <= arrival_order(req):
                return False
            if r.slots is not None:
                return True
        return False


class _Forming:
    """The batch one ``select`` forms: it offers the requests to ``fill_budget`` and runs those it
    can (admission, blocks, preemption). ``admitting``: FCFS, once a waiting request is not admitted
    (or a request is preempted by this select) no waiting request after it is."""

    def __init__(self, sched: PagedScheduler, now: float):
        self.sched, self.now, self.admitting = sched, now, True
        self.batch, self.q_lens, self.chosen, self.preempted = [], [], set(), set()
        self.hits: dict[int, list[int]] = {}          # rid -> prefix caching's blocks it starts with
        self.victims = sched.victims(list(sched.running), self.chosen)

    def offer(self, reqs):
        """``(request, tokens it still has to feed)`` for those of ``reqs`` that may run now: not in
        flight, not preempted by this select; past a cached prefix, the tokens after it."""
        kv = self.sched.kv
        for req in reqs:
            if req.state is RequestState.RUNNING:
                continue
            if req.rid in self.preempted:
                self.admitting = False    # FCFS: nothing waiting overtakes a request preempted now
                continue
            starting = req.state is RequestState.INITIATION
            hit = self.hits[req.rid] = kv.lookup(req) if starting and self.admitting else []
            yield req, len(req.pending_tokens()) - len(hit) * kv.block_size

    def run(self, req: Request, q: int) -> bool:
        """Put ``req`` in the batch with ``q`` new tokens if it can run: False when it is not admitted,
        or finds no room (it preempted itself, or waits for a later request's blocks)."""
        sched, kv = self.sched, self.sched.kv
        if req.state is RequestState.INITIATION:
            if not (self.admitting and kv.can_admit(q, self.hits[req.rid])):
                self.admitting = False    # FCFS admission: a later, smaller prompt does not overtake;
                return False              # requests holding blocks still run (else they would deadlock)
            first = req.t_scheduled is None
            if first:
                sched._admit_waiting(req)   # it joins the scheduled requests
                req.t_scheduled = self.now
            kv.share(req, self.hits[req.rid], first)
        elif not sched._make_room(req, req.n_cached + q, self.victims, self.preempted):
            self.admitting = self.admitting and req.rid in self.preempted   # waiting for room: none overtakes it
            return False
        kv.grow(req, req.n_cached + q)
        self.chosen.add(req.rid)
        self.batch.append(req)
        self.q_lens.append(q)
        return True


def _then_waiting(scheduled: list[Request], waiting, admitting, order=None):
    """``scheduled``, then the head of ``waiting`` while ``admitting()``: the head is either admitted
    (it leaves ``waiting``, and the next one is the head) or stops admission, so the rest of the
    queue, which could only be skipped, is never visited. A head still there when the next is asked
    for (a plugged ``fill_budget`` read on without running it) is passed, so the walk always ends.
    ``order(waiting)``: the waiting requests in another order than arrival (a snapshot, taken once
    the scheduled ones are done)."""
    yield from scheduled
    if order is None:
        i = 0
        while i < len(waiting) and admitting():
            req = waiting[i]
            yield req
            if i < len(waiting) and waiting[i] is req:
                i += 1             # neither admitted nor refused: read on past it
        return
    for req in order(waiting) if waiting and admitting() else ():
        if not admitting():
            return
        yield req


class ChunkedScheduler(PagedScheduler):
    name = "chunked"

    def __init__(self, kv: BlockManager, max_bs: int, max_num_batched_tokens: int = 512,
                 schedule_policy: str = "fcfs"):
        super().__init__(kv, max_bs, schedule_policy)
        self.budget = max_num_batched_tokens


def _decoding(req: Request) -> bool:
    """Holds the K/V of its whole context but the last token: its next iteration is one decode."""
    return req.state is RequestState.INCREMENT and req.n_cached == req.context_len - 1


# -- the systems: one registry, each with its K/V manager, its scheduler and what it takes --------
@dataclass(frozen=True)
class System:
    """One way to serve (``system="orca"`` ...): what it is built of and what it supports. A name is
    resolved once (``system(name)``) where it enters; everything else reads the entry. A new policy is
    one more entry in ``REGISTRY``."""
    name: str
    # (kv, max_bs, max_seq_len, mbs, max_num_batched_tokens, schedule_policy) -> its scheduler
    scheduler: Callable
    paged: bool                                # K/V in blocks given out as a context grows (blocks.py)
    policies: tuple[str, ...] = ("fcfs",)      # the schedule_policy values it takes
    # schedules whole requests (the FasterTransformer-style baseline, baseline.py): padded batches run
    # in micro-batches of ``mbs`` (which it takes), each request's K/V reserved for max_seq_len
    request_level: bool = False

    @property
    def prefix_caching(self) -> bool:
        """Whether it takes ``prefix_caching=True``: sharing full blocks needs paged K/V."""
        return self.paged

    def check(self, prefix_caching: bool = False, schedule_policy: str | None = None, mbs: int | None = None,
              max_bs: int | None = None):
        """Refuse what this system cannot take (each field's own range: ``EngineConfig``); None: not
        asked about."""
        if prefix_caching and not self.prefix_caching:
            raise ValueError(f"prefix_caching=True is not allowed with system={self.name!r}: it shares K/V blocks "
                             f"between requests, and {self.name!r} reserves each request's slots whole instead of "
                             f"paging them; use system={' or '.join(repr(n) for n, s in REGISTRY.items() if s.paged)}"
                             ", or prefix_caching=False")
        if schedule_policy is not None and schedule_policy not in self.policies:
            raise ValueError(f"schedule_policy={schedule_policy!r} is not allowed with system={self.name!r}: "
                             f"allowed {self.policies}")
        if mbs is not None and self.request_level and max_bs is not None and not 1 <= mbs <= max_bs:
            raise ValueError(f"mbs={mbs} is out of range: allowed [1, max_bs={max_bs}]")

    def new_kv(self, n_slots: int, block_size: int = 16, *shape, prefix_caching: bool = False,
               memory: KVMemory | None = None, **pool) -> KVSlotManager:
        """Its K/V manager: ORCA's (and FT's) reservation, or blocks (their full blocks cached and
        shared with ``prefix_caching``, ``prefix_cache.py``). ``pool=`` a ``KVPool`` to hand out (an
        LLM's: blocks are slots, so every system shares it); ``shape`` = (n_layers, n_heads, head_dim)
        allocates one; neither keeps only the accounting. ``memory``: what holds the K/V when it is not
        ``pool`` (a ``WorkerPool``: this manager keeps the accounting of its workers' slots). A manager
        over a memory goes through the memory's prefix cache (``KVMemory.lend_kv``)."""
        self.check(prefix_caching)
        memory = pool.get("pool") if memory is None else memory

        def make():
            if self.paged:
                cls = PrefixCachingBlockManager if prefix_caching else BlockManager
                return cls(n_slots, block_size, *shape, **pool)
            return KVSlotManager(n_slots, *shape, **pool)
        return make() if memory is None else memory.lend_kv(make, prefix_caching, n_slots, block_size)

    def new_scheduler(self, kv: KVSlotManager, max_bs: int, max_seq_len: int, mbs: int | None = None,
                      max_num_batched_tokens: int = 512, schedule_policy: str = "fcfs"):
        self.check(isinstance(kv, PrefixCachingBlockManager), schedule_policy, mbs, max_bs)
        scheduler = self.scheduler(kv, max_bs, max_seq_len, mbs, max_num_batched_tokens, schedule_policy)
        scheduler.check_pool()
        return scheduler


REGISTRY: dict[str, System] = {s.name: s for s in (
    System("orca", lambda kv, max_bs, *_: OrcaScheduler(kv, max_bs), paged=False),
    System("ft", lambda kv, max_bs, max_seq_len, mbs, *_: RequestLevelScheduler(kv, max_bs, max_seq_len, mbs),
           paged=False, request_level=True),
    System("paged", lambda kv, max_bs, _len, _mbs, _budget, policy: PagedScheduler(kv, max_bs, policy),
           paged=True, policies=SCHEDULE_POLICIES),
    System("chunked", lambda kv, max_bs, _len, _mbs, budget, policy: ChunkedScheduler(kv, max_bs, budget, policy),
           paged=True, policies=SCHEDULE_POLICIES),
)}
SYSTEMS = tuple(REGISTRY)                                           # the package's own
PAGED = tuple(name for name, s in REGISTRY.items() if s.paged)


def system(name: str) -> System:
    """The registry's entry for ``name``, refused with the allowed names when there is none."""
    check_choice("system", name, tuple(REGISTRY))
    return REGISTRY[name]


def new_kv(name: str, n_slots: int, block_size: int = 16, *shape, prefix_caching: bool = False,
           **pool) -> KVSlotManager:
    """``system(name).new_kv(...)``."""
    return system(name).new_kv(n_slots, block_size, *shape, prefix_caching=prefix_caching, **pool)


def new_scheduler(name: str, kv: KVSlotManager, max_bs: int, max_seq_len: int, mbs: int | None = None,
                  max_num_batched_tokens: int = 512, schedule_policy: str = "fcfs"):
    """``system(name).new_scheduler(...)``."""
    return system(name).new_scheduler(kv, max_bs, max_seq_len, mbs, max_num_batched_tokens, schedule_policy)
