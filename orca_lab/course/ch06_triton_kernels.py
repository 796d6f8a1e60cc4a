"""Chapter 06, Triton kernels: the grader of one block of the online softmax, in the package's
one-query kernel (``online_softmax.py``)."""
from __future__ import annotations

import torch

from orca_lab import kernels
from orca_lab.course import bounded
from orca_lab.course.bounded import describe, refuse_package_code, run_bounded
from orca_lab.course.ch01_generation_and_kv_cache import one_request
from orca_lab.course.forked import grader
from orca_lab.course.harness import correct, differ

import triton  # noqa: E402  (after orca_lab.kernels, which sets TRITON_INTERPRET where there is no GPU)
import triton.language as tl  # noqa: E402


@triton.jit
def _update(m_i, l_i, acc, s, v):
    """The package's step (what a learner's is refused for being): one block's scores ``s [BLOCK]``
    (-inf past the end), values ``v [BLOCK, D]``; the running maximum, sum and weighted sum so far."""
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp(m_i - m_new)               # rescales what was summed under the old maximum
    p = tl.exp(s - m_new)
    return m_new, l_i * alpha + tl.sum(p, 0), acc * alpha + tl.sum(p[:, None] * v, 0)


@grader
def check_online_softmax(step, seed: int = 0, device=None):
    """The learner's ``@triton.jit step(m, l, acc, s, v)`` in the package's one-query kernel
    (``online_softmax.py``), against ``kernels.ragged_attention``'s reference, on random sizes."""
    from orca_lab.course.online_softmax import attend_one_query
    refuse_package_code(step, _update)
    g = torch.Generator().manual_seed(seed)
    device = device or torch.get_default_device()
    cases = [(n, d, block) for n in (1, 5, 16, 37) for d in (4, 16) for block in (4, 16)]
    for case, (n, d, block) in enumerate(cases):
        # drawn on the CPU (notebook 06 may make CUDA the default device), then moved
        q, k, v = (torch.randn(*shape, generator=g, device="cpu") for shape in ((d,), (n, d), (n, d)))
        k[n // 2] += 4 * q          # a score much larger than the rest, past the first block: m must grow
        q, k, v = q.to(device), k.to(device), v.to(device)
        label = f"case {case} (n={n} keys, d={d}, block={block})"
        got = run_bounded(attend_one_query, q, k, v, block, step, case=label, timeout_s=10 * bounded.TIMEOUT_S,
                          references=(_update,), what=f"{describe(step)} (run over the key blocks)",
                          progress="the kernel calls your step once per block of keys; a step only updates m, l "
                                   "and acc (under the interpreter a step costs milliseconds)")
        ref = kernels.ragged_attention(q[None, None], k[:, None], v[:, None], torch.arange(n, device=device),
                                       one_request(1, device), one_request(n, device), backend="torch")[0, 0]
        if not torch.allclose(got, ref, atol=1e-4, rtol=1e-4):
            differ("the attention output", label, ref.tolist(),
                   got.tolist(), "when m grows, rescale l and acc by exp(m_old - m_new)")
    correct(len(cases), "orca_lab.kernels.ragged_attention (reference)")
