"""Next-token choice from the last-token logits: greedy, or temperature / top-k / top-p under a seed."""
import secrets

import torch

from orca_lab.model import logprobs, penalties


NO_TOKEN = "no token can be drawn: every logit of its row is -inf or nan"


def sample(logits: torch.Tensor, batch) -> list[int | str | None]:
    """One token per request of ``batch`` that yields one (``Batch.yields``), None for the others.
    Greedy rows share one argmax; sampled rows use their own generator, and only a row that yields
    draws from it, so a request draws the same tokens whatever it is batched with and however its
    prompt is chunked (vLLM and SGLang do not sample a partial prefill either). A request's own
    fields shape its row first (``penalties.py``); the log-probabilities a request asks for are read
    from the raw ``logits`` (``logprobs.py``).

    Faults stay in their row: a request whose shaping or draw raises, or whose row has no finite
    logit (nan from the model, every token masked), gets the error's text (a str) in place of a
    token; its scheduler fails that request alone (``Request.fail``) and the others go on."""
    faults: dict[int, str] = {}
    raw, logits = logits, penalties.shape(logits, batch, faults)
    best, tokens = logits.max(-1)
    tokens = torch.where(torch.isfinite(best), tokens, -1).tolist()     # one read back: token or -1
    for i, (req, yields) in enumerate(zip(batch.requests, batch.yields)):
        if not yields:
            tokens[i] = None
        elif i in faults or tokens[i] < 0:
            tokens[i] = faults.get(i, NO_TOKEN)
        elif not req.params.greedy:
            tokens[i] = _drawn(logits[i].float(), req)
    logprobs.record_sampled(raw, batch, [t if isinstance(t, int) else None for t in tokens])
    return tokens


def _drawn(logits: torch.Tensor, req) -> int | str:
    try:
        return _draw(logits, req)
    except Exception as e:              # this request's own settings: it fails, the batch goes on
        return f"its token could not be drawn ({type(e).__name__}: {e})"


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
