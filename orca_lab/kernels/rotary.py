"""Rotary position embeddings (RoPE) of queries and keys, at each token's own position.

    cache = cos_sin_cache(rope_inv_freq(head_size, theta), max_positions)     # [P, D] fp32, built once
    q = apply_rotary(q, positions, cache)                                    # [T, H, D] -> [T, H, D]

Selective batching flattens every request's new tokens into one ``[sum L, ...]`` tensor, so a token's
position is not its row: ``positions [T]`` (the batch's own per-token positions) picks each row's
cos/sin. The convention is the neox / Llama one of transformers' ``apply_rotary_pos_emb``: the head's
two halves rotate together (``rotate_half``), not interleaved pairs. The cache holds, per position,
``cos(p * inv_freq)`` in its first D/2 columns and ``sin`` in the last D/2; ``inv_freq [D/2]`` is
``rope_inv_freq``'s (``rope_theta``) or any other (Llama 3's ``rope_scaling`` rescales it; pass that).

Where it runs: on q, and on k before ``write_kv`` puts k in the pool, so the pool holds rotated keys
and attention needs no positions. Q and K of a fused QKV projection rotate in one launch as the
strided view ``qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D)``. Fusing the rotation into the K/V write
would save one write and read of K per layer; it is a separate kernel because that saving could not
be measured here (no GPU), and K is 1/(2 + 2 H/Hkv) of the QKV activations it would save it on.

Rounding follows transformers in the input's dtype: cos and sin rounded to it, each product and the
sum rounded (so bf16 results match it), computed in fp32 (the interpreter's bf16 arithmetic is wrong).
"""
import torch

from orca_lab.kernels._backend import (FLOAT_DTYPES, INDEX_DTYPES, cast_rne, check_indices, check_same,
                                       check_tensor, next_pow2, use_triton)

import triton  # noqa: E402  (after _backend, which sets TRITON_INTERPRET on CPU-only machines)
import triton.language as tl  # noqa: E402

# Elements of one token's [heads, D / 2] tile a program rotates: a 128-wide head's 64 pairs x 32 heads.
MAX_TILE = 2048


# --------------------------------------------------------------------------------------- kernel
@triton.jit
def _rounded(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``x`` rounded to ``dtype`` and back to fp32: one op of PyTorch's in that dtype."""
    return cast_rne(x, dtype, INTERPRETED).to(tl.float32)


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cache_ptr, y_ptr,
    stride_xt, stride_xh, stride_xd,
    stride_yt, stride_yh,
    stride_cp, n_heads, half,
    INTERPRETED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # Program (token, head block): the token's cos/sin row is read once for BLOCK_H heads.
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask_i = offs_i < half
    mask = (offs_h < n_heads)[:, None] & mask_i[None, :]
    dtype = y_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = _rounded(tl.load(cache_ptr + pos * stride_cp + offs_i, mask=mask_i), dtype, INTERPRETED)[None, :]
    sin = _rounded(tl.load(cache_ptr + pos * stride_cp + half + offs_i, mask=mask_i), dtype, INTERPRETED)[None, :]
    first = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_i[None, :] * stride_xd
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + half * stride_xd, mask=mask).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
    y1 = _rounded(x1 * cos, dtype, INTERPRETED) - _rounded(x2 * sin, dtype, INTERPRETED)
    y2 = _rounded(x2 * cos, dtype, INTERPRETED) + _rounded(x1 * sin, dtype, INTERPRETED)
    out = y_ptr + t * stride_yt + offs_h[:, None] * stride_yh + offs_i[None, :]
    tl.store(out, cast_rne(y1, dtype, INTERPRETED), mask=mask)
    tl.store(out + half, cast_rne(y2, dtype, INTERPRETED), mask=mask)


# ------------------------------------------------------------------------------------ the cache
def rope_inv_freq(head_size: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """``1 / theta^(2i / D)`` for i < D/2, fp32: transformers' default RoPE (``rope_theta``)."""
    exponent = torch.arange(0, head_size, 2, dtype=torch.int64, device=device).to(torch.float32) / head_size
    return 1.0 / (theta ** exponent)


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """``[max_positions, D]`` fp32: cos of ``p * inv_freq`` in the first D/2 columns, sin in the last
    (each product one fp32 multiply, as transformers' ``inv_freq @ position_ids``)."""
    positions = torch.arange(max_positions, device=inv_freq.device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.to(torch.float32))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


# ------------------------------------------------------------------------------------ reference
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_ref(x, positions, cache):
    """transformers' ``apply_rotary_pos_emb`` on ``x [T, H, D]``, its cos/sin ``cat([f, f]).cos()``
    read from the cache at each token's position and cast to x's dtype."""
    cos, sin = cache[positions.long()].to(x.dtype).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], dim=-1)[:, None], torch.cat([sin, sin], dim=-1)[:, None]
    return x * cos + rotate_half(x) * sin


