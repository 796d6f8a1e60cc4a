"""Ragged attention over the K/V slot pool: every request of one iteration in one launch (ORCA §4.2).

Selective batching flattens the new tokens of all requests into ``q [T, H, D]``; only attention must
be split per request, because each request attends over its own keys. ORCA concatenates the thread
blocks of the per-request kernels into one launch; here that is one Triton grid over
(query block of some request, head), with a small map, built on the host, from program id to
(request, query block). Each program runs FlashAttention's online softmax over its request's keys,
block by block, gathering them from the slot pool through ``slot_ids``, so memory does not grow with
the context and slots need not be contiguous.
"""
import math
from dataclasses import dataclass
from itertools import product

import numpy as np
import torch
import torch.nn.functional as F

from orca_lab.kernels._backend import (FLOAT_DTYPES, INDEX_DTYPES, cast_rne, check_indices,
                                       check_same, check_tensor, next_pow2, use_triton)

import triton  # noqa: E402  (after _backend, which sets TRITON_INTERPRET on CPU-only machines)
import triton.language as tl  # noqa: E402

MAX_HEAD_SIZE = 256


# --------------------------------------------------------------------------------------- kernel
@triton.jit
def _ragged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, slot_ptr, cu_q_ptr, cu_k_ptr, work_req_ptr, work_blk_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    qk_scale, head_size,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # Which request and which of its query blocks this program owns, and which head.
    work = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(work_req_ptr + work)
    block = tl.load(work_blk_ptr + work)
    q_start = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_start
    k_start = tl.load(cu_k_ptr + req)
    kv_len = tl.load(cu_k_ptr + req + 1) - k_start

    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < head_size  # head sizes like 80 or 13 are padded to a power of two
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
                + offs_d[None, :] * stride_qd, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if INTERPRETED:  # bf16 arithmetic is wrong in the interpreter, so all math is fp32 there
        q = q.to(tl.float32)

    # Causal, aligned bottom-right: query m sees keys [0, kv_len - q_len + m].
    last_key = kv_len - q_len + offs_m
    # Keys past the block's last visible one are skipped, not just masked: prefill does half the work.
    kv_end = tl.minimum(kv_len, kv_len - q_len + (block + 1) * BLOCK_M)

    # Online softmax in base 2 (exp2 is the fast instruction): running max m_i, sum l_i, output acc.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_len
        slots = tl.load(slot_ptr + k_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        kt = tl.load(k_ptr + slots[None, :] * stride_kn + head * stride_kh + offs_d[:, None] * stride_kd,
                     mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(v_ptr + slots[:, None] * stride_vn + head * stride_vh + offs_d[None, :] * stride_vd,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if INTERPRETED:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
        visible = (offs_n[None, :] <= last_key[:, None]) & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))
        # Key 0 is visible to every query and lies in the first block, so m_new is finite from
        # the first iteration on and no -inf - -inf = NaN can appear.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
             + offs_d[None, :] * stride_od, cast_rne(out, out_ptr.dtype.element_ty, INTERPRETED),
             mask=mask_m[:, None] & mask_d[None, :])


# ------------------------------------------------------------------------------------ reference
def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Causal, aligned bottom-right: the last ``q_len`` of ``kv_len`` tokens are the queries, and
    query i sees keys 0 .. kv_len - q_len + i (True = visible)."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


def ragged_attention_ref(q, k_pool, v_pool, slot_ids, cu_seqlens_q, cu_seqlens_k, scale=None):
    """Plain PyTorch: one scaled-dot-product attention per request, causal aligned bottom-right."""
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
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
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


def attention_plan(cu_q: list[int], cu_k: list[int], slot_ids: torch.Tensor) -> AttentionPlan:
    """The plan of a batch whose offsets ``cu_q``, ``cu_k`` are host lists (``B + 1`` entries)."""
    plan = []
    for b, first in enumerate(_contiguous_runs(cu_k, slot_ids)):
        q_len, kv_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if q_len == 0:
            continue
        # None when the mask is plain causal (SDPA's own) or lets every key through
        mask = None if q_len in (1, kv_len) else causal_mask(q_len, kv_len, slot_ids.device)
        plan.append((cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1], first, mask))
    return AttentionPlan(tuple(plan), slot_ids)


