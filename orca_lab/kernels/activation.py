"""SiLU-and-multiply: the activation of a SwiGLU MLP (Llama, Qwen2), ``silu(gate) * up``.

    silu_and_mul(x) -> y        x [..., 2I] = [gate | up], y [..., I]

Layout: ``x`` is the output of one fused gate-up projection, the gate in its first half and the up
projection in its second (the weight ``cat([gate_proj.weight, up_proj.weight])``, vLLM's
``MergedColumnParallelLinear`` layout), so an MLP makes one matmul for both, and this kernel reads
each token's two halves once and writes I values, where PyTorch's ``silu`` and ``*`` read and write
the activations twice. Under tensor parallelism each rank's shard holds its own gate and up columns
side by side in the same layout. The rounding follows transformers' ``act_fn(gate) * up``: silu
rounded to x's dtype, then the product rounded again.
"""
import torch
import torch.nn.functional as F

from orca_lab.kernels._backend import FLOAT_DTYPES, cast_rne, check_tensor, next_pow2, use_triton

import triton  # noqa: E402  (after _backend, which sets TRITON_INTERPRET on CPU-only machines)
import triton.language as tl  # noqa: E402

# Columns of one output row per program (the tail is masked).
MAX_BLOCK = 1024


# --------------------------------------------------------------------------------------- kernel
@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, n_cols, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
    # Program (row, chunk): x is contiguous [rows, 2 * n_cols], y contiguous [rows, n_cols].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    # silu(g) = g * sigmoid(g) (no libdevice: the interpreter cannot run it); exp(-g) overflowing to
    # inf for g < -88 gives sigmoid 0, the right limit
    act = cast_rne(gate * tl.sigmoid(gate), dtype, INTERPRETED).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, cast_rne(act * up, dtype, INTERPRETED), mask=mask)


# ------------------------------------------------------------------------------------ reference
def silu_and_mul_ref(x):
    """transformers' ``LlamaMLP``: ``act_fn(gate_proj(x)) * up_proj(x)``, on the fused halves."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# -------------------------------------------------------------------------------------- wrapper
def _check_silu_and_mul_args(x):
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must have a non-empty, even last dimension ([gate | up]), got shape {tuple(x.shape)}")


def silu_and_mul_triton(x):
    x = x.contiguous()
    n_cols = x.shape[-1] // 2
    y = x.new_empty((*x.shape[:-1], n_cols))
    if y.numel():
        block = _block(n_cols)
        _silu_and_mul_kernel[(y.numel() // n_cols, triton.cdiv(n_cols, block))](
            x, y, n_cols, INTERPRETED=not x.is_cuda, BLOCK=block)
    return y


def _block(n_cols: int) -> int:
    """The whole output row up to MAX_BLOCK, at least one column per thread of the default 4 warps."""
    return min(next_pow2(n_cols, 128), MAX_BLOCK)


def aot_launches():
    """Every launch ``silu_and_mul_triton`` can make on a GPU (``orca_lab.kernels.aot``): the block
    sizes (an MLP's widths are past MAX_BLOCK: Llama-3-8B's 14336, Qwen2.5-0.5B's 4864; small test
    models' below it), widths divisible by 16 and not, each float dtype."""
    from orca_lab.kernels.launches import launch, meta
    for dtype in FLOAT_DTYPES:
        for n_cols in (14336, 4864, 1037, 64, 5):
            x, y = meta(3, 2 * n_cols, dtype=dtype), meta(3, n_cols, dtype=dtype)
            yield launch(_silu_and_mul_kernel, f"{n_cols} columns, {dtype}", x_ptr=x, y_ptr=y, n_cols=n_cols,
                         INTERPRETED=False, BLOCK=_block(n_cols))


def silu_and_mul(x, backend="auto", *, check=True):
    """``silu(gate) * up`` of ``x [..., 2I] = [gate | up]`` (the fused gate-up projection's output),
    ``[..., I]`` in x's dtype. ``check=False`` skips the argument checks (the engine's hot path)."""
    if check:
        _check_silu_and_mul_args(x)
    if use_triton(backend, x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
