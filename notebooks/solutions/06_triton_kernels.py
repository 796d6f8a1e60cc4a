"""Solutions of notebook 06_triton_kernels, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: online_softmax_block
import triton
import triton.language as tl


@triton.jit
def step(m, l, acc, s, v):
    """One block of keys: returns the new (m, l, acc)."""
    m_new = tl.maximum(m, tl.max(s, 0))
    alpha = tl.exp(m - m_new)             # what was summed under the old maximum, rescaled
    p = tl.exp(s - m_new)                 # 0 past the last key (its score is -inf)
    return m_new, l * alpha + tl.sum(p, 0), acc * alpha + tl.sum(p[:, None] * v, 0)


# %% exercise: online_attention
def online_attention(scores, values, block):
    m, l, acc = float("-inf"), 0.0, torch.zeros(values.shape[1])
    for s, v in zip(scores.split(block), values.split(block)):
        m_new = max(m, s.max().item())
        p = torch.exp(s - m_new)
        alpha = math.exp(m - m_new)
        l, acc, m = l * alpha + p.sum().item(), acc * alpha + p @ v, m_new
    return acc / l