def _contiguous_runs(cu_k, slot_ids) -> list:
    """Per request, its first slot if its context is the run first, first + 1, ...; else None.
    Host arithmetic in numpy: a few microseconds, where each torch op costs several."""
    ids = slot_ids.cpu().numpy().astype(np.int64)
    if ids.size == 0:
        return [None] * (len(cu_k) - 1)
    breaks = np.zeros(ids.size, dtype=np.int64)
    np.cumsum(np.diff(ids) != 1, out=breaks[1:])          # breaks in the run up to each key
    cu = np.asarray(cu_k)
    starts, ends = np.minimum(cu[:-1], ids.size - 1), np.maximum(cu[1:] - 1, 0)
    whole = (breaks[ends] == breaks[starts]).tolist()
    return [int(f) if ok else None for f, ok in zip(ids[starts].tolist(), whole)]


def ragged_attention_torch(q, k_pool, v_pool, plan: AttentionPlan, scale: float, k=None, v=None):
    """The PyTorch fast path, no argument checks (the caller built ``plan`` for these tensors).

    ``k, v``: the new tokens' keys and values, already written to the pools; a request whose
    context is all new (a fresh prompt) may read them there instead. Everything is viewed heads
    first once, so each request costs one slice per operand and one SDPA.
    """
    if not plan.requests:
        return torch.empty_like(q)
    # [1, H, rows, D] views; narrow() is the cheapest way to cut one request out of them
    qh, kh, vh = (_heads_first(x) for x in (q, k_pool, v_pool))
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
                                                   is_causal=mask is None and qe - qs > 1, scale=scale))
    return torch.cat(outs, dim=2)[0].transpose(0, 1)                       # [T, H, D]


def _heads_first(x):
    """``[L, H, D]`` -> ``[1, H, L, D]``, a view: 4-D SDPA takes CPU's fused kernel, 3-D does not."""
    return x.transpose(0, 1).unsqueeze(0)


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
        check_same(f"{name}.shape[1:] (heads, head size)", tuple(pool.shape[1:]), tuple(q.shape[1:]),
                   "value")
    check_same("v_pool.shape", tuple(v_pool.shape), tuple(k_pool.shape), "value")
    if q.shape[1] < 1 or not 1 <= q.shape[2] <= MAX_HEAD_SIZE:
        raise ValueError(f"q has {q.shape[1]} heads of size {q.shape[2]}; allowed: >= 1 heads of "
                         f"size 1 to {MAX_HEAD_SIZE}")
    check_tensor("slot_ids", slot_ids, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu, ndim=1, dtypes=INDEX_DTYPES, device=dev)
        if cu.numel() < 2:
            raise ValueError(f"{name} must hold B+1 >= 2 offsets, got {cu.numel()}")
    check_same("len(cu_seqlens_k)", cu_seqlens_k.numel(), cu_seqlens_q.numel(), "length")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
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


def _work_map(cu_q, block_m, device):
    """Program id -> (request, query block): the per-request grids concatenated into one launch."""
    q_lens = torch.tensor(cu_q).diff()
    n_blocks = (q_lens + block_m - 1) // block_m
    req = torch.repeat_interleave(torch.arange(len(q_lens)), n_blocks)
    first = torch.repeat_interleave(n_blocks.cumsum(0) - n_blocks, n_blocks)
    blk = torch.arange(req.numel()) - first
    return torch.stack([req, blk]).to(device=device, dtype=torch.int32)


def _block_sizes(max_q_len, head_size, on_gpu):
    """(BLOCK_M, BLOCK_N, BLOCK_D): queries, keys and head dims per program step."""
    block_d = next_pow2(head_size, 16)  # the GPU compiler wants tl.dot dimensions >= 16
    if not on_gpu:  # the interpreter's cost grows with the block area: small blocks, fewer wasted rows
        return 16, 16, block_d
    if block_d > 128:  # keep the K/V tiles of the pipelined loop within shared memory
        return (16 if max_q_len <= 16 else 32), 32, block_d
    # Decode (q_len 1) wastes the rows of a query block, so keep it small there.
    return (16 if max_q_len <= 16 else 128 if block_d <= 64 else 64), 64, block_d