# -------------------------------------------------------------------------------------- wrapper
def _check_rotary_args(x, positions, cache):
    check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    if x.shape[2] % 2 or x.shape[2] == 0:
        raise ValueError(f"x's head size is {x.shape[2]}; allowed: a positive even number (its halves rotate)")
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=x.device)
    check_same("len(positions)", positions.numel(), x.shape[0], "length (T)")
    check_tensor("cos_sin_cache", cache, ndim=2, dtypes=(torch.float32,), device=x.device)
    check_same("cos_sin_cache.shape[1]", cache.shape[1], x.shape[2], "size (head size)")
    if cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must have contiguous rows, got strides {cache.stride()}")
    check_indices("positions", positions, cache.shape[0], "max_positions")


def apply_rotary_triton(x, positions, cache):
    T, H, D = x.shape
    y = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if y.numel():
        block_h, block_half = _blocks(H, D)
        _rotary_kernel[(T, triton.cdiv(H, block_h))](
            x, positions, cache, y, *x.stride(), y.stride(0), y.stride(1), cache.stride(0), H, D // 2,
            INTERPRETED=not x.is_cuda, BLOCK_H=block_h, BLOCK_HALF=block_half)
    return y


def _blocks(n_heads: int, head_size: int) -> tuple[int, int]:
    """(heads, pairs) per program: all of a head's D/2 pairs, and as many heads as fit MAX_TILE."""
    block_half = next_pow2(head_size // 2)
    return min(next_pow2(n_heads), max(1, MAX_TILE // block_half)), block_half


def aot_launches():
    """Every launch ``apply_rotary_triton`` can make on a GPU (``orca_lab.kernels.aot``): head sizes
    64, 80 and 128 (and 2, one pair), one head and many (a grouped model's K/V heads, its query
    heads, both of a fused QKV view), each float dtype, int64 positions; q and k as strided views
    of a fused QKV output."""
    from orca_lab.kernels.launches import launch, meta, strides
    cache = meta(4096, 128, dtype=torch.float32)
    for dtype in FLOAT_DTYPES:
        for heads, d in ((1, 128), (8, 128), (40, 128), (14, 64), (32, 80), (3, 2)):
            qkv = meta(7, (heads + 2) * d, dtype=dtype)[:, :heads * d].view(7, heads, d)
            y = meta(7, heads, d, dtype=dtype)
            block_h, block_half = _blocks(heads, d)
            yield launch(_rotary_kernel, f"{heads} heads of {d}, {dtype}", x_ptr=qkv,
                         pos_ptr=meta(7, dtype=torch.int64), cache_ptr=cache[:, :d], y_ptr=y,
                         **strides("stride_x", "thd", qkv), stride_yt=y.stride(0), stride_yh=y.stride(1),
                         stride_cp=d, n_heads=heads, half=d // 2, INTERPRETED=False,
                         BLOCK_H=block_h, BLOCK_HALF=block_half)


def apply_rotary(x, positions, cos_sin_cache, backend="auto", *, check=True):
    """``x [T, H, D]`` (queries or keys, any strides) rotated by the position of each of its tokens,
    ``positions [T]`` (int32/int64, each below ``cos_sin_cache.shape[0]``), with ``cos_sin_cache
    [max_positions, D]`` fp32 (``cos_sin_cache(rope_inv_freq(D, theta), max_positions)``). Returns a
    new contiguous ``[T, H, D]`` in x's dtype. ``check=False`` skips the argument checks (the engine's
    hot path, which built the arguments itself)."""
    if check:
        _check_rotary_args(x, positions, cos_sin_cache)
    if use_triton(backend, x):
        return apply_rotary_triton(x, positions, cos_sin_cache)
    return apply_rotary_ref(x, positions, cos_sin_cache)
