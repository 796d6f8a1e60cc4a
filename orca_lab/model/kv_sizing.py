"""How many K/V slots a rank can hold: its weights and its bytes per slot for the model and the
degrees of parallelism, against the memory its device has free (``EngineConfig(n_slots=None)``)."""
from __future__ import annotations

import math

import torch


def gpu_memory(device) -> tuple[int, int]:
    """``(free, total)`` bytes of a CUDA device: the one place that asks (tests replace it)."""
    return torch.cuda.mem_get_info(torch.device(device))


def host_memory() -> int | None:
    """Bytes the host can still give without swapping (Linux's MemAvailable), or None where that is
    not known: the one place that asks (tests replace it)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rank_shares(cfg, tp: int, stages: list[tuple[int, int]], dtype_bytes: int) -> list[tuple[int, int]]:
    """Per pipeline stage, what each of its ranks holds: ``(weight bytes, bytes per K/V slot)``.
    Matrices split over ``tp`` ranks (K/V heads replicated past their number); norms, biases and
    positions replicated (a slight over-count of the split biases); the token embedding
    (vocabulary-split) on the first stage, and on the last the LM head (the embedding's rows, when tied)."""
    d, D, vocab_rows = cfg.d_model, cfg.head_dim, -(-cfg.vocab_size // tp)
    kv = cfg.kv_heads_on(tp)
    if cfg.family == "gpt2":
        layer, positions = 12 * d * d // tp + 13 * d, cfg.max_seq_len * d
    else:
        qkv = (cfg.n_heads // tp + 2 * kv) * D
        layer, positions = d * qkv + qkv + d * cfg.n_heads // tp * D + 3 * d * (cfg.d_ff // tp) + 2 * d, 0
    shares = []
    for s, (lo, hi) in enumerate(stages):
        first, last = s == 0, s == len(stages) - 1
        embeddings = (first or last) * vocab_rows * d if cfg.tie_embeddings else (first + last) * vocab_rows * d
        params = (hi - lo) * layer + embeddings + first * positions + last * 2 * d
        shares.append((params * dtype_bytes, 2 * (hi - lo) * kv * D * dtype_bytes))
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


def check_host_fits(what: str, shares, n_slots: int, ranks_per_stage: int = 1):
    """A model on the CPU, every rank on this host (``ranks_per_stage`` of each stage's ``shares``) with
    ``n_slots`` K/V slots each, against the memory the host has available: a ValueError with bytes
    needed against bytes available, before anything is allocated (a 175B model otherwise grows until
    the kernel's OOM killer stops it, or the host swaps)."""
    available = host_memory()
    need = ranks_per_stage * sum(w + s * n_slots for w, s in shares)
    if available is not None and need > available:
        raise ValueError(f"{what} does not fit in this host's memory: it needs {need:,} bytes of weights and "
                         f"K/V (n_slots={n_slots}) but {available:,} bytes are available")