def ragged_attention_triton(q, k_pool, v_pool, slot_ids, cu_seqlens_q, cu_seqlens_k, scale, cu_q):
    """One launch for the whole batch; ``cu_q`` is ``cu_seqlens_q`` already on the host."""
    T, H, D = q.shape
    out = torch.empty_like(q)
    max_q_len = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    block_m, block_n, block_d = _block_sizes(max_q_len, D, q.is_cuda)
    work = _work_map(cu_q, block_m, q.device)
    if work.shape[1] == 0:  # every request has zero new tokens
        return out
    _ragged_attention_kernel[(work.shape[1], H)](
        q, k_pool, v_pool, out, slot_ids, cu_seqlens_q, cu_seqlens_k, work[0], work[1],
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *out.stride(),
        scale * math.log2(math.e), D,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, INTERPRETED=not q.is_cuda,
    )
    return out


def ragged_attention(q, k_pool, v_pool, slot_ids, cu_seqlens_q, cu_seqlens_k, scale=None,
                     backend="auto", *, check=True):
    """Attention of T flattened new tokens ``q [T, H, D]`` over each request's own K/V.

    Request b owns queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` and keys in the slots
    ``slot_ids[cu_seqlens_k[b]:cu_seqlens_k[b+1]]`` (its context, new tokens included and already
    written). Returns ``[T, H, D]`` in q's dtype. ``check=False`` skips the argument checks: only
    for a caller that built the arguments itself (the engine's hot path).
    """
    if check:
        cu_q = _check_attention_args(q, k_pool, v_pool, slot_ids, cu_seqlens_q, cu_seqlens_k, scale)
    else:
        cu_q = cu_seqlens_q.tolist()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if use_triton(backend, q):
        return ragged_attention_triton(q, k_pool, v_pool, slot_ids, cu_seqlens_q, cu_seqlens_k, scale,
                                       cu_q)
    plan = attention_plan(cu_q, cu_seqlens_k.tolist(), slot_ids)
    return ragged_attention_torch(q, k_pool, v_pool, plan, scale)


# ------------------------------------------------------------------------ ahead-of-time compile
def aot_launches():
    """Every launch ``ragged_attention_triton`` can make on a GPU (``orca_lab.kernels.aot``): each
    block configuration ``_block_sizes`` picks for head sizes 1 to 256, decode (one query per
    request) and prefill; each float dtype; the engine's int64 slot ids and int32 offsets.

    fp16 takes every head size, so every alignment class of the strides (multiples of 16, odd sizes,
    size 1); fp32 and bf16 take the multiples of 16, the
    class with the most vectorized, pipelined loads (the most shared memory): elsewhere the dtype
    changes only the operand type of the same code."""
    from orca_lab.kernels.aot import launch, meta, strides
    i32 = meta(9, dtype=torch.int32)
    for dtype in FLOAT_DTYPES:
        every = dtype == torch.float16
        for head_size in range(1, MAX_HEAD_SIZE + 1) if every else range(16, MAX_HEAD_SIZE + 1, 16):
            for heads, max_q_len in product((1, 3), (1, 17)):
                block_m, block_n, block_d = _block_sizes(max_q_len, head_size, on_gpu=True)
                q, pool = meta(64, heads, head_size, dtype=dtype), meta(2, 256, heads, head_size, dtype=dtype)[0]
                yield launch(
                    _ragged_attention_kernel, f"{heads} heads of {head_size}, q_len <= {max_q_len}, {dtype}",
                    q_ptr=q, k_ptr=pool, v_ptr=pool, out_ptr=q, slot_ptr=meta(9, dtype=torch.int64),
                    cu_q_ptr=i32, cu_k_ptr=i32, work_req_ptr=i32, work_blk_ptr=i32,
                    **strides("stride_q", "thd", q), **strides("stride_k", "nhd", pool),
                    **strides("stride_v", "nhd", pool), **strides("stride_o", "thd", q),
                    qk_scale=0.125, head_size=head_size, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                    BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, INTERPRETED=False)
