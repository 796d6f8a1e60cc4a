"""A launched kernel whose module declares no launches: the ahead-of-time check must refuse it."""
import triton
import triton.language as tl


@triton.jit
def _scaled(x, factor):
    return x * factor


@triton.jit
def _undeclared_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, _scaled(tl.load(x_ptr + offs, mask=offs < n), 2.0), mask=offs < n)
