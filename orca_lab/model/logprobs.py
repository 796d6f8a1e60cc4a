"""Log-probabilities for the requests that ask for them (``SamplingParams.logprobs`` and
``prompt_logprobs``), computed beside the sampler and never for the others.

Which distribution: the model's own, ``log_softmax`` of the raw logits in fp32, before any penalty,
bias, temperature, top-k or top-p (vLLM's default, ``raw_logprobs``). A client reading them sees what
the model thinks of each token, the same whatever sampler settings drew it; an evaluation harness
scoring a continuation needs exactly that.

A prompt's log-probabilities need the logits of every prompt position, which the engine otherwise
never computes (``GPT.head`` projects each request's last token only, ORCA §3). The prefill of a
request that asks computes them for that request's rows alone; the other requests of the batch pay
nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log-probability, and the ``k`` most likely tokens with
    theirs, most likely first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def to_plain(entry: TokenLogprob | None) -> list | None:
    """An entry as JSON's plain lists (a worker reports it over the control plane)."""
    return None if entry is None else [entry.token, entry.logprob, [list(t) for t in entry.top]]


def from_plain(plain: list | None) -> TokenLogprob | None:
    if plain is None:
        return None
    token, logprob, top = plain
    return TokenLogprob(token, logprob, tuple((int(t), float(v)) for t, v in top))


def record_sampled(logits: torch.Tensor, batch, tokens: list[int | None]):
    """Append to each asking request that got a token the ``TokenLogprob`` of that token, from its
    row of the raw ``logits [B, vocab]``."""
    rows = [i for i, (req, tok) in enumerate(zip(batch.requests, tokens))
            if tok is not None and req.params.logprobs is not None]
    if not rows:
        return
    ks = [batch.requests[i].params.logprobs for i in rows]
    entries = _entries(logits[rows], [tokens[i] for i in rows], ks)
    for i, entry in zip(rows, entries):
        batch.requests[i].logprobs.append(entry)


def wants_prompt(batch) -> bool:
    """Whether a request of ``batch`` asks for its prompt's log-probabilities and this iteration
    runs prompt positions of it whose next token is a prompt token not scored yet."""
    return any(req.params.prompt_logprobs is not None and len(req.prompt_logprobs) < len(req.prompt)
               and start < len(req.prompt) - 1 for req, start in zip(batch.requests, batch.starts))


def record_prompt(head_at, x: torch.Tensor, batch):
    """Append to each asking request the ``TokenLogprob`` of each prompt token whose position this
    iteration ran the token before of (a whole prompt, a chunk of one, or the padded baseline's
    columns). ``x [sum L, H]``: the last layer's output of every new token; ``head_at(x, rows)``:
    the logits of those rows. Positions already scored (a preempted request's recomputation) are
    not scored twice; the first prompt token has None, as OpenAI's echo gives it. A request's first
    prefill must start at position 0 (a prefix cache that skips cached positions must not serve a
    request asking for its prompt's logprobs, or those positions stay unscored)."""
    at = 0
    for req, start, q in zip(batch.requests, batch.starts, batch.q_lens):
        p, n = req.params.prompt_logprobs, len(req.prompt)
        if p is not None and not req.prompt_logprobs:
            req.prompt_logprobs.append(None)
        if p is not None and len(req.prompt_logprobs) < n:
            # row j holds position start + j and predicts the token at start + j + 1
            first = len(req.prompt_logprobs) - 1 - start          # the row predicting the next unscored one
            last = min(q, n - 1 - start)                          # rows whose next token is a prompt token
            if 0 <= first < last:
                rows = torch.arange(at + first, at + last, device=x.device)
                targets = req.prompt[start + first + 1:start + last + 1]
                req.prompt_logprobs.extend(_entries(head_at(x, rows), targets, [p] * len(targets)))
        at += q


def _entries(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[TokenLogprob]:
    """``TokenLogprob`` of ``targets[r]`` and the top ``ks[r]`` of each row, read back in one copy."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device).unsqueeze(1)).squeeze(1)
    k = max(ks)
    if k:
        top_v, top_i = lp.topk(k, -1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprob(t, c, tuple(zip(top_i[r][:ks[r]], top_v[r][:ks[r]])) if k else ())
            for r, (t, c) in enumerate(zip(targets, chosen.tolist()))]
