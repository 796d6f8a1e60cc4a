"""What one iteration needs, built once and read by every layer (no per-layer rebuilding).

ORCA's selective batching flattens the new tokens of all requests into ``[sum L]``: a request in its
initiation phase brings its whole prompt, one in its increment phase its last token. The baseline's
batch is padded instead: every request brings the same number of tokens at the same positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    requests: list            # Request objects, in batch order
    starts: list[int]         # position of each request's first new token (= tokens already cached)
    q_lens: list[int]         # new tokens of each request this iteration
    padded: bool = False      # FasterTransformer-style: equal starts and q_lens, [B, L, H] shape
    iteration: int = -1
    tokens: list[list[int]] = field(default_factory=list)  # the new token ids of each request
    phases: list[str] = field(default_factory=list)        # prefill / decode / held, at build time
    at_submit: tuple = ()     # (batches in flight, n_rsrv, slots used) when the engine submitted it

    def __post_init__(self):
        if not self.phases:
            self.phases = [phase(r, s, q) for r, s, q in zip(self.requests, self.starts, self.q_lens)]

    @classmethod
    def selective(cls, requests) -> "Batch":
        """ORCA: each request brings whatever it has not run yet (prompt, or last token)."""
        tokens = [r.pending_tokens() for r in requests]
        return cls(list(requests), [r.n_cached for r in requests], [len(t) for t in tokens],
                   tokens=tokens)

    @classmethod
    def padded_step(cls, requests, start: int, q_len: int, pad_id: int = 0) -> "Batch":
        """FasterTransformer: every request runs positions [start, start + q_len), finished or not."""
        tokens = []
        for r in requests:
            seq = (r.prompt + r.output)[start:start + q_len]
            tokens.append(seq + [pad_id] * (q_len - len(seq)))   # held finished requests compute padding
        n = len(requests)
        return cls(list(requests), [start] * n, [q_len] * n, padded=True, tokens=tokens)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def n_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def kv_lens(self) -> list[int]:
        return [s + q for s, q in zip(self.starts, self.q_lens)]

    def tensors(self, device) -> "BatchTensors":
        return BatchTensors.build(self, device)


def phase(req, start: int, q_len: int) -> str:
    if req.finished:
        return "held"      # a finished request still computed by the request-level baseline
    if start == 0 or start + q_len <= len(req.prompt):
        return "prefill"
    return "decode"


@dataclass
class BatchTensors:
    """Flat metadata of one iteration on the model's device."""
    input_ids: torch.Tensor     # [T] (padded: [B, L])
    positions: torch.Tensor     # [T] (padded: [L])
    slot_mapping: torch.Tensor  # [T]: slot of each new token's K/V
    kv_slot_ids: torch.Tensor   # [sum kv_len] (padded: [B, kv_len]): slots of each request's context
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    cu_seqlens_k: torch.Tensor  # [B+1] int32
    last_idx: torch.Tensor      # [B]: row of each request's last new token in [T]
    padded: bool

    @classmethod
    def build(cls, batch: Batch, device) -> "BatchTensors":
        q_lens = torch.tensor(batch.q_lens, dtype=torch.int64)
        kv_lens = torch.tensor(batch.kv_lens, dtype=torch.int64)
        cu_q = torch.zeros(len(batch) + 1, dtype=torch.int64)
        cu_q[1:] = q_lens.cumsum(0)
        cu_k = torch.zeros_like(cu_q)
        cu_k[1:] = kv_lens.cumsum(0)
        starts = torch.tensor(batch.starts, dtype=torch.int64)
        # position of every new token: its request's start plus its offset inside the request
        offsets = torch.arange(int(cu_q[-1])) - torch.repeat_interleave(cu_q[:-1], q_lens)
        positions = torch.repeat_interleave(starts, q_lens) + offsets
        ids = torch.tensor([t for seq in batch.tokens for t in seq], dtype=torch.int64)
        slots = [r.slots for r in batch.requests]
        slot_mapping = torch.cat([s[st:st + q] for s, st, q in zip(slots, batch.starts, batch.q_lens)])
        kv_slots = [s[:k] for s, k in zip(slots, batch.kv_lens)]
        if batch.padded:
            B, L = len(batch), batch.q_lens[0]
            ids, positions = ids.view(B, L), positions[:L]
            kv_slot_ids = torch.stack(kv_slots)
        else:
            kv_slot_ids = torch.cat(kv_slots)
        to = dict(device=device, non_blocking=True)
        return cls(ids.to(**to), positions.to(**to), slot_mapping.to(**to), kv_slot_ids.to(**to),
                   cu_q.to(device, torch.int32), cu_k.to(device, torch.int32),
                   (cu_q[1:] - 1).to(**to), batch.padded)
