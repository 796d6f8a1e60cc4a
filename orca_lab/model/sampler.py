"""Next-token choice from the last-token logits: greedy, or temperature / top-k / top-p under a seed."""
import secrets

import torch

from orca_lab.model import logprobs, penalties


def sample(logits: torch.Tensor, batch) -> list[int | None]:
    """One token per request of ``batch`` that yields one (``Batch.yields``), None for the others.
    Greedy rows share one argmax; sampled rows use their own generator, and only a row that yields
    draws from it, so a request draws the same tokens whatever it is batched with and however its
    prompt is chunked (vLLM and SGLang do not sample a partial prefill either). A request's own
    fields shape its row first (``penalties.py``); the log-probabilities a request asks for are read
    from the raw ``logits`` (``logprobs.py``)."""
    raw, logits = logits, penalties.shape(logits, batch)
    tokens = logits.argmax(-1).tolist()
    for i, (req, yields) in enumerate(zip(batch.requests, batch.yields)):
        if not yields:
            tokens[i] = None
        elif not req.params.greedy:
            tokens[i] = _draw(logits[i].float(), req)
    logprobs.record_sampled(raw, batch, tokens)
    return tokens


def _draw(logits: torch.Tensor, req) -> int:
    """vLLM's order: temperature, then top-k, then top-p (the smallest set of most likely tokens
    whose probability reaches top_p; the most likely token is always kept)."""
    p = req.params
    logits = logits / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p    # mass before it already reaches top_p
        outside[0] = False      # (a top_p below float32's least positive number compares as 0 here)
        probs = probs.index_fill(0, order[outside], 0.0)
    if req.generator is None:
        req.generator = torch.Generator().manual_seed(p.seed if p.seed is not None else fresh_seed())
    return int(torch.multinomial(probs.cpu(), 1, generator=req.generator))


def fresh_seed() -> int:
    """A seed from the OS's entropy for a request that gave none: two runs of one prompt draw
    different tokens (vLLM's and torch's default), in this process or in a worker's."""
    return secrets.randbits(63)
