"""Ragged attention over the K/V slot pool: every request of one iteration in one launch (ORCA §3).

Selective batching flattens the new tokens of all requests into ``q [T, H, D]``; only attention must
be split per request, because each request attends over its own keys. ORCA concatenates the thread
blocks of the per-request kernels into one launch. Here that takes two Triton kernels, each reading
the keys it needs from the slot pool through ``slot_ids`` (slots need not be contiguous):

- the *ragged* kernel, for requests with several new tokens (prompts): a grid over (query block of
  some request, head), with a small host-built map from program id to (request, query block); each
  program runs FlashAttention's online softmax over its request's keys, block by block (fp16/bf16
  dots accumulating in fp32, the key blocks below the causal diagonal unmasked, those above never
  read, K/V prefetched into shared memory two blocks ahead). A fresh prompt (no earlier keys) reads
  its keys from the step's own ``k, v`` instead, contiguous, as a prefill kernel over a dense batch
  does, on an H100 or later through the Tensor Memory Accelerator (tensor descriptors: the copy
  engine computes the addresses); a chunk or a prefix-cache hit reads them through its slots;
- the *decode* kernel, for requests with one new token: decoding is bound by the bandwidth of
  reading the context, so each program reads its request's K/V once for a group of heads with no
  wasted query rows, and long contexts are split over keys (FlashDecoding) with a second small
  kernel merging the splits' softmax statistics.

Grouped-query attention (Llama's ``num_key_value_heads``): the pools hold ``n_kv_heads`` per slot, a
divisor of q's ``H``, and each K/V head serves ``group = H // n_kv_heads`` query heads. Both kernels
read a K/V head once for its whole group: the ragged kernel's query block holds (query, head) rows of
the group, so one K/V tile feeds them all through the same ``tl.dot``; the decode kernel's program
owns a K/V head and its group. ``n_kv_heads`` is read from the pools' shape, so the multi-head path
(GPT's) calls what it called before, and ``group = 1`` compiles to its old code.

What the launches need from the host (offsets, the work map, which requests decode, the longest
context) is worked out once per iteration from host arrays (``triton_plan``) and read by every layer,
so no layer reads anything back from the device. Launch configurations are chosen per shape bucket
(``_tuning``) from a list per GPU generation (``PREFILL_TABLE``): timed once on a GPU, small and
fixed in the interpreter.
"""
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import product

import numpy as np
import torch
import torch.nn.functional as F

from orca_lab.kernels._backend import (FLOAT_DTYPES, INDEX_DTYPES, cast_rne, check_indices,
                                       check_same, check_tensor, next_pow2, use_triton)
from orca_lab.kernels._tuning import LaunchTuner, bucket

import triton  # noqa: E402  (after _backend, which sets TRITON_INTERPRET on CPU-only machines)
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

MAX_HEAD_SIZE = 256


