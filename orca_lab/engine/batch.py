"""What one iteration needs, built once and read by every layer (no per-layer rebuilding).

ORCA's selective batching flattens the new tokens of all requests into ``[sum L]``: a request in its
initiation phase brings its whole prompt, one in its increment phase its last token. The baseline's
batch is padded instead: every request brings the same number of tokens at the same positions.

Both are laid out flat for the model. A padded batch, ``B`` requests x ``L`` tokens at equal
positions, is a flat batch in which every request brings ``L`` rows; held (finished) requests are
rows like the others, computed and dropped (their token is padding, and is not sampled), which is
exactly the padding FasterTransformer computes. So both systems run the same kernels, and the
baseline's one-token steps the same decode graphs as ORCA's decodes (``model/cuda_graphs.py``): the
paper compares schedules on equal kernels (§6), and FasterTransformer's own decoder runs a fixed shape.
What stays FT's is the schedule (``scheduler.py``: a batch held whole, tokens delivered at its end) and
its cost (``Batch.padded``, which the simulator's cost models read).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch


@dataclass
class Batch:
    requests: list            # Request objects, in batch order
    starts: list[int]         # position of each request's first new token (= tokens already cached)
    q_lens: list[int]         # new tokens of each request this iteration
    padded: bool = False      # FasterTransformer-style: equal starts and q_lens (run flat, as any batch)
    iteration: int = -1
    tokens: list[list[int]] = field(default_factory=list)  # the new token ids of each request
    phases: list[str] = field(default_factory=list)        # prefill / decode / held, at build time
    yields: list[bool] = field(default_factory=list)       # whether each request gets a token, at build time
    at_submit: tuple = ()     # (batches in flight, n_rsrv, slots used) when the engine submitted it

    def __post_init__(self):
        if not self.phases:
            self.phases = [phase(r, s, q) for r, s, q in zip(self.requests, self.starts, self.q_lens)]
        if not self.yields:
            self.yields = [yields_token(r, s, q) for r, s, q in zip(self.requests, self.starts, self.q_lens)]

    @classmethod
    def selective(cls, requests, q_lens=None) -> "Batch":
        """ORCA: each request brings whatever it has not run yet (prompt, or last token); with
        ``q_lens``, only the first ``q_lens[i]`` of those (a prefill chunk, ``policies.py``)."""
        tokens = [r.pending_tokens() for r in requests]
        if q_lens is not None:
            tokens = [t[:q] for t, q in zip(tokens, q_lens)]
        return cls(list(requests), [r.n_cached for r in requests], [len(t) for t in tokens],
                   tokens=tokens)

    @classmethod
    def padded_step(cls, requests, start: int, q_len: int, pad_id: int = 0) -> "Batch":
        """FasterTransformer: every request runs positions [start, start + q_len), finished or not."""
        tokens, end = [], start + q_len
        for r in requests:      # positions [start, end) of prompt + output, without copying either
            n = len(r.prompt)
            seq = r.prompt[start:end] + r.output[max(0, start - n):max(0, end - n)]
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
    if q_len == 1 and start == req.context_len - 1 >= len(req.prompt):
        return "decode"   # its last generated token, on top of the K/V of all the others
    return "prefill"      # a prompt, a chunk of one, or a preempted request's recomputation


def yields_token(req, start: int, q_len: int) -> bool:
    """Whether the iteration gives ``req`` its next token: it runs to the end of the context. A
    prefill chunk short of that end, a prompt the padded baseline still feeds one token at a time,
    and a finished request held in its batch get none, and are not sampled (``sampler.py``)."""
    return not req.finished and start + q_len >= req.context_len


@dataclass
class BatchTensors:
    """Flat metadata of one iteration on the model's device, and its host copies (a padded batch's
    too: see the module's docstring).

    The host copies (numpy) are what the attention plans are built from, once per iteration: the
    layers then read nothing back from the device. Slot ids are host data from the start (the K/V
    manager hands them out on the host), so building them costs no device synchronization.
    """
    input_ids: torch.Tensor     # [T]
    positions: torch.Tensor     # [T]
    slot_mapping: torch.Tensor  # [T]: slot of each new token's K/V
    kv_slot_ids: torch.Tensor   # [sum kv_len]: slots of each request's context
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    cu_seqlens_k: torch.Tensor  # [B+1] int32
    last_idx: torch.Tensor      # [B]: row of each request's last new token in [T]
    cu_q_host: np.ndarray = field(default=None, repr=False, compare=False)      # [B+1] int64
    cu_k_host: np.ndarray = field(default=None, repr=False, compare=False)      # [B+1] int64
    slots_host: np.ndarray = field(default=None, repr=False, compare=False)     # slot_mapping, kv_slot_ids
    attn_plan: object = field(default=None, repr=False, compare=False)  # set by the model, per iteration

    @classmethod
    def build(cls, batch: Batch, device) -> "BatchTensors":
        """Index arithmetic on the host in numpy (microseconds, where a torch op costs several): one
        gather from all the batch's reserved slots laid back to back, then one copy per tensor."""
        q_lens, starts = np.array(batch.q_lens), np.array(batch.starts)
        kv_lens = starts + q_lens
        cu_q, cu_k = _offsets(q_lens), _offsets(kv_lens)
        slots = [r.slots for r in batch.requests]
        first = _offsets([s.shape[0] for s in slots])[:-1]        # each request's first row in `reserved`
        # token j of request b sits at position starts[b] + j, in row first[b] + starts[b] + j
        positions = _ramp(starts - cu_q[:-1], q_lens)
        new_rows = _ramp(first + starts - cu_q[:-1], q_lens)
        kv_rows = _ramp(first - cu_k[:-1], kv_lens)
        reserved = torch.cat(slots)         # host tensors: the K/V managers keep slot ids there
        slots_host = reserved.numpy()[np.concatenate([new_rows, kv_rows])]
        slot_mapping, kv_slot_ids = torch.from_numpy(slots_host).split([len(new_rows), len(kv_rows)])
        ids = torch.tensor(list(chain.from_iterable(batch.tokens)), dtype=torch.int64)
        positions = torch.from_numpy(positions)
        cu = torch.from_numpy(np.stack([cu_q, cu_k]).astype(np.int32)).to(device)
        to = dict(device=device, non_blocking=True)
        return cls(ids.to(**to), positions.to(**to), slot_mapping.to(**to), kv_slot_ids.to(**to),
                   cu[0], cu[1], torch.from_numpy(cu_q[1:] - 1).to(**to), cu_q, cu_k, slots_host)

    def check_slots(self, n_slots: int):
        """Every slot id in ``[0, n_slots)``, checked on the host copy (an out-of-range slot would
        read or write foreign memory). The model calls it once per iteration, where slots enter."""
        if self.slots_host is not None and self.slots_host.size:
            lo, hi = int(self.slots_host.min()), int(self.slots_host.max())
            if lo < 0 or hi >= n_slots:
                raise ValueError(f"slot ids hold values in [{lo}, {hi}], allowed [0, n_slots={n_slots})")


def _offsets(lens) -> np.ndarray:
    """``[0, l0, l0 + l1, ...]``: where each request's rows start, and the total."""
    out = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def _ramp(base: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``base[b] + i`` for the i-th of all ``sum(lens)`` rows, where row i belongs to request b."""
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(base, lens)
