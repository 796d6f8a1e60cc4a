"""What every op wrapper shares: the backend choice and the argument checks.

Importing this module before ``triton`` matters: without a GPU, Triton can only run its kernels in
the interpreter, and ``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a function. Setting
it here (unless the caller already chose) lets ``backend="triton"`` work on a CPU-only machine.

The choice must not touch CUDA: even ``torch.cuda.is_available()`` initializes the driver, and a
process that did so before forking leaves every forked child unable to use CUDA ("Cannot
re-initialize CUDA in forked subprocess"). So it asks only whether this torch was built with CUDA and
whether the node shows an NVIDIA device file, neither of which loads the driver.
"""
import glob
import os

import torch


def gpu_visible() -> bool:
    """A CUDA build of torch on a node with an NVIDIA GPU not hidden by ``CUDA_VISIBLE_DEVICES``,
    decided without initializing CUDA (safe at import time and before a fork)."""
    if torch.version.cuda is None or os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


if not gpu_visible():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (only now: the interpreter choice above must come first)
import triton.language as tl  # noqa: E402

BACKENDS = ("auto", "torch", "triton")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def use_triton(backend: str, x: torch.Tensor) -> bool:
    """True when the op should run its Triton kernel: asked for, or "auto" on a GPU tensor."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    return backend == "triton" or (backend == "auto" and x.is_cuda)


def next_pow2(n: int, minimum: int = 1) -> int:
    """Triton blocks have power-of-two sizes: the tail of an odd size is masked inside the kernel."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name, t, *, ndim=None, dtypes=None, device=None):
    """Refuse anything but a tensor with the given rank, dtype and device, naming the argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; allowed: {_names(dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, but must be on {device} like the other inputs")


def check_same(name, value, expected, what):
    """``value == expected`` or a ValueError saying which property of ``name`` is off."""
    if value != expected:
        raise ValueError(f"{name} has {what} {value}, expected {expected}")


def check_indices(name, idx: torch.Tensor, n: int, n_name: str):
    """Every entry of ``idx`` in ``[0, n)``: an out-of-range slot would read or write foreign memory.

    One reduction and one device-to-host copy, so cheap enough to do before every launch.
    """
    if idx.numel() == 0:
        return
    lo, hi = torch.aminmax(idx)
    lo, hi = torch.stack([lo, hi]).tolist()
    if lo < 0 or hi >= n:
        raise ValueError(f"{name} holds values in [{lo}, {hi}], allowed [0, {n_name}={n})")


@triton.jit
def cast_rne(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``x.to(dtype)`` rounded to nearest even, as a GPU does.

    The interpreter truncates fp32 -> bf16 instead (up to a whole bf16 ulp of error, twice what
    PyTorch makes), so there the rounding is done on the fp32 bits first and the truncation that
    follows is exact. Kernels pass ``INTERPRETED=not x.is_cuda``; on a GPU this is a plain cast.
    """
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
