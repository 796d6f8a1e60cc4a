"""Prefix caching on the paged K/V manager (vLLM's automatic prefix caching; SGLang's RadixAttention
keeps the same K/V in a radix tree instead of a hash table).

A full block of a request's context is named by a digest chained from its parent's: SHA-256 of its
parent's name and its own token ids (``block_hash``), so one name stands for the whole prefix up to
the block's end (vLLM's scheme since CVE-2025-25183, which replaced Python's 64-bit ``hash``: a
crafted prompt could collide with another's name and be served K/V computed from other tokens). A
name is only where to look: a block is found under it when what it was registered with, its
parent's name and its own tokens, equals the request's (``lookup``). So a collision of names, even
one forced on a cheap digest, never serves a block whose tokens differ from the request's; that no
two different earlier prefixes share a parent's name rests on SHA-256, as in vLLM. Once an iteration
has written a full block's K/V and drawn a token from it, the block is registered under that name. A
new request starts with the longest run of its context's full blocks that are registered: it holds
them by reference count and prefills only the rest, always its last token at least (that token's
logits give its first output token).

A prompt's blocks wait for its first token (vLLM registers a block as soon as it is written): the
chunks before it draw none, and a chunk's K/V may hold a later position's NaN (masked attention
still weighs a hidden value by 0, and 0 x NaN is NaN), which only the row that samples shows. That
row reads every earlier position, so a finite token vouches for all of them; a failed row's K/V is
never offered (``Scheduler.on_batch_return``), and one request's fault is not handed to the next
request that shares its prefix.

A block whose count drops to 0 stays cached while free: it counts as free (admission and growth may
take it), and is evicted, least recently freed first, only when no never-used block is left. When a
request leaves, its blocks are freed from its last to its first, so a prefix's tail is evicted before
its head (vLLM's order): what many requests share outlives what one did alone. The counts are
``BlockRefs``', the order of the free cached blocks ``FreeCached``'s (notebook 12 has the learner
write both).

Accounting: ``n_reserved`` counts the slots of blocks some request holds (each block once, however
many share it), ``n_used`` the slots of those blocks that hold real K/V; a cached free block is in
neither, and ``n_free_blocks`` counts it as free.
"""
from __future__ import annotations

import copy
import hashlib
import struct
from collections import OrderedDict

import torch

from orca_lab.engine.blocks import BlockManager
from orca_lab.engine.kv_manager import KVStats


ROOT = bytes(32)        # the first block's parent's name


