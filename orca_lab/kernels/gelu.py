"""Bias add fused with GeLU (tanh approximation, as GPT-2).

The first MLP matmul's bias add and the GeLU after it are both elementwise: one kernel reads the
activations once and writes them once, where PyTorch's two ops read and write them twice (ORCA §3).
"""
import math

import torch
import torch.nn.functional as F

from orca_lab.kernels._backend import FLOAT_DTYPES, cast_rne, check_same, check_tensor, use_triton

import triton  # noqa: E402  (after _backend, which sets TRITON_INTERPRET on CPU-only machines)
import triton.language as tl  # noqa: E402

BLOCK = 1024
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# --------------------------------------------------------------------------------------- kernel
@triton.jit
def _bias_gelu_kernel(x_ptr, bias_ptr, y_ptr, n_elements, n_cols, c0,
                      INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
    # x is contiguous [rows, n_cols]; each program takes BLOCK consecutive elements of it.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    u = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    u += tl.load(bias_ptr + offs % n_cols, mask=mask).to(tl.float32)
    # gelu(u) = 0.5 u (1 + tanh(z)), z = sqrt(2/pi) (u + 0.044715 u^3). libdevice's tanh does not
    # run in the interpreter; with tanh(z) = 2 sigmoid(2z) - 1 the whole thing is u * sigmoid(2z).
    # 2z is kept above -80 so exp(-2z) cannot overflow fp32; gelu there is below 1e-33 anyway.
    z = c0 * (u + 0.044715 * u * u * u)
    y = u * tl.sigmoid(tl.maximum(2.0 * z, -80.0))
    tl.store(y_ptr + offs, cast_rne(y, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)


# ------------------------------------------------------------------------------------ reference
def bias_gelu_ref(x, bias):
    return F.gelu(x + bias, approximate="tanh")


# -------------------------------------------------------------------------------------- wrapper
def _check_bias_gelu_args(x, bias):
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), device=x.device)
    check_same("bias.shape[0]", bias.shape[0], x.shape[-1], "size (x.shape[-1])")


def bias_gelu_triton(x, bias):
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _bias_gelu_kernel[(triton.cdiv(n, BLOCK),)](x, bias, y, n, x.shape[-1], SQRT_2_OVER_PI,
                                                     INTERPRETED=not x.is_cuda, BLOCK=BLOCK)
    return y


def aot_launches():
    """Every launch ``bias_gelu_triton`` can make on a GPU (``orca_lab.kernels.aot``): one block size,
    widths divisible by 16 or not, each float dtype."""
    from orca_lab.kernels.launches import launch, meta
    for dtype in FLOAT_DTYPES:
        for n_cols in (3072, 1037):
            x = meta(5, n_cols, dtype=dtype)
            yield launch(_bias_gelu_kernel, f"{n_cols} columns, {dtype}", x_ptr=x, bias_ptr=x, y_ptr=x,
                         n_elements=x.numel(), n_cols=n_cols, c0=SQRT_2_OVER_PI, INTERPRETED=False,
                         BLOCK=BLOCK)


def bias_gelu(x, bias, backend="auto", *, check=True):
    """``gelu_tanh(x + bias)`` over ``x [T, F]``, ``bias [F]``. ``check=False`` skips the argument
    checks (the engine's hot path, which built the arguments itself)."""
    if check:
        _check_bias_gelu_args(x, bias)
    if use_triton(backend, x):
        return bias_gelu_triton(x, bias)
    return bias_gelu_ref(x, bias)
