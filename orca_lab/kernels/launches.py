"""How a kernel module declares the launches its wrapper can make on a GPU, for ``aot.py`` to compile.

Each kernel module's ``aot_launches()`` yields one ``launch(kernel, what, **args)`` per case; example
tensors are ``meta`` tensors (shape, strides and dtype, no memory). This module imports no kernel
module, so the kernels and the compiler that discovers them import it without a cycle."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Launch:
    """One compile: a kernel with its argument types, constexprs and divisibility hints."""
    kernel: object                      # a triton JITFunction
    what: str                           # for people: which wrapper case this is
    signature: dict = field(hash=False)
    constexprs: dict = field(hash=False)
    attrs: dict = field(hash=False)
    num_warps: int = 4                  # Triton's defaults for a launch that names neither
    num_stages: int = 3
    quick: bool = True                  # in the quick check (CI); False: only with --full
    family: str = ""                    # CI compiles the default and widest tiles of each family
    min_arch: int = 0                   # launched on sm_<min_arch> and later only (e.g. 90: the TMA)

    @property
    def name(self) -> str:
        return f"{self.kernel.fn.__module__}.{self.kernel.fn.__name__}"

    @property
    def key(self) -> tuple:
        """Two launches with equal keys compile to the same cubin."""
        return (self.name, tuple(self.signature.items()), tuple((k, str(v)) for k, v in self.constexprs.items()),
                tuple(sorted(self.attrs)), self.num_warps, self.num_stages)


def meta(*shape, dtype=torch.float32) -> torch.Tensor:
    """An example tensor argument: shape, strides and dtype, no memory."""
    return torch.empty(shape, dtype=dtype, device="meta")


def strides(prefix: str, letters: str, t: torch.Tensor) -> dict:
    """``{prefix + letter: stride}`` for each dimension of ``t``: ``strides("stride_q", "thd", q)``."""
    return {prefix + c: s for c, s in zip(letters, t.stride(), strict=True)}


def launch(kernel, what: str, *, num_warps: int = 4, num_stages: int = 3, quick: bool = True,
           family: str = "", min_arch: int = 0, **args) -> Launch:
    """``kernel`` launched with ``args`` (every parameter by name) and ``num_warps``/``num_stages`` (they
    change the code and its shared memory), typed as Triton's launcher types it. ``quick=False``
    leaves it to ``--full``; a ``family`` (e.g. "group 8") gets its own default and widest compile in
    CI's subset, beside those of the kernel's other launches; ``min_arch``: compiled for that compute
    capability and later only (the wrapper launches it nowhere else)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    missing = [p.name for p in kernel.params if p.name not in args]
    extra = sorted(set(args) - {p.name for p in kernel.params})
    if missing or extra:
        raise TypeError(f"launch of {kernel.fn.__name__}: missing arguments {missing}, unknown {extra}")
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = args[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        ty, spec = native_specialize_impl(CUDABackend, value, p.is_const, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        signature[p.name] = ty
        if ty == "constexpr":          # an int equal to 1 becomes a constant, as at a real launch
            constexprs[p.name] = spec
        elif isinstance(spec, str) and CUDABackend.parse_attr(spec):
            attrs[(i,)] = CUDABackend.parse_attr(spec)
    return Launch(kernel, what, signature, constexprs, attrs, num_warps, num_stages, quick, family, min_arch)

