"""Pure tensor functions for selective batching (docs/design.md, layer 2).

One file per op, each holding the Triton kernel, a plain PyTorch reference and the public wrapper
that picks one. ``backend`` is ``"torch"``, ``"triton"`` or ``"auto"`` (Triton on GPU, PyTorch on CPU).
The Llama family's ops (RMSNorm, SiLU-and-multiply, rotary embeddings; grouped-query attention is
``ragged_attention`` with pools of fewer heads than q) live beside GPT's. No engine imports here. ``_backend`` is imported first: on a machine without a GPU it turns on
Triton's interpreter before any kernel is decorated.

A module with a launched ``@triton.jit`` kernel also defines ``aot_launches()``: every (argument
types, constexprs) its wrapper can launch on a GPU, built with ``aot.launch`` from the same
block-size helpers the wrapper calls. ``python -m orca_lab.kernels.aot`` (tests/test_kernels_aot.py)
compiles them all for sm_80 and sm_90 without a GPU and checks their shared memory; a kernel
without declared launches fails that check (orca_lab/kernels/aot.py says how to declare them).
"""
from orca_lab.kernels._backend import BACKENDS
from orca_lab.kernels.activation import silu_and_mul
from orca_lab.kernels.attention import ragged_attention
from orca_lab.kernels.gelu import bias_gelu
from orca_lab.kernels.kv_write import write_kv
from orca_lab.kernels.layernorm import layer_norm
from orca_lab.kernels.rmsnorm import rms_norm
from orca_lab.kernels.rotary import apply_rotary, cos_sin_cache, rope_inv_freq

__all__ = ["BACKENDS", "apply_rotary", "bias_gelu", "cos_sin_cache", "layer_norm", "ragged_attention",
           "rms_norm", "rope_inv_freq", "silu_and_mul", "write_kv"]
