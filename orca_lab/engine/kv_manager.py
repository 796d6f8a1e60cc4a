"""The Attention K/V manager (ORCA §4.2): a pre-allocated pool of token slots, reserved per request.

A request reserves all the slots it may ever need when it is first scheduled (Algorithm 1 reserves
``max_tokens``), so a running request can never run out of K/V memory: no preemption, no deadlock.
The pool holds one K and one V row per slot and layer; slots of a request need not be contiguous.

The memory (``KVPool``) and its accounting (``KVSlotManager``) are apart: an ``LLM`` allocates its
pool once, and each engine it builds gets a fresh manager over it (free runs, holders), so a
``generate`` call pays for no allocation. The memory keeps the prefix cache over it (``KVMemory``). Slot ids are host data (``req.slots``, a CPU tensor): each
iteration's metadata is built on the host and copied to the device once (``batch.py``).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVStats:
    used: int             # slots holding a real token's K/V
    reserved_unused: int  # reserved for tokens not generated yet (the waste vLLM measured)
    free: int

    @property
    def n_slots(self) -> int:
        return self.used + self.reserved_unused + self.free


class KVMemory:
    """What holds K/V (a ``KVPool`` in this process; a ``WorkerPool``, whose workers hold theirs) and
    the prefix cache over it (``prefix_cache.py``). The cache is the memory's, not an LLM's or an
    engine's: every K/V manager made over a memory comes from ``lend_kv`` (``policies.System.new_kv``),
    so whoever writes into it, whichever LLM or engine, goes through its one cache, and the cache goes
    with the memory (closed, replaced, collected).

    The blocks' names need nothing of the weights, because one memory is written by one set of
    weights: an LLM's ``KVPool`` by its own model, a ``WorkerPool``'s by the weights its workers loaded
    once, at start, whichever LLM drives them (``attach`` takes only the LLMs of that model). Weights
    changed in place call for ``reset_prefix_cache``, as in vLLM."""
    prefix_cache = None            # the PrefixCachingBlockManager over these slots, while one is kept

    def lend_kv(self, make, caching: bool, n_slots: int, block_size: int):
        """The K/V manager of a new engine writing into this memory: with ``caching``, the kept cache
        (its blocks still hold their K/V) when it has the engine's shape and no request holds a block
        of it (else an engine still running it owns it); otherwise ``make()``, which becomes the cache
        when ``caching``. A writer that does not cache drops the cache: it writes slots the cache names."""
        kept, self.prefix_cache = self.prefix_cache, None
        fits = kept is not None and (kept.n_slots, kept.block_size) == (n_slots, block_size)
        kv = kept.handed_on() if caching and fits and not kept.n_holders else make()
        if caching:
            self.prefix_cache = kv
        return kv

    def reset_prefix_cache(self):
        """Forget every cached block (vLLM's ``reset_prefix_cache``): the next engine starts empty."""
        self.prefix_cache = None


class KVPool(KVMemory):
    """K and V memory ``[n_layers, n_slots, n_heads, head_dim]``, allocated once, here.

    Zeros, not empty: the OS maps every page now, not on the first K/V write of a request while the
    engine serves (first touches would make the first runs slow and noisy). ``engine``: a weak
    reference to the engine writing into it now, one at a time whichever LLM built it (``LLM.new_engine``)."""
    engine = None

    def __init__(self, n_slots: int, n_layers: int, n_heads: int, head_dim: int, device="cpu",
                 dtype=torch.float32):
        self.n_slots, self.device = n_slots, torch.device(device)
        shape = (n_layers, n_slots, n_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def layer(self, i: int):
        """One layer's ``(k_pool, v_pool)``, each ``[n_slots, n_heads, head_dim]``."""
        return self.k[i], self.v[i]


class KVSlotManager:
    def __init__(self, n_slots: int, n_layers: int = 0, n_heads: int = 0, head_dim: int = 0,
                 device="cpu", dtype=torch.float32, pool: KVPool | None = None):
        """Slots of ``pool``; or, without one, of a pool ``[n_layers, n_slots, n_heads, head_dim]``
        allocated here; ``n_layers == 0`` keeps only the accounting (the simulator)."""
        if pool is None and n_layers:
            pool = KVPool(n_slots, n_layers, n_heads, head_dim, device, dtype)
        if pool is not None and pool.n_slots != n_slots:
            raise ValueError(f"n_slots={n_slots} does not match the K/V pool's {pool.n_slots} slots")
        self.n_slots = n_slots
        self._spans: list[list[int]] = [[0, n_slots]]   # free runs [start, end), sorted, never adjacent
        self._runs: dict[int, list[tuple[int, int]]] = {}  # rid -> the runs it holds
        self._holders: dict[int, object] = {}           # rid -> Request holding a reservation
        self.n_reserved = 0                              # Algorithm 1's n_rsrv
        self.n_used = 0                                  # slots holding real K/V, kept by ``cache``
        self.pool = pool
        self.device = pool.device if pool is not None else torch.device(device)
        self.k, self.v = (pool.k, pool.v) if pool is not None else (None, None)

    def can_reserve(self, n: int) -> bool:
        return self.n_reserved + n <= self.n_slots

    def reserve(self, req, n: int):
        """Give ``req`` ``n`` slots (``req.slots``); the caller checked ``can_reserve``.

        The slots are one contiguous run of the pool whenever a free run is long enough (first
        fit, lowest ids first): attention then reads a request's K/V in place, without a gather.
        Otherwise the lowest free runs are chained; slots need not be contiguous.
        """
        if req.rid in self._holders:
            raise RuntimeError(f"request {req.rid} already holds a K/V reservation")
        if not self.can_reserve(n):
            raise RuntimeError(f"cannot reserve {n} slots: {self.n_slots - self.n_reserved} left")
        runs = self.take(n)
        req.slots = _slot_ids(runs, self.k is not None)
        self._runs[req.rid] = runs
        self._holders[req.rid] = req
        self.n_reserved += n
        self.n_used += _held(req.n_cached, len(req.slots))

    def release(self, req):
        """Free every slot of a finished request: the scheduler said it is done."""
        del self._holders[req.rid]
        self.n_used -= _held(req.n_cached, len(req.slots))
        for a, b in self._runs.pop(req.rid):
            self.give(a, b)
            self.n_reserved -= b - a
        req.slots = None

    def cache(self, req, n_cached: int):
        """``req`` now holds the K/V of its first ``n_cached`` tokens (the scheduler says so when its
        iteration returns): ``n_used`` follows without a sum over the holders."""
        if req.slots is not None:
            self.n_used += _held(n_cached, len(req.slots)) - _held(req.n_cached, len(req.slots))
        req.n_cached = n_cached

    def take(self, n: int) -> list[tuple[int, int]]:
        """``n`` free slots as runs ``[a, b)``, chosen as ``reserve`` says: every slot a manager hands out
        comes from here and goes back through ``give`` (a learner's allocator plugs in there, notebook 11)."""
        for i, (a, b) in enumerate(self._spans):
            if b - a >= n:
                self._shrink(i, n)
                return [(a, a + n)]
        runs = []
        while n:
            a, b = self._spans[0]
            got = min(n, b - a)
            runs.append((a, a + got))
            self._shrink(0, got)
            n -= got
        return runs

    def _shrink(self, i: int, n: int):
        """Hand out the first ``n`` slots of free run ``i``."""
        if self._spans[i][1] - self._spans[i][0] == n:
            del self._spans[i]
        else:
            self._spans[i][0] += n

    def give(self, a: int, b: int):
        """Put run ``[a, b)`` back, merged with the free runs it touches."""
        i = bisect.bisect_left(self._spans, [a, b])
        if i < len(self._spans) and self._spans[i][0] == b:     # touches the next free run
            b = self._spans.pop(i)[1]
        if i > 0 and self._spans[i - 1][1] == a:                # touches the previous one
            self._spans[i - 1][1] = b
        else:
            self._spans.insert(i, [a, b])

    def layer(self, i: int):
        """One layer's ``(k_pool, v_pool)``, each ``[n_slots, n_heads, head_dim]``."""
        return self.pool.layer(i)

    def stats(self) -> KVStats:
        """Counted from the holders (the reference ``n_used`` is checked against in the tests)."""
        used = sum(_held(r.n_cached, len(r.slots)) for r in self._holders.values())
        return KVStats(used=used, reserved_unused=self.n_reserved - used,
                       free=self.n_slots - self.n_reserved)

    @property
    def n_holders(self) -> int:
        return len(self._holders)


def _held(n_cached: int, n_slots: int) -> int:
    """Slots of a request that hold real K/V: its cached tokens, within the slots it holds."""
    return min(n_cached, n_slots)


def _slot_ids(runs, on_host_tensor: bool):
    """Slot ids of ``runs``: a CPU tensor where a pool is read (each iteration's metadata is built on
    the host and copied to the device once), a list for the accounting alone (the simulator)."""
    if not on_host_tensor:
        return [i for a, b in runs for i in range(a, b)]
    return torch.cat([torch.arange(a, b) for a, b in runs])