# --------------------------------------------------------------------------------------- kernel
@triton.jit
def _ragged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, slot_ptr, cu_q_ptr, cu_k_ptr, work_req_ptr, work_blk_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    qk_scale, head_size, group,
    DOT_PRECISION: tl.constexpr, FRESH: tl.constexpr, TMA: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # Which request and which of its query blocks this program owns, and which K/V head. The block's
    # rows are (query, head) pairs of the `group` query heads sharing that K/V head, query-major, so
    # each K/V tile is loaded once and used by the whole group (one row per query without grouping).
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(work_req_ptr + work)
    q_start = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_start
    k_start = tl.load(cu_k_ptr + req)
    kv_len = tl.load(cu_k_ptr + req + 1) - k_start
    # Programs start in work-map order; taking a request's blocks last first starts the long ones
    # (late queries see the most keys) first, so the short ones fill the tail of the launch.
    block = tl.cdiv(q_len * group, BLOCK_M) - 1 - tl.load(work_blk_ptr + work)

    offs_r = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_m = offs_r // group                     # the query of each row
    heads = kv_head * group + offs_r % group     # and its head
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_r < q_len * group
    mask_d = offs_d < head_size  # head sizes like 80 or 13 are padded to a power of two
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if INTERPRETED:  # bf16 arithmetic is wrong in the interpreter, so all math is fp32 there; on a
        q = q.to(tl.float32)  # GPU the dots take fp16/bf16 operands and accumulate in fp32

    # Causal, aligned bottom-right: query m sees keys [0, kv_len - q_len + m]. Keys below every row's
    # horizon come in whole blocks with no mask; only the blocks on the diagonal are masked, and keys
    # past the block's last visible one are never loaded (prefill does half the square's work).
    shift = kv_len - q_len
    first_q = block * BLOCK_M // group
    last_q = tl.minimum(((block + 1) * BLOCK_M - 1) // group, q_len - 1)
    kv_full = (shift + first_q + 1) // BLOCK_N * BLOCK_N   # whole key blocks every row sees
    kv_end = shift + last_q + 1                             # one past the last key any row sees

    # Online softmax in base 2 (exp2 is the fast instruction; log2(e) is folded into qk_scale):
    # running max m_i, sum l_i, output acc.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if TMA:  # k_ptr, v_ptr: descriptors of k, v as [tokens, heads x D]; a block is a box of them
        k_ptrs, v_ptrs, slots = k_ptr, v_ptr, q_start   # and `slots` the next block's first row
    else:
        k_ptrs = k_ptr + kv_head * stride_kh + offs_d[:, None] * stride_kd
        v_ptrs = v_ptr + kv_head * stride_vh + offs_d[None, :] * stride_vd
        if FRESH:  # a fresh prompt's keys are its own new tokens: rows q_start.. of k and v, in order,
            # so a block's rows are the previous block's moved on by BLOCK_N, with no slot ids to read
            slots = (q_start + offs_n).to(tl.int64)
        else:
            slots = tl.load(slot_ptr + k_start + offs_n, mask=offs_n < kv_len, other=0).to(tl.int64)
    m_i, l_i, acc, slots = _attend_blocks(
        q, k_ptrs, v_ptrs, slot_ptr + k_start, slots, m_i, l_i, acc, 0, kv_full, kv_len, shift + offs_m,
        mask_d, kv_head * BLOCK_D, stride_kn, stride_vn, qk_scale, DOT_PRECISION, BLOCK_N, False, FRESH, TMA,
        EVEN_D, INTERPRETED)
    m_i, l_i, acc, slots = _attend_blocks(
        q, k_ptrs, v_ptrs, slot_ptr + k_start, slots, m_i, l_i, acc, kv_full, kv_end, kv_len,
        shift + offs_m, mask_d, kv_head * BLOCK_D, stride_kn, stride_vn, qk_scale, DOT_PRECISION, BLOCK_N, True,
        FRESH, TMA, EVEN_D, INTERPRETED)

    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :] * stride_od, cast_rne(out, out_ptr.dtype.element_ty, INTERPRETED),
             mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _attend_blocks(q, k_ptrs, v_ptrs, slot_ptr, slots, m_i, l_i, acc, lo, hi, kv_len, last_key, mask_d, col,
                   stride_kn, stride_vn, qk_scale, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                   MASKED: tl.constexpr, FRESH: tl.constexpr, TMA: tl.constexpr, EVEN_D: tl.constexpr,
                   INTERPRETED: tl.constexpr):
    """The online softmax over keys [lo, hi) in blocks of BLOCK_N, from ``slot_ptr[lo:]``'s slots
    (``slots``: those of the block at ``lo``); returns the state and the slots of the block at ``hi``.
    MASKED: the diagonal blocks, where key n is visible to row r only if n <= last_key[r] and n < kv_len.
    FRESH: the keys are the rows of the step's ``k, v`` in order, so ``slots`` are those rows, each
    block's the last one's moved on by BLOCK_N, with no slot ids to read (Triton 3.6 compiles this
    form with no spill; K/V pointers moved on by a scalar step spilled at every tile).
    TMA (fresh, EVEN_D): ``k_ptrs``/``v_ptrs`` are tensor descriptors and ``slots`` the row of block
    ``lo``; a block is the box at (row, ``col``), copied by the Tensor Memory Accelerator: no address
    per thread; rows past the tensor read as zeros, and those of the next request are masked.
    EVEN_D: the head size fills BLOCK_D, so no load is masked along it.

    The slots of the next block are loaded one step ahead, so a block's K/V addresses do not wait on
    a load of the same step: Triton's pipeliner (num_stages 3) then prefetches K/V two blocks ahead
    into shared memory; an address loaded in the same step kept it to one block, waited for at once.
    """
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        if TMA:  # whole rows of the box: those past the request's keys are the next request's (or
            # zeros past the tensor): masked in the scores below, and their values zeroed, so a NaN or
            # inf there stays that request's (0 x inf would be NaN)
            kt = k_ptrs.load([slots, col]).T                                        # [BLOCK_D, BLOCK_N]
            v = v_ptrs.load([slots, col])                                           # [BLOCK_N, BLOCK_D]
            if MASKED:
                mask_n = start_n + offs_n < kv_len
                v = tl.where(mask_n[:, None], v, 0.0)
        else:
            if FRESH:
                next_slots = slots + BLOCK_N
            else:
                nxt = start_n + BLOCK_N + offs_n
                next_slots = tl.load(slot_ptr + nxt, mask=nxt < kv_len, other=0).to(tl.int64)
            k_at = k_ptrs + slots[None, :] * stride_kn
            v_at = v_ptrs + slots[:, None] * stride_vn
            if MASKED:  # keys past the request's own are another request's (or past the tensor): not read
                mask_n = start_n + offs_n < kv_len
                if EVEN_D:
                    kt = tl.load(k_at, mask=mask_n[None, :], other=0.0)              # [BLOCK_D, BLOCK_N]
                    v = tl.load(v_at, mask=mask_n[:, None], other=0.0)               # [BLOCK_N, BLOCK_D]
                else:
                    kt = tl.load(k_at, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
                    v = tl.load(v_at, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            elif EVEN_D:  # every key of the block exists and is visible to every row: no mask at all
                kt = tl.load(k_at)
                v = tl.load(v_at)
            else:
                kt = tl.load(k_at, mask=mask_d[:, None], other=0.0)
                v = tl.load(v_at, mask=mask_d[None, :], other=0.0)
        if INTERPRETED:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION)    # unscaled: qk_scale > 0 commutes with max
        if MASKED:
            visible = (start_n + offs_n[None, :] <= last_key[:, None]) & mask_n[None, :]
            s = tl.where(visible, s, float("-inf"))
        # Key 0 is visible to every row and lies in the first block, so m_new is finite from the
        # first block on and no -inf - -inf = NaN can appear.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])      # one fused multiply-add an element, not two ops
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
        if TMA:
            slots += BLOCK_N
        else:
            slots = next_slots
    return m_i, l_i, acc, slots


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, m_ptr, l_ptr, slot_ptr, cu_q_ptr, cu_k_ptr, req_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    qk_scale, n_heads, head_size, partition, group,
    SPLIT: tl.constexpr, GROUPED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # Program (i, head group, split): the i-th one-token request, BLOCK_H of its heads, and the keys
    # [split * partition, (split + 1) * partition) of its context. Without grouped queries a slot's K
    # (and V) row holds all heads side by side, so a head group reads BLOCK_H * D contiguous elements
    # per key. GROUPED: the program owns one K/V head and the `group` query heads that share it, and
    # reads that head's K/V once for all of them ([BLOCK_N, 1, BLOCK_D], broadcast over the group).
    i = tl.program_id(0)
    split = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    if GROUPED:
        kv_head = tl.program_id(1)
        offs_h = kv_head * group + tl.arange(0, BLOCK_H)
        mask_h = tl.arange(0, BLOCK_H) < group
        k_cols = kv_head * stride_kh + offs_d[None, None, :] * stride_kd
        v_cols = kv_head * stride_vh + offs_d[None, None, :] * stride_vd
        mask_kv = (offs_d < head_size)[None, None, :]
    else:
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < n_heads
        k_cols = offs_h[None, :, None] * stride_kh + offs_d[None, None, :] * stride_kd
        v_cols = offs_h[None, :, None] * stride_vh + offs_d[None, None, :] * stride_vd
        mask_kv = mask_h[None, :, None] & (offs_d < head_size)[None, None, :]
    req = tl.load(req_ptr + i)
    row = tl.load(cu_q_ptr + req)
    k_start = tl.load(cu_k_ptr + req)
    kv_len = tl.load(cu_k_ptr + req + 1) - k_start
    lo = split * partition
    hi = tl.minimum(kv_len, lo + partition)

    offs_n = tl.arange(0, BLOCK_N)
    mask_hd = mask_h[:, None] & (offs_d < head_size)[None, :]
    # One query row: no tensor cores to feed, so all math is fp32 multiply-adds (also the
    # interpreter's only correct arithmetic for bf16 inputs).
    q = tl.load(q_ptr + row * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_hd, other=0.0).to(tl.float32) * qk_scale                # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    # The next block's slot ids are loaded a step ahead and a block's K and V together, so no load
    # waits on another of the same step: the loads of a step are in flight at once (Triton does not
    # pipeline these loads through shared memory, as they feed no tl.dot; compiled for sm_90, 96-101
    # registers a thread became 102-128, none spilled).
    slots = tl.load(slot_ptr + k_start + lo + offs_n, mask=lo + offs_n < hi, other=0).to(tl.int64)
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        mask_n = n < hi
        nxt = n + BLOCK_N
        next_slots = tl.load(slot_ptr + k_start + nxt, mask=nxt < hi, other=0).to(tl.int64)
        mask = mask_n[:, None, None] & mask_kv
        k = tl.load(k_ptr + slots[:, None, None] * stride_kn + k_cols, mask=mask, other=0.0)
        v = tl.load(v_ptr + slots[:, None, None] * stride_vn + v_cols, mask=mask, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :, :], 2)                           # [BLOCK_N, BLOCK_H]
        s = tl.where(mask_n[:, None], s, float("-inf"))
        # Key `start` is valid, so m_new is finite from the first block on: no -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32), 0)
        m_i = m_new
        slots = next_slots

    if SPLIT:  # partial results, merged by _decode_reduce_kernel (a split past the context stays empty)
        base = (i * n_heads + offs_h) * tl.num_programs(2) + split
        tl.store(m_ptr + base, m_i, mask=mask_h)
        tl.store(l_ptr + base, l_i, mask=mask_h)
        tl.store(part_ptr + base[:, None] * head_size + offs_d[None, :], acc, mask=mask_hd)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + row * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 cast_rne(out, out_ptr.dtype.element_ty, INTERPRETED), mask=mask_hd)


