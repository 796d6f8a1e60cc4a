"""K/V write: scatter the new tokens' keys and values into their slots of the pool (ORCA §3).

The Attention K/V manager hands each new token a slot; before attention runs, every layer writes
that token's K and V there, so the attention kernel finds each request's whole context in the pool.
A slot holds ``n_kv_heads`` heads: as many as the queries for multi-head attention, fewer for grouped
queries (a Llama model's rotated keys: ``rotary.apply_rotary`` runs on k before this write).
"""
from itertools import product

import torch

from orca_lab.kernels._backend import (FLOAT_DTYPES, INDEX_DTYPES, cast_rne, check_indices,
                                       check_same, check_tensor, next_pow2, use_triton)

import triton  # noqa: E402  (after _backend, which sets TRITON_INTERPRET on CPU-only machines)
import triton.language as tl  # noqa: E402

# Elements of one token's [H, D] row that one program copies (the last chunk is masked).
MAX_BLOCK = 1024


# --------------------------------------------------------------------------------------- kernel
@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kpn, stride_kph, stride_kpd,
    stride_vpn, stride_vph, stride_vpd,
    head_size, row_size,
    INTERPRETED: tl.constexpr, BLOCK: tl.constexpr,
):
    # Program (token, chunk) copies one chunk of that token's H*D keys and values; the flat index
    # is split into (head, dim) so any strides work, including a pool sliced out of a larger one.
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    head, dim = offs // head_size, offs % head_size
    slot = tl.load(slot_ptr + token).to(tl.int64)
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim * stride_vd, mask=mask)
    tl.store(k_pool_ptr + slot * stride_kpn + head * stride_kph + dim * stride_kpd,
             cast_rne(k, k_pool_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    tl.store(v_pool_ptr + slot * stride_vpn + head * stride_vph + dim * stride_vpd,
             cast_rne(v, v_pool_ptr.dtype.element_ty, INTERPRETED), mask=mask)


# ------------------------------------------------------------------------------------ reference
def write_kv_torch(k, v, k_pool, v_pool, slot_mapping):
    """The fast path: ``index_copy_`` writes rows in place, cheaper than advanced-index assignment."""
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    k_pool.index_copy_(0, slots, k.to(k_pool.dtype))
    v_pool.index_copy_(0, slots, v.to(v_pool.dtype))


# -------------------------------------------------------------------------------------- wrapper
def _check_write_kv_args(k, v, k_pool, v_pool, slot_mapping):
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    dev = k.device
    check_tensor("v", v, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check_same("v.shape", tuple(v.shape), tuple(k.shape), "value")
    check_tensor("k_pool", k_pool, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("v_pool", v_pool, ndim=3, dtypes=(k_pool.dtype,), device=dev)
    check_same("v_pool.shape", tuple(v_pool.shape), tuple(k_pool.shape), "value")
    check_same("k_pool.shape[1:] (heads, head size)", tuple(k_pool.shape[1:]), tuple(k.shape[1:]),
               "value")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_same("len(slot_mapping)", slot_mapping.numel(), k.shape[0], "length (T)")
    check_indices("slot_mapping", slot_mapping, k_pool.shape[0], "n_slots")


def write_kv_triton(k, v, k_pool, v_pool, slot_mapping):
    T, H, D = k.shape
    if T == 0:
        return
    block = _block(H * D)
    _write_kv_kernel[(T, triton.cdiv(H * D, block))](
        k, v, k_pool, v_pool, slot_mapping,
        *k.stride(), *v.stride(), *k_pool.stride(), *v_pool.stride(),
        D, H * D, INTERPRETED=not k.is_cuda, BLOCK=block,
    )


def _block(row_size: int) -> int:
    """Elements of a token's row per program: the whole row up to MAX_BLOCK, at least one per thread
    of the default 4 warps (a smaller block would leave threads idle; the tail is masked anyway)."""
    return min(next_pow2(row_size, 128), MAX_BLOCK)


def aot_launches():
    """Every launch ``write_kv_triton`` can make on a GPU (``orca_lab.kernels.aot``): each block size
    and alignment class (one head or 40, head sizes 1 to 256; a grouped model's 8 K/V heads of 128
    type as 40 of them do) in each float dtype, with the engine's
    int64 slot ids, pools sliced out of ``[n_layers, n_slots, H, D]``. The other choices change one
    instruction, not the blocks, so GPT-3's rows (40 heads of 128) stand for the rest: int32 slot
    ids, and K/V cast into a pool of each other dtype."""
    from orca_lab.kernels.launches import launch, meta, strides
    cases = [(d, d, torch.int64, h, s) for d in FLOAT_DTYPES for h in (1, 40) for s in range(1, 257)]
    cases += [(kv, pool, slot, 40, 128) for kv, pool, slot in product(FLOAT_DTYPES, FLOAT_DTYPES, INDEX_DTYPES)]
    for kv_dtype, pool_dtype, slot_dtype, heads, head_size in cases:
        k, pool = meta(7, heads, head_size, dtype=kv_dtype), meta(2, 64, heads, head_size, dtype=pool_dtype)[0]
        yield launch(_write_kv_kernel, f"{heads} heads of {head_size}, {kv_dtype} into {pool_dtype}, {slot_dtype} slots",
                     k_ptr=k, v_ptr=k, k_pool_ptr=pool, v_pool_ptr=pool, slot_ptr=meta(7, dtype=slot_dtype),
                     **strides("stride_k", "thd", k), **strides("stride_v", "thd", k),
                     **strides("stride_kp", "nhd", pool), **strides("stride_vp", "nhd", pool),
                     head_size=head_size, row_size=heads * head_size, INTERPRETED=False,
                     BLOCK=_block(heads * head_size))


def write_kv(k, v, k_pool, v_pool, slot_mapping, backend="auto", *, check=True):
    """``k, v [T, Hkv, D]`` into ``k_pool, v_pool [n_slots, Hkv, D]`` at rows ``slot_mapping [T]``, in
    place; ``Hkv`` is the model's K/V heads (``n_kv_heads``: its query heads without grouping).

    K/V of another float dtype are cast to the pool's (rounded to nearest). ``check=False`` skips the
    argument checks: only for a caller that built the arguments itself (the engine's hot path).
    """
    if check:
        _check_write_kv_args(k, v, k_pool, v_pool, slot_mapping)
    if use_triton(backend, k):
        return write_kv_triton(k, v, k_pool, v_pool, slot_mapping)
    return write_kv_torch(k, v, k_pool, v_pool, slot_mapping)