def block_hash(parent: bytes | None, tokens) -> bytes:
    """A full block's name: SHA-256 of its parent's name (None for the first block: ``ROOT``) and its
    token ids, 8 bytes each (fixed widths: one byte string for one (parent, tokens) pair)."""
    return hashlib.sha256((parent or ROOT) + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def chain_hashes(tokens, block_size: int, n_blocks: int, known: list[bytes] | None = None) -> list[bytes]:
    """The names of the first ``n_blocks`` full blocks of ``tokens``, extending ``known`` (the first
    few already computed: a request's hashes are computed once, as its context grows)."""
    hashes = list(known[:n_blocks]) if known else []
    for i in range(len(hashes), n_blocks):
        hashes.append(block_hash(hashes[-1] if hashes else None, tokens[i * block_size:(i + 1) * block_size]))
    return hashes


class FreeCached:
    """The free cached blocks (count 0, still registered), least recently freed first: the pool
    evicts from the front when no never-used block is left."""

    def __init__(self):
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def freed(self, block: int):
        self.blocks[block] = None

    def used(self, block: int):
        del self.blocks[block]

    def evict(self) -> int:
        return self.blocks.popitem(last=False)[0]

    def __len__(self):
        return len(self.blocks)

    def __iter__(self):
        return iter(self.blocks)


class BlockRefs:
    """How many requests hold each block: a held block counts 1 or more; a free cached one 0, and it
    waits in ``lru``; any other block (never used, or evicted) has no count: it is in the pool."""

    def __init__(self, lru):
        self.lru = lru
        self.counts: dict[int, int] = {}

    def count(self, block: int) -> int:
        """The requests holding ``block``; 0: it is free (cached or not), admission may take it."""
        return self.counts.get(block, 0)

    def hold(self, block: int):
        """A request holds ``block``, new from the pool or found cached: a free cached one leaves the
        LRU (a held block is never evicted)."""
        if self.counts.get(block) == 0:
            self.lru.used(block)
        self.counts[block] = self.count(block) + 1

    def release(self, blocks: list[int], cached) -> list[int]:
        """A request lets go of its ``blocks``, last first (so a prefix's tail is evicted before its
        head, which more requests share): those no request holds any more, in that order. Those in
        ``cached`` (registered) wait in the LRU, the others are forgotten (back to the pool)."""
        freed = []
        for b in reversed(blocks):
            self.counts[b] -= 1
            if self.counts[b]:
                continue
            freed.append(b)
            if b in cached:
                self.lru.freed(b)
            else:
                del self.counts[b]
        return freed

    def evict(self) -> int:
        """The least recently freed cached block, forgotten: the pool reuses it."""
        b = self.lru.evict()
        del self.counts[b]
        return b


class PrefixCachingBlockManager(BlockManager):
    """``BlockManager`` whose full blocks outlive their requests, shared by reference count."""

    def __init__(self, n_slots: int, block_size: int = 16, *shape, **pool):
        super().__init__(n_slots, block_size, *shape, **pool)
        self.block_of: dict[bytes, int] = {}          # name -> the block registered under it
        self.hash_of: dict[int, bytes] = {}           # block -> its name, while registered
        self.key_of: dict[int, tuple] = {}            # block -> (parent's name, its tokens), while registered
        self.lru = FreeCached()                       # cached blocks no request holds, LRU first
        self.refs = BlockRefs(self.lru)               # block -> requests holding it
        self._blocks: dict[int, list[int]] = {}       # rid -> its block table
        self._pads: dict[int, list[int]] = {}         # rid -> blocks of a row outside the cache (reserve)
        self._offered: dict[int, int] = {}            # rid -> blocks of its table offered to the cache
        self.hit_tokens = 0                           # over first admissions: tokens found cached
        self.query_tokens = 0                         # over first admissions: prompt tokens looked up
        self.n_evictions = 0
        self.lent_on = False                          # its memory lent the cache to a newer engine

    def handed_on(self) -> "PrefixCachingBlockManager":
        """This cache for the next engine over its K/V memory (``KVMemory.lend_kv``): a manager with
        the same blocks and names, its counters at 0 (they are per engine). This one admits nothing
        more: the engine still holding it would take blocks the newer one holds."""
        kv = copy.copy(self)
        kv.hit_tokens = kv.query_tokens = kv.n_evictions = 0
        self.lent_on = True
        return kv

    # -- lookup and sharing ----------------------------------------------------------------------
    def lookup(self, req) -> list[int]:
        """The cached blocks that start ``req``'s context: its longest run of registered full blocks,
        short of its last token (always computed). None for a request asking for its prompt's
        logprobs: every prompt position must be computed to be scored (vLLM skips the cache for it too)."""
        if req.params.prompt_logprobs is not None:
            return []
        tokens = req.prompt + req.output
        n = (len(tokens) - 1) // self.block_size
        hashes = req.block_hashes = chain_hashes(tokens, self.block_size, n, req.block_hashes)
        found = []
        for i, h in enumerate(hashes[:n]):
            b = self.block_of.get(h)
            if b is None or self.key_of[b] != self._key(tokens, hashes, i):    # a collision: not ours
                break
            found.append(b)
        return found

    def _key(self, tokens, hashes, i: int) -> tuple:
        """What block ``i`` of ``tokens`` is named from: its parent's name and its own tokens."""
        bs = self.block_size
        return hashes[i - 1] if i else None, tuple(tokens[i * bs:(i + 1) * bs])

    def can_admit(self, n_tokens: int, hit: list[int] = ()) -> bool:
        """As ``BlockManager.can_admit`` for the ``n_tokens`` after the cached blocks ``hit``; those
        of them free now stop being free once shared."""
        spare = self.n_free_blocks - sum(not self.refs.count(b) for b in hit) \
            - (self.blocks_for(len(hit) * self.block_size + n_tokens) - len(hit))
        return spare >= (self.watermark_blocks if self.n_holders else 0)

    def share(self, req, hit: list[int], first: bool = True):
        """``req`` starts with the cached blocks ``hit``: their K/V are its first tokens' K/V.
        ``first``: its first admission (a preempted request's return is not counted as a query)."""
        if self.lent_on:
            raise RuntimeError("this engine's K/V memory, and the prefix cache over it, were lent to a newer "
                               "engine: create a new engine")
        if first:
            self.query_tokens += len(req.prompt)
            self.hit_tokens += len(hit) * self.block_size
            req.n_prefix_hit = len(hit) * self.block_size
        self._holders[req.rid] = req
        self._blocks[req.rid] = []
        self._offered[req.rid] = len(hit)
        if hit:
            for b in hit:
                self._hold(b)
            self._append(req, hit)
        req.n_cached = len(hit) * self.block_size     # K/V already written (``_hold`` counted it)

    def _hold(self, b: int):
        if not self.refs.count(b):           # cached and free: in use again
            self.n_reserved += self.block_size
            self.n_used += self.block_size
        self.refs.hold(b)

    # -- a row outside the cache: the CUDA graphs' padding (cuda_graphs.py) -------------------------
    def can_reserve(self, n: int) -> bool:
        return self.blocks_for(n) <= self.n_free_blocks

    def reserve(self, req, n: int):
        """``n`` slots for a row that is no request of the cache (the padding row of a replayed CUDA
        graph): whole blocks, possibly cached ones evicted, given back unregistered by ``release``."""
        blocks = self._take_blocks(self.blocks_for(n))
        self._pads[req.rid] = blocks
        self.n_reserved += len(blocks) * self.block_size
        slots = [s for b in blocks for s in range(b * self.block_size, (b + 1) * self.block_size)][:n]
        req.slots = slots if self.k is None else torch.tensor(slots, dtype=torch.int64)

    # -- growth, writes and release ---------------------------------------------------------------
    def grow(self, req, n_tokens: int):
        need = self.blocks_to_grow(req, n_tokens)
        if not need:
            return
        self._holders[req.rid] = req
        self._blocks.setdefault(req.rid, [])
        new = self._take_blocks(need)
        for b in new:
            self.refs.hold(b)
        self.n_reserved += need * self.block_size
        self._append(req, new)

    def _take_blocks(self, n: int) -> list[int]:
        """``n`` blocks: never-used ones first, then cached free ones, least recently freed first."""
        bs = self.block_size
        fresh = min(n, (self.n_slots - self.n_reserved) // bs - len(self.lru))
        blocks = [s // bs for a, b in (self.take(fresh * bs) if fresh else []) for s in range(a, b, bs)]
        while len(blocks) < n:
            b = self.refs.evict()
            del self.block_of[self.hash_of.pop(b)], self.key_of[b]
            self.n_evictions += 1
            blocks.append(b)
        return blocks

    def _append(self, req, blocks: list[int]):
        """Extend ``req``'s table (and its slot ids, the kernels' view of it) by ``blocks``."""
        bs, held = self.block_size, self.blocks_held(req) * self.block_size
        self._blocks[req.rid].extend(blocks)
        if self.k is None:
            new = [s for b in blocks for s in range(b * bs, (b + 1) * bs)]
            req.slots = (req.slots or []) + new       # a new object: the workers are sent it again
        else:
            new = (torch.tensor(blocks, dtype=torch.int64)[:, None] * bs + torch.arange(bs)).flatten()
            req.slots = self._extend(req, held, new)

    def cache(self, req, n_cached: int):
        """``req``'s first ``n_cached`` tokens now hold K/V. Where they are its whole context (its row
        draws a token from them, which vouches for them), its full blocks not yet offered are
        registered under their names (unless a block already is: an equal one stays the cached one,
        and a colliding one keeps the name); a prompt's earlier chunks wait for that row."""
        old = req.n_cached
        if req.slots is not None and n_cached > old:
            self.n_used += min(n_cached, len(req.slots)) - min(old, len(req.slots))
            table, bs = self._blocks[req.rid], self.block_size
            lo, hi = self._offered.get(req.rid, 0), min(n_cached // bs, len(table))
            if hi > lo and n_cached == req.context_len:
                self._offered[req.rid] = hi
                tokens = req.prompt + req.output
                hashes = req.block_hashes = chain_hashes(tokens, bs, hi, req.block_hashes)
                for i in range(lo, hi):
                    h, b = hashes[i], table[i]
                    if h not in self.block_of and b not in self.hash_of:
                        self.block_of[h], self.hash_of[b] = b, h
                        self.key_of[b] = self._key(tokens, hashes, i)
        req.n_cached = n_cached

    def release(self, req):
        """Free ``req``'s blocks, last first: a registered one stays cached (in the LRU), the others go
        back to the pool."""
        bs = self.block_size
        pad = self._pads.pop(req.rid, None)
        if pad is not None:                  # a padding row: its blocks go back to the pool
            for b in pad:
                self.give(b * bs, (b + 1) * bs)
            self.n_reserved -= len(pad) * bs
            req.slots = None
            return
        del self._holders[req.rid]
        self._offered.pop(req.rid, None)
        table = self._blocks.pop(req.rid)
        index = {b: i for i, b in enumerate(table)}
        for b in self.refs.release(table, self.hash_of):
            self.n_reserved -= bs
            self.n_used -= min(max(req.n_cached - index[b] * bs, 0), bs)
            if b not in self.hash_of:
                self.give(b * bs, (b + 1) * bs)
        self._tables.pop(req.rid, None)
        req.slots = None

    def block_table(self, req) -> list[int]:
        return list(self._blocks.get(req.rid, []))

    def held_blocks(self) -> set[int]:
        """Every block some request's table holds: what no eviction may hand to another."""
        return {b for table in self._blocks.values() for b in table}

    # -- statistics ------------------------------------------------------------------------------
    @property
    def n_cached_blocks(self) -> int:
        """Blocks registered under a name, held or free."""
        return len(self.hash_of)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def stats(self):
        """Counted from the holders' tables, each block once (the reference for ``n_used``)."""
        filled: dict[int, int] = {}
        for rid, req in self._holders.items():
            for i, b in enumerate(self._blocks[rid]):
                filled[b] = max(filled.get(b, 0), min(max(req.n_cached - i * self.block_size, 0), self.block_size))
        used = sum(filled.values())
        return KVStats(used=used, reserved_unused=self.n_reserved - used, free=self.n_slots - self.n_reserved)