@triton.jit
def _decode_reduce_kernel(
    part_ptr, m_ptr, l_ptr, out_ptr, cu_q_ptr, cu_k_ptr, req_ptr,
    stride_ot, stride_oh, stride_od,
    n_heads, head_size, n_splits, partition,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # Program (i, head): merge the splits that hold keys, BLOCK_S at a time, with the same online
    # softmax as over keys: a running max m_i, the sum l_i and output acc rescaled by exp2(m_i - m_new).
    # A fixed chunk makes one compile serve any split count (a tile of all splits took minutes to
    # compile at 4096 of them).
    i = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(req_ptr + i)
    row = tl.load(cu_q_ptr + req)
    kv_len = tl.load(cu_k_ptr + req + 1) - tl.load(cu_k_ptr + req)
    n_used = (kv_len + partition - 1) // partition      # splits past the context were left empty
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_size
    m_i = tl.full([], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, n_used, BLOCK_S):
        offs_s = start + tl.arange(0, BLOCK_S)
        mask_s = offs_s < n_used
        base = (i * n_heads + head) * n_splits + offs_s
        m = tl.load(m_ptr + base, mask=mask_s, other=float("-inf"))
        l_s = tl.load(l_ptr + base, mask=mask_s, other=0.0)
        part = tl.load(part_ptr + base[:, None] * head_size + offs_d[None, :],
                       mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        # Split `start` holds keys, so m_new is finite from the first chunk on: no -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(m, 0))
        alpha = tl.exp2(m_i - m_new)
        w = tl.where(mask_s, tl.exp2(m - m_new), 0.0)
        l_i = l_i * alpha + tl.sum(w * l_s, 0)
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
        m_i = m_new
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d * stride_od,
             cast_rne(acc / l_i, out_ptr.dtype.element_ty, INTERPRETED), mask=mask_d)


# ------------------------------------------------------------------------------------ reference
def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Causal, aligned bottom-right: the last ``q_len`` of ``kv_len`` tokens are the queries, and
    query i sees keys 0 .. kv_len - q_len + i (True = visible)."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


def ragged_attention_ref(q, k_pool, v_pool, slot_ids, cu_seqlens_q, cu_seqlens_k, scale=None):
    """Plain PyTorch: one scaled-dot-product attention per request, causal aligned bottom-right;
    query head h reads K/V head ``h // group`` (grouped queries, as transformers' ``repeat_kv``)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs:
            continue
        slots = slot_ids[ks:ke].long()
        qb = q[qs:qe].transpose(0, 1)                    # [H, Lq, D]
        kb = k_pool[slots].transpose(0, 1)               # [H, Lk, D]
        vb = v_pool[slots].transpose(0, 1)
        lq, lk = qe - qs, ke - ks
        mask = causal_mask(lq, lk, q.device) if lq > 1 else None
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, **_gqa(q, k_pool))
        out[qs:qe] = ob.transpose(0, 1)
    return out


# ------------------------------------------------------------------------------ fast CPU path
@dataclass(frozen=True)
class AttentionPlan:
    """How one iteration's ragged batch is attended by the PyTorch fast path: worked out once per
    iteration, then read by every layer.

    One 4-D SDPA per request (4-D takes CPU's fused kernel; 3-D does not). Keys and values are read
    where they lie: a request whose slots are one contiguous run of the pool (the K/V manager hands out
    runs) attends over a view of the pool, no copy; only a fragmented context is gathered.
    """
    # Per request with new tokens: (q_start, q_end, k_start, k_end, first, mask). ``first`` is its
    # first slot when its context is one run of slots, else None; ``mask`` is None for plain causal.
    requests: tuple
    slot_ids: torch.Tensor     # every request's context slots, back to back (read when gathering)


def attention_plan(cu_q, cu_k, slot_ids: torch.Tensor, host_slots: np.ndarray) -> AttentionPlan:
    """The plan of a batch from host data: offsets ``cu_q``, ``cu_k`` (``B + 1`` entries each) and
    ``host_slots``, the host copy of ``slot_ids`` (nothing is read back from ``slot_ids``)."""
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    plan = []
    for b, first in enumerate(_contiguous_runs(cu_k, host_slots)):
        q_len, kv_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if q_len == 0:
            continue
        # None when the mask is plain causal (SDPA's own) or lets every key through
        mask = None if q_len in (1, kv_len) else causal_mask(q_len, kv_len, slot_ids.device)
        plan.append((cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1], first, mask))
    return AttentionPlan(tuple(plan), slot_ids)


def _contiguous_runs(cu_k, ids: np.ndarray) -> list:
    """Per request, its first slot if its context is the run first, first + 1, ...; else None.
    Host arithmetic in numpy: a few microseconds, where each torch op costs several."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return [None] * (len(cu_k) - 1)
    breaks = np.zeros(ids.size, dtype=np.int64)
    np.cumsum(np.diff(ids) != 1, out=breaks[1:])          # breaks in the run up to each key
    cu = np.asarray(cu_k)
    starts, ends = np.minimum(cu[:-1], ids.size - 1), np.maximum(cu[1:] - 1, 0)
    whole = (breaks[ends] == breaks[starts]).tolist()
    return [int(f) if ok else None for f, ok in zip(ids[starts].tolist(), whole)]


def ragged_attention_torch(q, k_pool, v_pool, plan: AttentionPlan, scale: float, k=None, v=None):
    """The PyTorch fast path, no argument checks (the caller built ``plan`` for these tensors);
    grouped queries when the pools have fewer heads than ``q``.

    ``k, v``: the new tokens' keys and values, already written to the pools; a request whose
    context is all new (a fresh prompt) may read them there instead. Everything is viewed heads
    first once, so each request costs one slice per operand and one SDPA.
    """
    if not plan.requests:
        return torch.empty_like(q)
    # [1, H, rows, D] views; narrow() is the cheapest way to cut one request out of them
    qh, kh, vh = (_heads_first(x) for x in (q, k_pool, v_pool))
    gqa = _gqa(q, k_pool)
    direct = k is not None and k.dtype == k_pool.dtype
    if direct:
        kn, vn = _heads_first(k), _heads_first(v)
    outs = []
    for qs, qe, ks, ke, first, mask in plan.requests:
        if direct and qe - qs == ke - ks:
            kb, vb = kn.narrow(2, qs, qe - qs), vn.narrow(2, qs, qe - qs)
        elif first is not None:
            kb, vb = kh.narrow(2, first, ke - ks), vh.narrow(2, first, ke - ks)
        else:
            slots = plan.slot_ids[ks:ke]
            kb, vb = _heads_first(k_pool.index_select(0, slots)), _heads_first(v_pool.index_select(0, slots))
        outs.append(F.scaled_dot_product_attention(qh.narrow(2, qs, qe - qs), kb, vb, attn_mask=mask,
                                                   is_causal=mask is None and qe - qs > 1, scale=scale,
                                                   **gqa))
    return torch.cat(outs, dim=2)[0].transpose(0, 1)                       # [T, H, D]


def _gqa(q, k_pool) -> dict:
    """SDPA's grouped-query flag where the pool has fewer heads than q; none otherwise, so the
    multi-head path calls exactly what it called before grouped queries existed."""
    return {"enable_gqa": True} if k_pool.shape[1] != q.shape[1] else {}


def _heads_first(x):
    """``[L, H, D]`` -> ``[1, H, L, D]``, a view: 4-D SDPA takes CPU's fused kernel, 3-D does not."""
    return x.transpose(0, 1).unsqueeze(0)


# ---------------------------------------------------------------------------- launch configurations
@dataclass(frozen=True)
class PrefillConfig:
    """The ragged kernel's launch: queries and keys per program step, warps, pipeline stages; ``tma``:
    a fresh prompt's K/V blocks copied by the Tensor Memory Accelerator (sm_90 on)."""
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = False


@dataclass(frozen=True)
class DecodeConfig:
    """The decode kernel's launch: heads per program, keys per step, keys per split (0: no split)."""
    block_h: int
    block_n: int
    partition: int
    num_warps: int = 4
    num_stages: int = 2


# Under the interpreter: small blocks (its cost grows with the block area), and a split every 32 keys
# so that the split-and-merge path runs on the short contexts tests can afford.
INTERPRETER_PREFILL = PrefillConfig(16, 16, 1, 1)
INTERPRETER_DECODE = DecodeConfig(2, 16, 32, 1, 1)
NO_SPLIT = 1 << 30      # the partition of an unsplit context: longer than any


def interpreter_decode(n_heads: int, group: int = 1) -> DecodeConfig:
    """INTERPRETER_DECODE narrowed to the heads there are, or holding a K/V head's whole group."""
    block_h = next_pow2(group) if group > 1 else min(INTERPRETER_DECODE.block_h, next_pow2(n_heads))
    return replace(INTERPRETER_DECODE, block_h=block_h)


# Splits the merge kernel reads per step, whatever their count (one compile per dtype and BLOCK_D).
# 16 takes in one step every split count up to 4k-16k-token contexts (partition 256-1024), GPT-3's
# 2048 included, wasting at most 15 masked lanes; a [16, 256] fp32 tile is 32 values a thread over
# 4 warps. A 1M-token context's 4096 splits take 256 steps, reading about 1/256 of the bytes its
# decode kernel read (D fp32 per split against 256 keys of bf16 K and V).
MERGE_CHUNK = 16


# Shared memory a ragged-kernel launch may plan for, per GPU generation: under an A100's 163 KiB per
# block, and an H100's 227 KiB (3 stages of 128 x 128 bf16 tiles at head size 128 take 224 KiB). The
# pointer tiles plan for sm_80's, which they may also run on (on sm_90 the larger ones spill anyway,
# fp32's most); the TMA tiles run on sm_90 only.
SHARED_PLAN = {80: 160 * 1024, 90: 224 * 1024}


def _prefill_shared(c: PrefillConfig, block_d: int, elem_bytes: int) -> int:
    """Bytes of shared memory a ragged-kernel tile plans for: Q block and pipelined K/V blocks."""
    return elem_bytes * block_d * (c.block_m + 2 * c.block_n * c.num_stages)


# The ragged kernel's tiles per GPU generation, chosen from compiles for sm_90 and sm_80 (registers,
# spills and the pipeline read from the cubins; speed is the tuner's to measure): the first serves
# untuned (a CUDA graph captured before tuning), the rest are timed once per shape bucket. 128 query
# rows over 8 warps and 3 stages (K/V prefetched two blocks ahead) first; 64 rows over 4 warps fit
# two programs on one H100 SM; short query blocks waste fewer rows of short chunks. An A100 keeps
# the dot operands in registers: 64-key blocks at 128 rows spill there, so its list starts narrower.
# 128 x 128 tiles read through pointers spill registers on both (and need 224 KiB at 3 stages).
PREFILL_TABLE = {
    90: (PrefillConfig(128, 64, 8, 3), PrefillConfig(64, 64, 4, 3), PrefillConfig(128, 64, 8, 4),
         PrefillConfig(128, 32, 8, 3), PrefillConfig(64, 32, 4, 3), PrefillConfig(32, 64, 4, 3),
         PrefillConfig(16, 64, 4, 3)),
    80: (PrefillConfig(128, 32, 8, 3), PrefillConfig(64, 64, 8, 3), PrefillConfig(64, 32, 4, 3),
         PrefillConfig(32, 64, 4, 3), PrefillConfig(16, 64, 4, 3)),
}
WIDE_HEAD_PREFILL = (PrefillConfig(32, 32, 4, 2), PrefillConfig(16, 32, 4, 2), PrefillConfig(64, 32, 8, 1))
# Fresh prompts' K/V blocks copied by the Tensor Memory Accelerator (sm_90 on; ``tma_ready`` k, v at
# 16 bits): the copy engine computes the addresses and waits on a barrier, so no thread holds a pointer
# per element. Compiled for sm_90 at GPT-3's 40 heads of 128 in bf16, by the lock's Triton (3.9) and
# by the GPU image's (3.6): 128 x 64 at 3 stages takes 156 (3.9) or 158 (3.6) registers a thread where
# the same tile read through pointers takes 182 or 210; no TMA tile of the table spills on either.
# FlashAttention's 128 x 128 tile, added for them, fits 198-210 registers, and at 3 stages its 230,400
# bytes of shared memory (an H100 allows 232,448). Where the TMA can read a batch, the tuner times
# these and the table's tiles through it, not the pointer tiles (docs/results/aot_tma_cpu/).
FRESH_PREFILL = {90: (PrefillConfig(128, 128, 8, 3), PrefillConfig(128, 128, 8, 2))}


def prefill_candidates(head_size: int, elem_bytes: int = 2, arch: int | None = None,
                       fresh: bool = False, tma: bool = True) -> list[PrefillConfig]:
    """What the GPU tuner times for the ragged kernel on compute capability ``arch`` (90 for an H100
    or H200 and later, 80 for the rest), the first one also serving untuned; ``arch=None``: every
    configuration any GPU may launch (what ``aot`` compiles). ``fresh`` (keys read from the step's
    ``k, v``) with ``tma`` (they are ``tma_ready``), where the head size fills BLOCK_D (up to 128) and
    elements are 16-bit: on sm_90 the table's tiles and ``FRESH_PREFILL``'s, every one through the
    TMA (``aot`` also compiles the pointer tiles, which serve fresh prompts elsewhere). Tiles whose Q
    block and pipelined K/V blocks would not fit ``SHARED_PLAN`` are left out (fp32 halves what fits;
    checked against the compiler's figures for sm_80 and sm_90)."""
    block_d = next_pow2(head_size, 16)
    gens = (90, 80) if arch is None else (90 if arch >= 90 else 80,)
    boxes = fresh and tma and block_d == head_size <= 128 and elem_bytes == 2
    tiles = []
    for g in gens:
        table = WIDE_HEAD_PREFILL if block_d > 128 else PREFILL_TABLE[g]
        if boxes and g in FRESH_PREFILL:
            tiles += [replace(c, tma=True) for c in (table[0], *FRESH_PREFILL[g], *table[1:])]
        if not boxes or arch is None or g not in FRESH_PREFILL:
            tiles += table
    tiles = dict.fromkeys(tiles)
    return [c for c in tiles if _prefill_shared(c, block_d, elem_bytes) <= SHARED_PLAN[90 if c.tma else 80]] \
        or [PrefillConfig(16, 16, 4, 1)]


@lru_cache(maxsize=None)
def compute_capability(device_index: int) -> int:
    """``sm_XY`` as the integer XY, asked of the driver once per device."""
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


def decode_candidates(head_size: int, n_heads: int, group: int = 1) -> list[DecodeConfig]:
    """What the GPU tuner times for the decode kernel: head groups x key blocks x splits. With
    grouped queries a program holds one K/V head's whole group (``block_h = next_pow2(group)``) and
    the key block shrinks to keep the [keys, heads, D] product tile as small as without."""
    wide = next_pow2(head_size, 16) > 128
    if group > 1:
        bh = next_pow2(group)
        shapes = ((bh, max(8, 64 // bh), 4), (bh, max(8, 128 // bh), 8), (bh, max(8, 128 // bh), 4))
    else:
        shapes = ((2, 32, 4), (1, 64, 4), (4, 16, 4), (2, 64, 8), (4, 32, 8), (1, 128, 8))
    out = []
    for part in (512, 0, 256, 1024):
        for bh, bn, warps in shapes:
            bh = bh if group > 1 else min(bh, next_pow2(n_heads))
            cfg = DecodeConfig(bh, max(8, bn // 2) if wide else bn, part, warps, 2)
            if cfg not in out:
                out.append(cfg)
    return out


def decode_routes(head_size: int, n_heads: int, group: int, elem_bytes: int, arch: int) -> list:
    """What the GPU tuner times for the one-token requests: the decode kernel's launches (the first
    serves untuned), then the ragged kernel's 16-row query tile over them, the same tile the prefill
    tuner times. On an H200 the ragged kernel read the benchmark's decode case at 88% of the bandwidth
    floor and the decode kernel at 40-49% (docs/results/gpu_h200/): compiled for sm_90, the decode
    kernel then waited for each block's slot ids, then its K, then its V, while the ragged kernel
    prefetches slot ids a block ahead and pipelines K and V through shared memory. The decode kernel
    now loads slot ids a block ahead and K with V (not yet timed on a GPU)."""
    ragged = [c for c in prefill_candidates(head_size, elem_bytes, arch) if c.block_m == 16]
    return [*decode_candidates(head_size, n_heads, group), *ragged]


def _dot_precision(dtype, tf32: bool) -> str:
    """fp32 keeps IEEE dots unless TF32 was asked for; fp16/bf16 inputs are tensor-core native."""
    return "tf32" if tf32 or dtype != torch.float32 else "ieee"


@contextmanager
def tf32_matmuls(enabled: bool):
    """PyTorch's fp32 matmuls on TF32 tensor cores inside the block only (the flag is restored)."""
    if not enabled:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


# ------------------------------------------------------------------------------ iteration plan
@dataclass
class TritonPlan:
    """What the Triton launches of one iteration need from the host, built once from host offsets
    and read by every layer: which requests the ragged kernel takes (several new tokens) and which
    the decode kernel takes (one), the longest decode context (it sizes the split grid), and the
    ragged kernel's work map per query-block size (made on first use, then cached). A *fresh*
    prefill request has no earlier keys (a whole prompt, or a first chunk): its keys are its own new
    tokens, which the ragged kernel can read contiguously from the step's ``k, v``."""
    cu_q: np.ndarray                 # [B + 1] host offsets of the new tokens
    prefill_reqs: np.ndarray         # requests with more than one new token
    fresh: np.ndarray                # per prefill request: True if its keys are all new (q_len == kv_len)
    max_q: int                       # their longest query
    n_prefill_tokens: int
    decode_reqs: torch.Tensor | None  # [n_decode] int32 on the device: requests with one new token
    decode_host: np.ndarray          # ... and on the host
    n_decode: int
    max_kv: int                      # >= every decode request's context
    device: torch.device
    works: dict = field(default_factory=dict)

    def work_map(self, block_m: int, group: int = 1, fresh: bool | str | None = None) -> torch.Tensor:
        """Program id -> (request, query block): the per-request grids concatenated into one launch.
        A block holds ``block_m`` (query, head) rows of a K/V head's ``group`` query heads. ``fresh``:
        only the fresh prefill requests (True) or only the others (False); None: all of them;
        ``"decode"``: the one-token requests, for the ragged kernel to take in the decode kernel's place.
        Cached on the plan, so a CUDA graph's replays read the map its eager run made."""
        work = self.works.get((block_m, group, fresh))
        if work is None:
            reqs = self.decode_host if fresh == "decode" else \
                self.prefill_reqs if fresh is None else self.prefill_reqs[self.fresh == fresh]
            q_lens = np.diff(self.cu_q)[reqs]
            n_blocks = -(-(q_lens * group) // block_m)
            req = np.repeat(reqs, n_blocks)
            blk = np.arange(req.size) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)
            work = torch.from_numpy(np.stack([req, blk]).astype(np.int32))
            work = self.works[block_m, group, fresh] = work.to(self.device, non_blocking=True)
        return work


def triton_plan(cu_q, cu_k, device, *, decode: bool = True, max_kv: int | None = None) -> TritonPlan:
    """The plan of a batch whose offsets ``cu_q``, ``cu_k`` are on the host. ``decode=False`` sends
    every request to the ragged kernel (for comparisons); ``max_kv`` fixes the split grid (a CUDA
    graph replays one grid for any context up to it)."""
    cu_q, cu_k = np.asarray(cu_q, dtype=np.int64), np.asarray(cu_k, dtype=np.int64)
    q_lens = np.diff(cu_q)
    one = q_lens == 1 if decode else np.zeros(q_lens.size, dtype=bool)
    dec, pre = np.flatnonzero(one), np.flatnonzero(~one & (q_lens > 0))
    decode_reqs = torch.from_numpy(dec.astype(np.int32)).to(device, non_blocking=True) if dec.size else None
    if max_kv is None:
        max_kv = int(np.diff(cu_k)[dec].max(initial=0))
    return TritonPlan(cu_q, pre, q_lens[pre] == np.diff(cu_k)[pre], int(q_lens[pre].max(initial=0)),
                      int(q_lens[pre].sum()), decode_reqs, dec, int(dec.size), max_kv, torch.device(device))


# ------------------------------------------------------------------------------------ launchers
_TUNER = LaunchTuner()


def ragged_attention_triton(q, k_pool, v_pool, slot_ids, cu_seqlens_q, cu_seqlens_k, scale,
                            plan: TritonPlan, *, tf32: bool = False, prefill: PrefillConfig | None = None,
                            decode: DecodeConfig | PrefillConfig | None = None, k=None, v=None,
                            tma: bool = True):
    """Both kernels over one batch, no checks and no reads from the device (``plan`` holds what the
    host needs). ``prefill``/``decode`` force a launch configuration (tests; ``decode`` a
    ``PrefillConfig`` sends the one-token requests through the ragged kernel); else it is tuned.
    ``k, v``: the new tokens' keys and values ``[T, n_kv_heads, D]`` (already written to the pools):
    the fresh prefill requests read theirs there, contiguous, not through their slot ids; ``tma``:
    through tensor descriptors where they allow it (``tma_ready``), else (False) through pointers."""
    out = torch.empty_like(q)
    if plan.prefill_reqs.size:
        direct = k is not None and k.dtype == k_pool.dtype and plan.fresh.any()
        parts = ((True, k, v), (False, k_pool, v_pool)) if direct else ((None, k_pool, v_pool),)
        for fresh, keys, values in parts:
            if fresh is None or (plan.fresh == fresh).any():
                _launch_prefill(q, keys, values, out, slot_ids, cu_seqlens_q, cu_seqlens_k, scale, plan,
                                _dot_precision(q.dtype, tf32), prefill, fresh, tma)
    if plan.n_decode:
        _launch_decode(q, k_pool, v_pool, out, slot_ids, cu_seqlens_q, cu_seqlens_k, scale, plan, decode,
                       _dot_precision(q.dtype, tf32))
    return out


def tma_allowed() -> bool:
    """``ORCA_LAB_TMA=0`` reads fresh prompts through pointers everywhere, a forced TMA tile too: the GPU
    check sets it when its first step finds the copy engine's path failing or wrong on the GPU at hand
    (``scripts/gpu_check.py smoke``), so the steps after it measure the pointer path, not a crash."""
    return os.environ.get("ORCA_LAB_TMA", "1") != "0"


def tma_ready(k, v) -> bool:
    """Whether the copy engine can read ``k, v`` ``[T, n_kv_heads, D]`` in boxes of one head: heads
    side by side in a row, 16-byte aligned rows and start, a head a power of two of 16 bytes or more
    (the box fills the kernel's BLOCK_D, so no head's tile reads the next head's columns)."""
    return all(x.stride(2) == 1 and x.stride(1) == x.shape[2] == next_pow2(x.shape[2], 16) <= MAX_HEAD_SIZE
               and x.stride(0) * x.element_size() % 16 == 0 and x.data_ptr() % 16 == 0 for x in (k, v))


def kv_descriptors(k, v, block_n: int):
    """Tensor descriptors of a fresh batch's ``k, v`` ``[T, n_kv_heads, D]`` as ``[T, n_kv_heads x D]``
    matrices (``tma_ready``), in boxes of ``block_n`` keys by one head."""
    return tuple(TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1],
                                  [block_n, x.shape[2]]) for x in (k, v))


def _launch_prefill(q, keys, values, out, slot_ids, cu_q, cu_k, scale, plan, precision, cfg, fresh, tma):
    """The ragged kernel over ``plan``'s prefill requests (``fresh``: see ``TritonPlan.work_map``);
    ``keys, values``: the pools, or for the fresh ones the step's own ``k, v``, which a configuration
    with ``tma`` reads through tensor descriptors if ``tma`` and they are ``tma_ready`` (else through
    pointers, a forced configuration too). The tuner keeps each path's choices apart: slots, fresh
    (pointers), fresh-tma."""
    H, D = q.shape[1:]
    n_kv = keys.shape[1]
    on_gpu = q.is_cuda
    boxes = bool(fresh) and tma and tma_allowed() and tma_ready(keys, values)

    def launch(c: PrefillConfig):
        work = plan.work_map(c.block_m, H // n_kv, fresh)
        _ragged(q, keys, values, out, slot_ids, cu_q, cu_k, scale, work, precision, c, bool(fresh), boxes)

    if cfg is None:
        arch = compute_capability(q.device.index) if on_gpu else None
        cands = prefill_candidates(D, q.dtype.itemsize, arch, bool(fresh), boxes) if on_gpu \
            else [replace(INTERPRETER_PREFILL, tma=boxes)]
        path = "fresh-tma" if cands[0].tma else "fresh" if fresh else "slots"
        shape = (arch, H, n_kv, D, q.dtype, precision, bucket(plan.max_q), bucket(plan.n_prefill_tokens))
        # a path not timed borrows from the other kind's (a fresh prompt's for a chunk, and back):
        # the same tile, read through slots, pointers or the TMA as this path reads
        others = [("prefill", p, *shape) for p in ("fresh-tma", "fresh", "slots")
                  if (p == "slots") != (path == "slots")]
        cfg = _TUNER.choose(("prefill", path, *shape), cands, launch, on_gpu, like=others,
                            as_own=lambda c: replace(c, tma=cands[0].tma), answer=lambda: out)
    launch(cfg)


def _ragged(q, keys, values, out, slot_ids, cu_q, cu_k, scale, work, precision, c: PrefillConfig,
            fresh: bool, boxes: bool):
    """One launch of the ragged kernel over ``work``'s (request, query block) programs; a ``c.tma``
    configuration reads through tensor descriptors only where ``boxes`` allows, else through pointers."""
    H, D = q.shape[1:]
    n_kv = keys.shape[1]
    block_d = next_pow2(D, 16)  # the GPU compiler wants tl.dot dimensions >= 16
    c = c if boxes or not c.tma else replace(c, tma=False)
    _ragged_attention_kernel[(work.shape[1], n_kv)](
        q, *(kv_descriptors(keys, values, c.block_n) if c.tma else (keys, values)), out, slot_ids, cu_q,
        cu_k, work[0], work[1],
        *q.stride(), *keys.stride(), *values.stride(), *out.stride(),
        scale * math.log2(math.e), D, H // n_kv,
        DOT_PRECISION=precision, FRESH=fresh, TMA=c.tma, EVEN_D=D == block_d, BLOCK_M=c.block_m,
        BLOCK_N=c.block_n, BLOCK_D=block_d, INTERPRETED=not q.is_cuda, num_warps=c.num_warps,
        num_stages=c.num_stages)


def settle_tuning():
    """Time no more launch configurations: a shape bucket not yet met borrows its nearest timed
    neighbour's (``LaunchTuner.settle``). Called once an engine's warm-up has met its shapes."""
    _TUNER.settle()


def tuned_launches() -> list[dict]:
    """What the tuner chose in this process, per kernel and shape bucket: the configuration a measured
    speed belongs to (``bench`` records it), and every candidate's time where it timed them (on a
    GPU: which tiles came close, the first thing to read when a kernel is slower than it should be);
    ``recalled``: timed by an earlier process on this GPU (``_tuning.ChoiceStore``), not by this one."""
    return [{"kernel": key[0], "bucket": [str(x) for x in key[1:]], "config": repr(cfg),
             "timed_ms": {repr(c): round(ms, 5) for c, ms in _TUNER.timed.get(key, {}).items()},
             "recalled": key in _TUNER.recalled}
            for key, cfg in _TUNER.best.items()]


def _launch_decode(q, k_pool, v_pool, out, slot_ids, cu_q, cu_k, scale, plan, cfg, precision):
    """The one-token requests: the decode kernel's launch ``cfg``, or the ragged kernel's (a
    ``PrefillConfig``, ``decode_routes``) over them; ``None``: tuned."""
    H, D = q.shape[1:]
    n_kv = k_pool.shape[1]
    group = H // n_kv
    on_gpu, n = q.is_cuda, plan.n_decode
    block_d = next_pow2(D, 16)

    def launch(c: DecodeConfig | PrefillConfig):
        if isinstance(c, PrefillConfig):
            work = plan.work_map(c.block_m, group, "decode")
            return _ragged(q, k_pool, v_pool, out, slot_ids, cu_q, cu_k, scale, work, precision, c, False, False)
        if group > 1 and c.block_h != next_pow2(group):
            raise ValueError(f"{c} cannot hold a group of {group} query heads: block_h must be {next_pow2(group)}")
        n_splits = max(1, -(-plan.max_kv // c.partition)) if c.partition else 1
        split = n_splits > 1
        part = q.new_empty((n, H, n_splits, D) if split else (0,), dtype=torch.float32)
        m, l_ = (q.new_empty((n, H, n_splits) if split else (0,), dtype=torch.float32) for _ in range(2))
        _decode_attention_kernel[(n, n_kv if group > 1 else triton.cdiv(H, c.block_h), n_splits)](
            q, k_pool, v_pool, out, part, m, l_, slot_ids, cu_q, cu_k, plan.decode_reqs,
            *q.stride(), *k_pool.stride(), *v_pool.stride(), *out.stride(),
            scale * math.log2(math.e), H, D, c.partition if split else NO_SPLIT, group,
            SPLIT=split, GROUPED=group > 1, BLOCK_H=c.block_h, BLOCK_N=c.block_n, BLOCK_D=block_d,
            INTERPRETED=not on_gpu, num_warps=c.num_warps, num_stages=c.num_stages)
        if split:
            _decode_reduce_kernel[(n, H)](
                part, m, l_, out, cu_q, cu_k, plan.decode_reqs, *out.stride(), H, D, n_splits,
                c.partition, BLOCK_S=MERGE_CHUNK, BLOCK_D=block_d, INTERPRETED=not on_gpu,
                num_warps=4 if on_gpu else 1)

    if cfg is None:
        key = ("decode", H, n_kv, D, q.dtype, precision, bucket(n), bucket(plan.max_kv))
        cands = decode_routes(D, H, group, q.dtype.itemsize, compute_capability(q.device.index)) if on_gpu \
            else [interpreter_decode(H, group)]
        cfg = _TUNER.choose(key, cands, launch, on_gpu, answer=lambda: out)
    launch(cfg)


# -------------------------------------------------------------------------------------- wrapper
def _check_offsets(name, offsets, total, total_name):
    if offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at {total_name}={total}, "
                         f"got {offsets[0]} .. {offsets[-1]}")
    for b in range(len(offsets) - 1):
        if offsets[b + 1] < offsets[b]:
            raise ValueError(f"{name} must be non-decreasing, but {name}[{b + 1}]={offsets[b + 1]} "
                             f"< {name}[{b}]={offsets[b]}")


def _check_attention_args(q, k_pool, v_pool, slot_ids, cu_seqlens_q, cu_seqlens_k, scale):
    """All checks before any launch; returns cu_seqlens_q as a host list (the launch grid needs it)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    dev = q.device
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        check_tensor(name, pool, ndim=3, dtypes=(q.dtype,), device=dev)
        check_same(f"{name}.shape[2] (head size)", pool.shape[2], q.shape[2], "value")
    check_same("v_pool.shape", tuple(v_pool.shape), tuple(k_pool.shape), "value")
    if q.shape[1] < 1 or not 1 <= q.shape[2] <= MAX_HEAD_SIZE:
        raise ValueError(f"q has {q.shape[1]} heads of size {q.shape[2]}; allowed: >= 1 heads of "
                         f"size 1 to {MAX_HEAD_SIZE}")
    n_kv = k_pool.shape[1]
    if n_kv < 1 or q.shape[1] % n_kv:
        raise ValueError(f"k_pool.shape[1] (K/V heads) is {n_kv}; allowed: a divisor of q's "
                         f"{q.shape[1]} heads (each K/V head serves n_heads // n_kv_heads of them)")
    check_tensor("slot_ids", slot_ids, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu, ndim=1, dtypes=INDEX_DTYPES, device=dev)
        if cu.numel() < 2:
            raise ValueError(f"{name} must hold B+1 >= 2 offsets, got {cu.numel()}")
    check_same("len(cu_seqlens_k)", cu_seqlens_k.numel(), cu_seqlens_q.numel(), "length")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if scale is not None and not 0 < scale < math.inf:   # the ragged kernel scales after the row max
        raise ValueError(f"scale must be > 0 and finite (or None: 1/sqrt(head size)), got {scale}")
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    _check_offsets("cu_seqlens_q", cu_q, q.shape[0], "T")
    _check_offsets("cu_seqlens_k", cu_k, slot_ids.numel(), "len(slot_ids)")
    for b in range(len(cu_q) - 1):
        q_len, kv_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if q_len > kv_len:
            raise ValueError(f"request {b} has {q_len} queries but only {kv_len} keys: its context "
                             "must include its new tokens (q_len <= kv_len)")
    check_indices("slot_ids", slot_ids, k_pool.shape[0], "n_slots")
    return cu_q


def ragged_attention(q, k_pool, v_pool, slot_ids, cu_seqlens_q, cu_seqlens_k, scale=None,
                     backend="auto", *, check=True, tf32=False):
    """Attention of T flattened new tokens ``q [T, H, D]`` over each request's own K/V.

    Request b owns queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` and keys in the slots
    ``slot_ids[cu_seqlens_k[b]:cu_seqlens_k[b+1]]`` (its context, new tokens included and already
    written). The pools ``[n_slots, n_kv_heads, D]`` may hold fewer heads than ``q``: grouped-query
    attention, query head h reading K/V head ``h // (H // n_kv_heads)`` (n_kv_heads must divide H;
    equal to H is multi-head attention). Returns ``[T, H, D]`` in q's dtype. ``check=False`` skips
    the argument checks (for a caller that built the arguments itself); ``tf32=True`` lets fp32 dots
    use TF32 on a GPU. This wrapper reads the offsets back to the host; the engine's layers instead call the backends with
    a plan built once per iteration from host data (``triton_plan`` / ``attention_plan``).
    """
    if check:
        cu_q = _check_attention_args(q, k_pool, v_pool, slot_ids, cu_seqlens_q, cu_seqlens_k, scale)
    else:
        cu_q = cu_seqlens_q.tolist()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    cu_k = cu_seqlens_k.tolist()
    if use_triton(backend, q):
        plan = triton_plan(cu_q, cu_k, q.device)
        return ragged_attention_triton(q, k_pool, v_pool, slot_ids, cu_seqlens_q, cu_seqlens_k, scale,
                                       plan, tf32=tf32)
    plan = attention_plan(cu_q, cu_k, slot_ids, slot_ids.cpu().numpy())
    return ragged_attention_torch(q, k_pool, v_pool, plan, scale)


# ------------------------------------------------------------------------ ahead-of-time compile
def _head_classes():
    """(heads, head size) pairs that compile differently: each BLOCK_D bucket (16 to 256) with head
    sizes 1, odd, 2 or 8 times odd, and multiples of 16 (the 16-divisibility Triton specializes the
    size and the strides H * D and D on); 1, 2 and 40 heads (one head makes ``n_heads`` a constant,
    and fewer heads than ``block_h`` narrow the decode head group). Pairs that type the same are
    merged by ``orca_lab.kernels.aot``."""
    sizes = [1] + [d for b in (16, 32, 64, 128, 256) for d in (b - 1, b - 2, b - 8, b) if d > 1]
    return [(h, d) for h in (1, 2, 40) for d in sizes]


# Grouped-query shapes at head size 128 (group 1, 4 and 8): Llama-2-7B's 32 heads, Llama-3-8B's 32 query
# heads over 8 K/V heads, Llama-3-70B's 64 over 8 (their config.json); then an odd head size and Qwen2.5-0.5B's
# group of 7 (14 over 2 of 64), for --full. As (query heads, K/V heads, head size, in CI's quick set).
GROUPED_SHAPES = ((32, 32, 128, True), (32, 8, 128, True), (64, 8, 128, True), (32, 8, 80, False),
                  (14, 2, 64, False))


def aot_launches():
    """Every launch ``ragged_attention_triton`` can make on a GPU (``orca_lab.kernels.aot``): for each
    float dtype and head class (``_head_classes``, multi-head) and grouped shape (``GROUPED_SHAPES``),
    the ragged kernel with every prefill candidate the tuner may pick (fp32 with both dot
    precisions), the decode kernel with every decode candidate split and unsplit, the merge kernel
    (one compile whatever the split count, but for Triton's typing of a count that is or is not a
    multiple of 16); int64 slot ids, int32 offsets.

    The quick set (CI) keeps, per kernel, dtype and BLOCK_D bucket, the default configuration and
    the one with the largest tiles (the most shared memory), at 40 heads of a multiple of 16;
    every launch at 40 heads of 128 in bf16 (GPT-3's); and in bf16 the same two for each group size
    of ``GROUPED_SHAPES`` (a family of its own in ``ci_subset``). ``orca_lab.kernels.aot.ci_subset``
    narrows this to what CI compiles; ``--full`` compiles every launch."""
    for dtype, (heads, d) in product(FLOAT_DTYPES, _head_classes()):
        bd = next_pow2(d, 16)
        paper = dtype == torch.bfloat16 and heads == 40 and d == 128
        yield from _shape_launches(dtype, heads, heads, d, every=paper, ends=heads == 40 and d == bd)
    for dtype, (heads, n_kv, d, quick) in product(FLOAT_DTYPES, GROUPED_SHAPES):
        yield from _shape_launches(dtype, heads, n_kv, d, ends=quick and dtype == torch.bfloat16,
                                   family=f"group {heads // n_kv}", merge=False)


def _shape_launches(dtype, heads, n_kv, d, *, every=False, ends=False, family="", merge=True):
    """The launches of one (dtype, query heads, K/V heads, head size), in the quick set: ``every``
    configuration, or with ``ends`` the default and the widest; ``merge=False`` leaves the merge
    (it never reads K/V, so grouping does not change it) to --full."""
    from orca_lab.kernels.launches import launch, meta, strides
    i32, i64 = meta(9, dtype=torch.int32), meta(9, dtype=torch.int64)
    max_splits = (1 << 20) // 256     # max_seq_len's limit over the shortest partition
    bd, group = next_pow2(d, 16), heads // n_kv
    q, pool = meta(64, heads, d, dtype=dtype), meta(2, 256, n_kv, d, dtype=dtype)[0]
    tensors = dict(q_ptr=q, k_ptr=pool, v_ptr=pool, out_ptr=q, slot_ptr=i64, cu_q_ptr=i32, cu_k_ptr=i32,
                   **strides("stride_q", "thd", q), **strides("stride_k", "nhd", pool),
                   **strides("stride_v", "nhd", pool), **strides("stride_o", "thd", q))
    shape = (f"{heads} heads" if n_kv == heads else f"{heads} heads over {n_kv} K/V heads") + f" of {d}, {dtype}"
    precisions = sorted({_dot_precision(dtype, False), _dot_precision(dtype, True)})
    new = meta(64, 3, n_kv, d, dtype=dtype)[:, 1]     # fresh prompts' keys: a fused projection's view
    for fresh in (False, True):
        cands = prefill_candidates(d, dtype.itemsize, fresh=fresh)
        widest = max(cands, key=lambda c: _prefill_shared(c, bd, dtype.itemsize))
        keys = {**strides("stride_k", "nhd", new), **strides("stride_v", "nhd", new)} if fresh else {}
        for c, prec in product(cands, precisions):
            boxes = dict(zip(("k_ptr", "v_ptr"), kv_descriptors(new, new, c.block_n))) if c.tma else {}
            ends_of = c in (cands[0], widest)
            yield launch(_ragged_attention_kernel, f"prefill {'fresh ' if fresh else ''}{c}, {prec}, {shape}",
                         **{**tensors, **keys, **boxes}, work_req_ptr=i32, work_blk_ptr=i32, qk_scale=0.125,
                         head_size=d, group=group, DOT_PRECISION=prec, FRESH=fresh, TMA=c.tma, EVEN_D=d == bd,
                         BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_D=bd, INTERPRETED=False,
                         num_warps=c.num_warps, num_stages=c.num_stages,
                         quick=every if fresh else every or ends and ends_of,  # fresh: GPT-3's shape only
                         # CI compiles the default and widest tile of each path: slots, fresh, fresh-tma
                         family=family + (" fresh" if fresh else "") + (" tma" if c.tma else ""),
                         min_arch=90 if c.tma else 0)
    cands = decode_candidates(d, heads, group)
    widest = max(cands, key=lambda c: (c.block_h * c.block_n, c.num_stages))
    part = meta(9, dtype=torch.float32)
    for c, split in product(cands, (True, False)):
        yield launch(_decode_attention_kernel, f"decode {c}, split={split}, {shape}", **tensors,
                     part_ptr=part, m_ptr=part, l_ptr=part, req_ptr=i32, qk_scale=0.125, n_heads=heads,
                     head_size=d, partition=c.partition if split else NO_SPLIT, group=group, SPLIT=split,
                     GROUPED=group > 1, BLOCK_H=c.block_h, BLOCK_N=c.block_n, BLOCK_D=bd, INTERPRETED=False,
                     num_warps=c.num_warps, num_stages=c.num_stages,
                     quick=every or ends and c in (cands[0], widest), family=family)
    # the merge reads MERGE_CHUNK splits a step: one compile for any split count, but for
    # Triton's hint that the count is a multiple of 16; both, at the most splits a context has
    for n_splits in (max_splits - 1, max_splits):
        yield launch(_decode_reduce_kernel, f"merge of {n_splits} splits, {shape}", part_ptr=part, m_ptr=part,
                     l_ptr=part, out_ptr=q, cu_q_ptr=i32, cu_k_ptr=i32, req_ptr=i32,
                     **strides("stride_o", "thd", q), n_heads=heads, head_size=d, n_splits=n_splits,
                     partition=256, BLOCK_S=MERGE_CHUNK, BLOCK_D=bd, INTERPRETED=False, num_warps=4,
                     quick=merge and (every or ends), family=family)
