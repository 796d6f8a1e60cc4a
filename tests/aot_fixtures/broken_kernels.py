"""A kernel the interpreter runs and the GPU compiler refuses: a tl.dot with an inner dimension of 8."""
import torch
import triton
import triton.language as tl


@triton.jit
def _dot_k8(a_ptr, b_ptr, c_ptr, K: tl.constexpr):
    rows, inner = tl.arange(0, 16), tl.arange(0, K)
    a = tl.load(a_ptr + rows[:, None] * K + inner[None, :])
    b = tl.load(b_ptr + inner[:, None] * 16 + rows[None, :])
    tl.store(c_ptr + rows[:, None] * 16 + rows[None, :], tl.dot(a, b))


def aot_launches():
    from orca_lab.kernels.launches import launch, meta
    yield launch(_dot_k8, "inner dimension 8", a_ptr=meta(128, dtype=torch.float16),
                 b_ptr=meta(128, dtype=torch.float16), c_ptr=meta(256), K=8)


def interpreted_error() -> float:
    """Run it in the interpreter: its largest error against a @ b."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 8, generator=g).half(), torch.randn(8, 16, generator=g).half()
    c = torch.empty(16, 16)
    _dot_k8[(1,)](a, b, c, K=8)
    return (c - a.float() @ b.float()).abs().max().item()
