"""Decode-only iterations replayed from CUDA graphs: the launch overhead of small batches, removed.

A decode iteration runs a dozen small kernels per layer; on a GPU, launching them from Python can
take longer than running them. A CUDA graph records one iteration's launches once and replays them
with one call. A graph's shapes are fixed, so batches are padded up to a few sizes (1, 2, 4, then
multiples of 8, as vLLM does), and its inputs live in static buffers that each iteration refills.

Padding rows are one-token requests at position 0 whose only K/V slot is reserved from the K/V
manager for the iteration (only when there are any: a batch of a graph size needs no slot, so it
runs even on a pool its requests' reservations fill, as FT's can): they write and read that slot
alone, and their logits are dropped. The
decode kernel's grid is fixed per graph by ``max_seq_len`` (splits past a context stay empty).
Everything except capture and replay also runs eagerly (``capture=False``), on CPU too, so the padding
and the static buffers are tested without a GPU.

Both systems' one-token steps take them: ORCA's decode iterations, and every step of the
FasterTransformer-style baseline after its first (``B`` requests x 1 token, laid flat like any batch:
``engine/batch.py``), its held requests' rows included.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from orca_lab.engine.batch import Batch, BatchTensors
from orca_lab.kernels._backend import use_triton
from orca_lab.kernels.attention import triton_plan

BUCKETS = (1, 2, 4) + tuple(range(8, 8193, 8))


def padded_size(n: int) -> int:
    """The smallest graph batch size that holds ``n`` requests."""
    return BUCKETS[bisect.bisect_left(BUCKETS, n)]


@dataclass(eq=False)
class PadRequest:
    """What a padding row needs from a request: an id and one reserved slot."""
    rid: int = -1
    slots: torch.Tensor | None = None
    n_cached: int = 0


def decode_graphs_for(model, kv, engine_config) -> "DecodeGraphs | None":
    """CUDA graphs where they run: asked for, on a GPU, one stage in this process, Triton attention
    (the PyTorch path plans per request on the host, which a replay could not follow)."""
    ec = engine_config
    on_gpu = ec.device.startswith("cuda") and kv.k is not None and kv.k.is_cuda
    if not (ec.cuda_graphs and on_gpu and ec.n_workers == 1
            and use_triton(ec.attention_backend, kv.k)):
        return None
    return DecodeGraphs(model, kv, ec.max_bs, capture=True)


class DecodeGraphs:
    def __init__(self, model, kv, max_bs: int, capture: bool):
        # ``kv``: the K/V manager the padding slots are reserved from. An LLM keeps its graphs with
        # its pool and hands each new engine's manager over (``graphs.kv = ...``): same memory.
        self.model, self.kv, self.capture = model, kv, capture
        self.max_size = padded_size(max_bs)
        self.max_kv = model.cfg.max_seq_len
        S, dev = self.max_size, kv.k.device
        zeros = lambda n, dtype=torch.int64: torch.zeros(n, dtype=dtype, device=dev)
        # static buffers of the largest graph; a smaller graph reads their first rows
        self.ids, self.positions, self.slot_mapping = zeros(S), zeros(S), zeros(S)
        self.kv_slot_ids, self.cu_k = zeros(S * self.max_kv), zeros(S + 1, torch.int32)
        self.cu_q = torch.arange(S + 1, dtype=torch.int32, device=dev)
        self.last_idx = torch.arange(S, dtype=torch.int64, device=dev)
        self.graphs: dict[int, tuple] = {}     # size -> (CUDAGraph, its output logits)
        self.plans: dict[int, object] = {}     # size -> the decode plan its graph replays
        self.pool = None                       # one memory pool shared by all graphs

    def takes(self, batch: Batch) -> bool:
        """One new token each (ORCA's decodes; FT's padded steps too, held rows and all) and not
        larger than the largest graph."""
        return len(batch) <= self.max_size and all(q == 1 for q in batch.q_lens)

    def run(self, batch: Batch) -> torch.Tensor | None:
        """The logits of ``batch`` (``[B, vocab]``) through a padded graph, or None when no slot is
        free for the padding rows (the caller then runs the batch as it is)."""
        n, size = len(batch), padded_size(len(batch))
        extra, pad = size - n, PadRequest()
        if extra:
            if not self.kv.can_reserve(1):
                return None
            self.kv.reserve(pad, 1)
        try:
            padded = Batch(batch.requests + [pad] * extra, batch.starts + [0] * extra, [1] * size,
                           iteration=batch.iteration, tokens=batch.tokens + [[0]] * extra,
                           phases=batch.phases + ["pad"] * extra, yields=batch.yields + [False] * extra)
            return self._forward(self._fill(padded.tensors(self.kv.k.device), size), size)[:n]
        finally:
            if extra:
                self.kv.release(pad)

    def _fill(self, bt: BatchTensors, size: int) -> BatchTensors:
        """Copy one iteration's metadata into the static buffers; the view the graphs read."""
        bt.check_slots(self.kv.n_slots)
        for static, new in ((self.ids, bt.input_ids), (self.positions, bt.positions),
                            (self.slot_mapping, bt.slot_mapping), (self.kv_slot_ids, bt.kv_slot_ids),
                            (self.cu_k, bt.cu_seqlens_k)):
            static[:new.numel()].copy_(new)
        return BatchTensors(self.ids[:size], self.positions[:size], self.slot_mapping[:size],
                            self.kv_slot_ids, self.cu_q[:size + 1], self.cu_k[:size + 1],
                            self.last_idx[:size], bt.cu_q_host, bt.cu_k_host, bt.slots_host)

    def _forward(self, static: BatchTensors, size: int) -> torch.Tensor:
        if not self.capture:
            return self.model(static, self.kv)          # eager: the plan comes from this iteration
        if size not in self.plans:                      # one grid for every context up to max_seq_len
            self.plans[size] = triton_plan(np.arange(size + 1), np.zeros(size + 1), static.cu_seqlens_q.device,
                                           max_kv=self.max_kv)
        static.attn_plan = self.plans[size]
        if size not in self.graphs:
            # first time: run eagerly (compiles and tunes the kernels outside the capture), then record
            logits = self.model(static, self.kv).clone()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model(static, self.kv)
            self.pool = graph.pool()
            self.graphs[size] = (graph, out)
            return logits
        graph, out = self.graphs[size]
        graph.replay()
        return out
