"""RMSNorm over the rows of ``[T, H]`` (Llama's norm), optionally fused with the residual add before it.

    rms_norm(x, weight, eps=1e-6, residual=None) -> y, or (y, x + residual) with a residual

The math is transformers' ``LlamaRMSNorm``: the mean of squares in fp32, ``x * rsqrt(mean + eps)``
rounded to x's dtype, then multiplied by the weight in that dtype (two roundings, as there, so a bf16
model's outputs match it). No mean is subtracted and there is no bias, so it takes two passes over a
row, not LayerNorm's three; the chunked walk over the row and the residual fusion are LayerNorm's
(``layernorm._load_chunk``): selective batching runs it on the flattened tokens of all requests.
"""
from itertools import product

import torch

from orca_lab.kernels._backend import cast_rne, use_triton
from orca_lab.kernels.layernorm import _block, _load_chunk, aot_widths, check_norm_args

import triton  # noqa: E402  (after _backend, which sets TRITON_INTERPRET on CPU-only machines)
import triton.language as tl  # noqa: E402


# --------------------------------------------------------------------------------------- kernel
@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per contiguous row of n_cols; statistics in fp32; a row longer than BLOCK is walked
    # in chunks, pass 2 re-reading them from cache (as LayerNorm's kernel, which says why).
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * n_cols
    res_ptr += row * n_cols
    y_ptr += row * n_cols
    sum_ptr += row * n_cols

    # Pass 1: the mean of squares; x + residual is stored for the caller's next residual add.
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = _load_chunk(x_ptr, res_ptr, cols, mask, HAS_RESIDUAL, INTERPRETED)
        if HAS_RESIDUAL:
            tl.store(sum_ptr + cols, x.to(sum_ptr.dtype.element_ty), mask=mask)  # exact: rounded
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, 0) / n_cols + eps)

    # Pass 2: normalize and round to the input dtype, then scale (transformers' order of roundings).
    dtype = y_ptr.dtype.element_ty
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = _load_chunk(x_ptr, res_ptr, cols, mask, HAS_RESIDUAL, INTERPRETED)
        w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
        y = cast_rne(x * rstd, dtype, INTERPRETED).to(tl.float32) * w
        tl.store(y_ptr + cols, cast_rne(y, dtype, INTERPRETED), mask=mask)


# ------------------------------------------------------------------------------------ reference
def rms_norm_ref(x, weight, eps=1e-6, residual=None):
    """transformers' ``LlamaRMSNorm.forward``, line for line (tests/test_kernels_llama.py compares)."""
    if residual is not None:
        x = x + residual
        return rms_norm_ref(x, weight, eps), x
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


# -------------------------------------------------------------------------------------- wrapper
def rms_norm_triton(x, weight, eps, residual=None):
    n_cols = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    has_res = residual is not None
    total = torch.empty_like(x) if has_res else x  # x + residual; unused (never written) without one
    res = residual.contiguous() if has_res else x
    if x.numel():
        _rms_norm_kernel[(x.numel() // n_cols,)](
            x, res, weight, y, total, n_cols, float(eps),
            HAS_RESIDUAL=has_res, INTERPRETED=not x.is_cuda, BLOCK=_block(n_cols),
        )
    return (y, total) if has_res else y


def aot_launches():
    """Every launch ``rms_norm_triton`` can make on a GPU (``orca_lab.kernels.aot``): LayerNorm's width
    classes (``layernorm.aot_widths``), with and without the residual."""
    from orca_lab.kernels.launches import launch, meta
    for (dtype, n_cols), has_res in product(aot_widths(), (False, True)):
        x = meta(4, n_cols, dtype=dtype)
        yield launch(_rms_norm_kernel, f"{n_cols} columns, residual={has_res}, {dtype}",
                     x_ptr=x, res_ptr=x, w_ptr=x, y_ptr=x, sum_ptr=x, n_cols=n_cols, eps=1e-6,
                     HAS_RESIDUAL=has_res, INTERPRETED=False, BLOCK=_block(n_cols))


def rms_norm(x, weight, eps=1e-6, residual=None, backend="auto", *, check=True):
    """``RMSNorm(x) * weight`` over the last dimension, or with ``residual`` given,
    ``(RMSNorm(x + residual) * weight, x + residual)``. ``weight [H]`` in x's dtype. ``check=False``
    skips the argument checks (the engine's hot path, which built the arguments itself)."""
    if check:
        check_norm_args(x, eps, residual, weight=weight)
    if use_triton(backend, x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
