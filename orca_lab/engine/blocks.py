"""The paged K/V manager (vLLM's PagedAttention, after ORCA): the slot pool cut into blocks of
``block_size`` slots, handed to a request one block at a time as its context grows.

A request's block table is its list of blocks; laid out as slot ids (``req.slots``) it is what the
kernels already read, so paging needs no new attention path. The pool and its span allocator are
``KVSlotManager``'s: every run taken or given back is a whole number of blocks, so every free run
starts on a block boundary and a taken block is always whole. Unlike ORCA's reservation, nothing
guarantees a running request its next block: the scheduler preempts when the pool runs dry.

Slot ids stay on the host, as ORCA's reservation keeps them. Where a pool is read, a request's
table lives in a host buffer sized for its ``max_tokens``: a new block writes its own slots there
and ``req.slots`` becomes a longer view, so growing costs the new block, not the whole context.
"""
from __future__ import annotations

import torch

from orca_lab.config import check_blocks
from orca_lab.engine.kv_manager import KVSlotManager, _held, _slot_ids


class BlockManager(KVSlotManager):
    def __init__(self, n_slots: int, block_size: int = 16, *shape, watermark: float = 0.01, **pool):
        """``watermark``: the fraction of blocks admission leaves free, so that the requests already
        running can grow for a while before one is preempted (vLLM: 1%)."""
        check_blocks(n_slots, block_size)
        super().__init__(n_slots, *shape, **pool)
        self.block_size = block_size
        self.n_blocks = n_slots // block_size
        self.watermark_blocks = int(watermark * self.n_blocks)
        self._tables: dict[int, torch.Tensor] = {}     # rid -> host buffer of its slot ids

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    @property
    def n_free_blocks(self) -> int:
        return (self.n_slots - self.n_reserved) // self.block_size

    def blocks_held(self, req) -> int:
        return 0 if req.slots is None else len(req.slots) // self.block_size

    def can_admit(self, n_tokens: int, hit: list[int] = ()) -> bool:
        """Admission of a waiting request whose first iteration writes ``n_tokens``: its blocks and
        the watermark must fit, except into an empty pool (else a long prompt would wait forever).
        ``hit``: cached blocks it starts with (none here: ``prefix_cache.py``)."""
        spare = self.n_free_blocks - self.blocks_for(n_tokens)
        return spare >= (self.watermark_blocks if self.n_holders else 0)

    def can_grow(self, req, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) - self.blocks_held(req) <= self.n_free_blocks

    def lookup(self, req) -> list[int]:
        """Cached blocks that start ``req``'s context: none without prefix caching (``prefix_cache.py``)."""
        return []

    def share(self, req, hit: list[int], first: bool = True):
        """Start ``req`` with the cached blocks ``hit`` (none here)."""

    def blocks_to_grow(self, req, n_tokens: int) -> int:
        """The blocks ``req`` lacks to cover ``n_tokens`` tokens (the caller checked ``can_grow``)."""
        need = max(0, self.blocks_for(n_tokens) - self.blocks_held(req))
        if need > self.n_free_blocks:
            raise RuntimeError(f"cannot grow request {req.rid} by {need} blocks: {self.n_free_blocks} free")
        return need

    def grow(self, req, n_tokens: int):
        """Extend ``req``'s block table to cover ``n_tokens`` tokens; the caller checked ``can_grow``."""
        need = self.blocks_to_grow(req, n_tokens)
        if not need:
            return
        runs = self.take(need * self.block_size)
        self.n_reserved += need * self.block_size
        self._holders[req.rid] = req
        self._runs.setdefault(req.rid, []).extend(runs)
        held = 0 if req.slots is None else len(req.slots)
        new = _slot_ids(runs, self.k is not None)
        # a new object each time: the worker executor sends a request's slots again when they change
        req.slots = (req.slots or []) + new if self.k is None else self._extend(req, held, new)
        self.n_used += _held(req.n_cached, len(req.slots)) - _held(req.n_cached, held)

    def _extend(self, req, held: int, new: torch.Tensor) -> torch.Tensor:
        """``req``'s slot ids with ``new`` appended, a view of its host buffer."""
        buf = self._tables.get(req.rid)
        if buf is None or len(buf) < held + len(new):
            size = max(self.blocks_for(req.max_tokens) * self.block_size, held + len(new))
            buf, old = torch.empty(size, dtype=torch.int64), buf
            if held:
                buf[:held] = old[:held]
            self._tables[req.rid] = buf
        buf[held:held + len(new)] = new
        return buf[:held + len(new)]

    def release(self, req):
        super().release(req)
        self._tables.pop(req.rid, None)

    def block_table(self, req) -> list[int]:
        """The request's blocks, in context order (block ``b`` holds slots ``[b*bs, (b+1)*bs)``)."""
        if req.slots is None:
            return []
        return [int(s) // self.block_size for s in req.slots[::self.block_size]]
