"""LayerNorm over the rows of ``[T, H]``, optionally fused with the residual add before it.

Selective batching runs LayerNorm on the flattened ``[sum L, H]`` tokens of all requests at once
(ORCA §3). Fusing ``x + residual`` into the same pass saves one read and one write of the activations,
which is all a memory-bound op costs.
"""
from itertools import product

import torch
import torch.nn.functional as F

from orca_lab.kernels._backend import (FLOAT_DTYPES, cast_rne, check_same, check_tensor, next_pow2,
                                       use_triton)

import triton  # noqa: E402  (after _backend, which sets TRITON_INTERPRET on CPU-only machines)
import triton.language as tl  # noqa: E402

# Columns per chunk: a row of up to this many elements is held in registers in one pass.
MAX_BLOCK = 8192


# --------------------------------------------------------------------------------------- kernel
@triton.jit
def _load_chunk(x_ptr, res_ptr, cols, mask, HAS_RESIDUAL: tl.constexpr,
                INTERPRETED: tl.constexpr):
    """One chunk of the row (x + residual) in fp32, rounded to x's dtype as the caller receives it."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + cols, mask=mask, other=0.0)
        x = cast_rne(x.to(tl.float32) + r.to(tl.float32), x.dtype, INTERPRETED)
    return x.to(tl.float32)


@triton.jit
def _layer_norm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, sum_ptr,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per row; rows are contiguous, n_cols long. Statistics in fp32. A row longer than
    # BLOCK is walked in chunks; the re-reads of passes 2 and 3 come from cache, not memory. They
    # recompute x + residual rather than read back the stored sum: no store-then-load ordering
    # between the program's threads to worry about.
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * n_cols
    res_ptr += row * n_cols
    y_ptr += row * n_cols
    sum_ptr += row * n_cols

    # Pass 1: the mean; x + residual is stored for the caller's next residual add.
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = _load_chunk(x_ptr, res_ptr, cols, mask, HAS_RESIDUAL, INTERPRETED)
        if HAS_RESIDUAL:
            tl.store(sum_ptr + cols, x.to(sum_ptr.dtype.element_ty), mask=mask)  # exact: rounded
        acc += x
    mean = tl.sum(acc, 0) / n_cols

    # Pass 2: the variance around the mean (sum of squares minus mean^2 would cancel badly).
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = _load_chunk(x_ptr, res_ptr, cols, mask, HAS_RESIDUAL, INTERPRETED)
        diff = tl.where(mask, x - mean, 0.0)
        acc += diff * diff
    rstd = 1.0 / tl.sqrt(tl.sum(acc, 0) / n_cols + eps)

    # Pass 3: normalize, scale and shift.
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = _load_chunk(x_ptr, res_ptr, cols, mask, HAS_RESIDUAL, INTERPRETED)
        w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=mask).to(tl.float32)
        y = (x - mean) * rstd * w + b
        tl.store(y_ptr + cols, cast_rne(y, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)


# ------------------------------------------------------------------------------------ reference
def layer_norm_ref(x, weight, bias, eps=1e-5, residual=None):
    if residual is not None:
        x = x + residual
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps), x
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


# -------------------------------------------------------------------------------------- wrapper
def _check_layer_norm_args(x, weight, bias, eps, residual):
    check_norm_args(x, eps, residual, weight=weight, bias=bias)


def check_norm_args(x, eps, residual, **params):
    """A norm's arguments (LayerNorm's, RMSNorm's): rows ``x [..., H]``, each of ``params`` ``[H]`` in
    x's dtype, ``residual`` (or None) shaped as x, ``eps > 0``."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    for name, p in params.items():
        check_tensor(name, p, ndim=1, dtypes=(x.dtype,), device=x.device)
        check_same(f"{name}.shape[0]", p.shape[0], x.shape[-1], "size (x.shape[-1])")
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), device=x.device)
        check_same("residual.shape", tuple(residual.shape), tuple(x.shape), "value (x.shape)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")


def layer_norm_triton(x, weight, bias, eps, residual=None):
    n_cols = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    has_res = residual is not None
    total = torch.empty_like(x) if has_res else x  # x + residual; unused (never written) without one
    res = residual.contiguous() if has_res else x
    if x.numel():
        _layer_norm_kernel[(x.numel() // n_cols,)](
            x, res, weight, bias, y, total, n_cols, float(eps),
            HAS_RESIDUAL=has_res, INTERPRETED=not x.is_cuda, BLOCK=_block(n_cols),
        )
    return (y, total) if has_res else y


def _block(n_cols: int) -> int:
    """Columns per chunk: the whole row when it fits, else chunks of MAX_BLOCK; at least one per
    thread of the default 4 warps (a smaller block would leave threads idle; the tail is masked)."""
    return min(next_pow2(n_cols, 128), MAX_BLOCK)


def aot_launches():
    """Every launch ``layer_norm_triton`` can make on a GPU (``orca_lab.kernels.aot``): each width class
    of ``aot_widths``, with and without the residual."""
    from orca_lab.kernels.launches import launch, meta
    for (dtype, n_cols), has_res in product(aot_widths(), (False, True)):
        x = meta(4, n_cols, dtype=dtype)
        yield launch(_layer_norm_kernel, f"{n_cols} columns, residual={has_res}, {dtype}",
                     x_ptr=x, res_ptr=x, w_ptr=x, b_ptr=x, y_ptr=x, sum_ptr=x, n_cols=n_cols,
                     eps=1e-5, HAS_RESIDUAL=has_res, INTERPRETED=False, BLOCK=_block(n_cols))


def aot_widths():
    """(dtype, row width) pairs whose norm launches compile differently: each chunk size (rows of 1 to
    past MAX_BLOCK columns); fp16 widths divisible by 16 and not, fp32 and bf16 the divisible ones
    (vectorized loads), which stand for the rest: the dtype changes only the type loaded and stored."""
    widths = sorted({w for b in range(15) for w in (1 << b, (1 << b) - 1, 3 << b)} - {0})
    return [(dtype, w) for dtype in FLOAT_DTYPES for w in widths
            if w <= 2 * MAX_BLOCK and (dtype == torch.float16 or w % 16 == 0)]


def layer_norm(x, weight, bias, eps=1e-5, residual=None, backend="auto", *, check=True):
    """``LN(x)``, or with ``residual`` given, ``(LN(x + residual), x + residual)``. ``check=False``
    skips the argument checks (the engine's hot path, which built the arguments itself)."""
    if check:
        _check_layer_norm_args(x, weight, bias, eps, residual)
    if use_triton(backend, x):
        return layer_norm_triton(x, weight, bias, eps, residual)
    return layer_norm_ref(x, weight, bias, eps, residual)
