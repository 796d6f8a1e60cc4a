"""Next-token choice from the last-token logits: greedy, or temperature / top-k under a seed."""
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
    p = req.params
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if req.generator is None:
        req.generator = torch.Generator().manual_seed(p.seed if p.seed is not None else req.rid)
    probs = torch.softmax(logits / p.temperature, -1).cpu()
    return int(torch.multinomial(probs, 1, generator=req.generator))
