"""Chapter 01, generation and the K/V cache: the graders of its exercise (attention over a cache
that grows by the new tokens' K/V)."""
from __future__ import annotations

import torch

from orca_lab import kernels
from orca_lab.course.bounded import plain_tensor, refuse_package_code, run_bounded
from orca_lab.course.forked import grader
from orca_lab.course.harness import N_CASES, check_by_hand, correct, differ, read, same_kind
from orca_lab.kernels.attention import ragged_attention_ref, ragged_attention_torch
from orca_lab.workload import TraceItem


def one_request(n: int, device="cpu") -> torch.Tensor:
    """``cu_seqlens`` of a batch of one request with ``n`` rows."""
    return torch.tensor([0, n], dtype=torch.int32, device=device)


def _three_tensors(got):
    out, k, v = got
    return plain_tensor(out), plain_tensor(k), plain_tensor(v)


@grader
def check_cached_attention(fn, seed: int = 0):
    """``fn(q_new, k_cache, v_cache, k_new, v_new) -> (out, k_cache, v_cache)``: the new tokens'
    attention over the cache and themselves, and the cache grown by their K/V; graded against
    ``kernels.ragged_attention``'s reference for one request."""
    refs = (kernels.ragged_attention, ragged_attention_ref, ragged_attention_torch)
    refuse_package_code(fn, *refs)
    g = torch.Generator().manual_seed(seed)
    for case in range(N_CASES):
        n_cached, n_new, d = case % 7, 1 + case % 3, 4 + 2 * (case % 5)
        q, k_new, v_new = (torch.randn(n_new, d, generator=g) for _ in range(3))
        k_cache, v_cache = (torch.randn(n_cached, d, generator=g) for _ in range(2))
        label = f"case {case} ({n_cached} cached tokens, {n_new} new, d={d})"
        got = run_bounded(fn, q, k_cache, v_cache, k_new, v_new, case=label, references=refs)
        out, k_all, v_all = read("the answer", label, got, _three_tensors, "(out, k_cache, v_cache): three tensors")
        k_ref, v_ref = torch.cat([k_cache, k_new]), torch.cat([v_cache, v_new])
        ref = kernels.ragged_attention(q[:, None], k_ref[:, None], v_ref[:, None], torch.arange(len(k_ref)),
                                       one_request(n_new), one_request(len(k_ref)), backend="torch")[:, 0]
        for name, mine, want in (("k_cache", k_all, k_ref), ("v_cache", v_all, v_ref), ("the output", out, ref)):
            same_kind(name, label, want, mine)
        if not torch.equal(k_all, k_ref) or not torch.equal(v_all, v_ref):
            differ("the grown cache", label, f"k_cache then k_new: shape {tuple(k_ref.shape)}",
                   f"shape {tuple(k_all.shape)}", "the cached rows first, then the new ones, in one tensor")
        if out.shape != ref.shape or not torch.allclose(out, ref, atol=1e-5):
            differ("the output", label, ref, out, "each new query sees the cache and the new tokens up to itself")
    correct(N_CASES, "orca_lab.kernels.ragged_attention (reference)")


def check_rows(rows_without_cache, rows_with_cache, llm, prompt, n_gen: int):
    """Notebook 01's by-hand count, measured by ``llm``'s engine: the rows its iterations compute to
    generate ``n_gen`` tokens from ``prompt`` with the K/V cache (one run), and without it (a run per
    token, each over the whole sequence so far). A wrong count is named with its hint, never the
    measured one (the exercise's answer)."""
    def rows(prompt_len: int, n: int) -> int:
        item = TraceItem(arrival=0.0, prompt=(0,) * prompt_len, max_gen_tokens=n)
        return sum(it.n_tokens for it in llm.serve([item]).iterations)

    prompt_len = len(prompt)
    check_by_hand(f"a {prompt_len}-token prompt generating {n_gen} tokens", {
        "rows_without_cache": (rows_without_cache, sum(rows(prompt_len + i, 1) for i in range(n_gen)),
                               "each step without the cache runs the whole sequence so far, which grows by one"),
        "rows_with_cache": (rows_with_cache, rows(prompt_len, n_gen),
                            "with the cache the prompt runs once, then each later step runs its one new token")})
    print(f"correct: {rows_without_cache} rows without the cache, {rows_with_cache} with it")
