"""How many K/V slots a rank can hold: its weights and its bytes per slot for the model and the
degrees of parallelism, against the memory its device has free (``EngineConfig(n_slots=None)``)."""
from __future__ import annotations

import math

import torch


def gpu_memory(device) -> tuple[int, int]:
    """``(free, total)`` bytes of a CUDA device: the one place that asks (tests replace it)."""
    return torch.cuda.mem_get_info(torch.device(device))


def rank_shares(cfg, tp: int, stages: list[tuple[int, int]], dtype_bytes: int) -> list[tuple[int, int]]:
    """Per pipeline stage, what each of its ranks holds: ``(weight bytes, bytes per K/V slot)``.
    Matrices split over ``tp`` ranks; LayerNorms, biases and positions replicated (a slight over-count
    of the split biases); the token embedding (vocabulary-split) on the first and last stages."""
    d, vocab_rows = cfg.d_model, -(-cfg.vocab_size // tp)
    layer = 12 * d * d // tp + 13 * d
    shares = []
    for s, (lo, hi) in enumerate(stages):
        first, last = s == 0, s == len(stages) - 1
        params = (hi - lo) * layer + (first or last) * vocab_rows * d + first * cfg.max_seq_len * d + last * 2 * d
        shares.append((params * dtype_bytes, 2 * (hi - lo) * d // tp * dtype_bytes))
    return shares


def size_kv_pool(what: str, shares, n_slots: int | None, min_slots: int, device, utilization: float) -> int:
    """``n_slots``, or (None) as many slots as the GPU's free memory holds beside the weights, for the
    rank that holds the most; a ValueError with bytes needed against bytes available, before anything
    is allocated, when the weights and ``n_slots`` (or ``min_slots``) do not fit."""
    free, total = gpu_memory(device)
    budget = free - math.ceil((1.0 - utilization) * total)
    fits = min((budget - w) // s for w, s in shares)
    want = n_slots if n_slots is not None else min_slots
    if fits < want:
        w, s = max(shares, key=lambda ws: ws[0] + ws[1] * want)
        raise ValueError(
            f"{what} does not fit on {device}: it needs {w + s * want:,} bytes ({w:,} of weights + "
            f"{s * want:,} of K/V for n_slots={want}) but {max(budget, 0):,} bytes are available "
            f"({free:,} free, less {1.0 - utilization:.0%} of {total:,} kept back by "
            f"gpu_memory_utilization={utilization})")
    return want if n_slots is not None else fits

