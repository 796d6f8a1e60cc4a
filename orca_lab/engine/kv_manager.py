"""The Attention K/V manager (ORCA §4.2): a pre-allocated pool of token slots, reserved per request.

A request reserves all the slots it may ever need when it is first scheduled (Algorithm 1 reserves
``max_tokens``), so a running request can never run out of K/V memory: no preemption, no deadlock.
The pool holds one K and one V row per slot and layer; slots of a request need not be contiguous.
"""
from __future__ import annotations

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


class KVSlotManager:
    def __init__(self, n_slots: int, n_layers: int = 0, n_heads: int = 0, head_dim: int = 0,
                 device="cpu", dtype=torch.float32):
        """``n_layers == 0`` keeps only the accounting (the simulator); else K and V pools
        ``[n_layers, n_slots, n_heads, head_dim]`` are allocated once, here."""
        self.n_slots = n_slots
        self._free = list(range(n_slots - 1, -1, -1))   # a stack: the lowest ids are handed out first
        self._holders: dict[int, object] = {}           # rid -> Request holding a reservation
        self.n_reserved = 0                              # Algorithm 1's n_rsrv
        self.device = torch.device(device)
        self.k = self.v = None
        if n_layers:
            shape = (n_layers, n_slots, n_heads, head_dim)
            self.k = torch.empty(shape, device=device, dtype=dtype)
            self.v = torch.empty(shape, device=device, dtype=dtype)

    def can_reserve(self, n: int) -> bool:
        return self.n_reserved + n <= self.n_slots

    def reserve(self, req, n: int):
        """Give ``req`` ``n`` slots (``req.slots``); the caller checked ``can_reserve``."""
        if req.rid in self._holders:
            raise RuntimeError(f"request {req.rid} already holds a K/V reservation")
        if not self.can_reserve(n):
            raise RuntimeError(f"cannot reserve {n} slots: {self.n_slots - self.n_reserved} left")
        ids = self._free[-n:]
        del self._free[-n:]
        ids.reverse()
        req.slots = torch.tensor(ids, dtype=torch.int64, device=self.device) if self.k is not None else ids
        self._holders[req.rid] = req
        self.n_reserved += n

    def release(self, req):
        """Free every slot of a finished request: the scheduler said it is done."""
        held = self._holders.pop(req.rid)
        ids = held.slots.tolist() if torch.is_tensor(held.slots) else held.slots
        self._free.extend(reversed(ids))
        self.n_reserved -= len(ids)
        req.slots = None

    def layer(self, i: int):
        """One layer's ``(k_pool, v_pool)``, each ``[n_slots, n_heads, head_dim]``."""
        return self.k[i], self.v[i]

    def stats(self) -> KVStats:
        used = sum(min(r.n_cached, len(r.slots)) for r in self._holders.values())
        return KVStats(used=used, reserved_unused=self.n_reserved - used,
                       free=self.n_slots - self.n_reserved)

    @property
    def n_holders(self) -> int:
        return len(self._holders)
