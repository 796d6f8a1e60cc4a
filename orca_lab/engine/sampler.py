"""Next-token choice from the last-token logits: greedy, or temperature / top-k / top-p under a seed."""
import torch


def sample(logits: torch.Tensor, requests) -> list[int]:
    """One token per request; greedy rows share one argmax, sampled rows use their own generator
    so a request draws the same tokens whatever it is batched with."""
    tokens = logits.argmax(-1).tolist()
    for i, req in enumerate(requests):
        if not req.params.greedy:
            tokens[i] = _draw(logits[i].float(), req)
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
        probs = probs.index_fill(0, order[outside], 0.0)
    if req.generator is None:
        req.generator = torch.Generator().manual_seed(p.seed if p.seed is not None else req.rid)
    return int(torch.multinomial(probs.cpu(), 1, generator=req.generator))
