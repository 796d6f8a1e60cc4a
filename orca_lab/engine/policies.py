"""Scheduling after ORCA, beside Algorithm 1 and behind the same ``add / select / on_return``.

- ``PagedScheduler`` (``system="paged"``, vLLM's PagedAttention): K/V in blocks given out as a context
  grows (``blocks.py``) instead of ``max_tokens`` reserved at admission. A waiting request is admitted
  first-come-first-served while free blocks cover its prompt plus a small watermark. When a request
  needs a block and none is free, the most recently arrived request holding blocks is preempted: its
  blocks are freed and it waits again, to recompute its prompt and the tokens it has generated in one
  pass (vLLM's recompute preemption: those tokens are kept, so the output does not change).
- ``ChunkedScheduler`` (``system="chunked"``, Sarathi-Serve's stall-free batching, vLLM V1's default):
  paging plus a budget of ``max_num_batched_tokens`` new tokens per iteration. Decodes go first; the
  prefill chunks of the oldest waiting or partly prefilled requests fill what is left, so a long
  prompt spans several iterations and never stalls the decodes. A chunk that does not finish the
  context produces no token and is not sampled (``Batch.yields``): a seeded request draws nothing
  for it, so it gets the tokens it gets unchunked, as in vLLM and SGLang.

A chunk, like a recomputation, is a request whose new tokens start past position 0: the ragged
attention already takes ``q_len < kv_len``. With ``n_workers`` batches in flight, a request in flight
is never preempted (its blocks are being written and its token is on the way); if every request that
could give up blocks is in flight, the one that needs a block waits for a later iteration.
"""
from __future__ import annotations

from orca_lab.engine.batch import Batch
from orca_lab.engine.blocks import BlockManager
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.request import Request, RequestState
from orca_lab.engine.scheduler import OrcaScheduler, RequestLevelScheduler

SYSTEMS = ("orca", "ft", "paged", "chunked")
PAGED = ("paged", "chunked")


class PagedScheduler(OrcaScheduler):
    name = "paged"
    budget: int | None = None       # new tokens per iteration; None: whole prompts (no chunking)

    def __init__(self, kv: BlockManager, max_bs: int):
        super().__init__(kv, max_bs)
        self.n_preemptions = 0

    def reservation(self, req: Request) -> int:
        """What a request needs to run at all: blocks for its whole context, alone in the pool."""
        return self.kv.blocks_for(req.max_tokens) * self.kv.block_size

    def select(self, now: float = 0.0) -> Batch | None:
        batch, q_lens, left = [], [], self.budget or float("inf")
        preempted, admitting = set(), True
        ready = [r for r in self.pool if _decoding(r)]
        for req in ready + [r for r in self.pool if not _decoding(r)]:
            if len(batch) == self.max_bs or left == 0:
                break
            if req.state is RequestState.RUNNING:
                continue
            if req.rid in preempted:
                admitting = False         # FCFS: nothing waiting overtakes a request preempted now
                continue
            q = min(len(req.pending_tokens()), left)
            if req.state is RequestState.INITIATION:
                if not (admitting and self.kv.can_admit(q)):
                    admitting = False     # FCFS admission: a later, smaller prompt does not overtake;
                    continue              # requests holding blocks still run (else they would deadlock)
                req.t_scheduled = now if req.t_scheduled is None else req.t_scheduled
            elif not self._make_room(req, req.n_cached + q, batch, preempted):
                continue                  # it preempted itself, or every victim is in flight
            self.kv.grow(req, req.n_cached + q)
            batch.append(req)
            q_lens.append(q)
            left -= q
        if not batch:
            return None
        for req in batch:
            req.state = RequestState.RUNNING
        return Batch.selective(batch, q_lens)

    def _make_room(self, req: Request, n_tokens: int, batch, preempted: set) -> bool:
        """Preempt the latest arrivals holding blocks (not in flight, not in this batch) until
        ``req`` can grow to ``n_tokens``; False if ``req`` itself was the one preempted, or no
        request could give up blocks."""
        while not self.kv.can_grow(req, n_tokens):
            victims = [r for r in self.pool if r.slots is not None and r.state is RequestState.INCREMENT
                       and r not in batch]
            if not victims:
                return False
            victim = victims[-1]          # the pool is in arrival order
            self._preempt(victim)
            preempted.add(victim.rid)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request):
        """Recompute preemption: free the blocks; the generated tokens stay and are fed again."""
        self.kv.release(req)
        req.n_cached, req.state = 0, RequestState.INITIATION
        req.n_preemptions += 1
        self.n_preemptions += 1


class ChunkedScheduler(PagedScheduler):
    name = "chunked"

    def __init__(self, kv: BlockManager, max_bs: int, max_num_batched_tokens: int = 512):
        super().__init__(kv, max_bs)
        self.budget = max_num_batched_tokens


def _decoding(req: Request) -> bool:
    """Holds the K/V of its whole context but the last token: its next iteration is one decode."""
    return req.state is RequestState.INCREMENT and req.n_cached == req.context_len - 1


# -- building a policy ----------------------------------------------------------------------------
def new_kv(system: str, n_slots: int, block_size: int = 16, *shape, **pool) -> KVSlotManager:
    """The K/V manager of ``system``: ORCA's (and FT's) reservation, or blocks for paged policies.
    ``shape`` = (n_layers, n_heads, head_dim) allocates the pool; none keeps only the accounting."""
    if system in PAGED:
        return BlockManager(n_slots, block_size, *shape, **pool)
    return KVSlotManager(n_slots, *shape, **pool)


def new_scheduler(system: str, kv: KVSlotManager, max_bs: int, max_seq_len: int, mbs: int | None = None,
                  max_num_batched_tokens: int = 512):
    if system == "orca":
        return OrcaScheduler(kv, max_bs)
    if system == "paged":
        return PagedScheduler(kv, max_bs)
    if system == "chunked":
        return ChunkedScheduler(kv, max_bs, max_num_batched_tokens)
    if system == "ft":
        return RequestLevelScheduler(kv, max_bs, max_seq_len, mbs)
    raise ValueError(f"system={system!r} is not allowed: choose one of {SYSTEMS}")
