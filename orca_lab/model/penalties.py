"""What a request's sampling fields do to its logits before the sampler picks, one request (row) at
a time, in vLLM's order: ``min_tokens``, ``logit_bias``, then the repetition, frequency and presence
penalties (OpenAI's and vLLM's definitions). A row depends only on its own request, so a request
gets the same tokens batched as alone.
"""
from __future__ import annotations

import torch


def shape(logits: torch.Tensor, batch) -> torch.Tensor:
    """``logits [B, vocab]`` with each asking request's row changed (a fp32 copy); the same tensor
    when no request of the batch asks, so the others pay nothing."""
    rows = [i for i, (req, y) in enumerate(zip(batch.requests, batch.yields)) if y and req.params.shapes_logits]
    if not rows:
        return logits
    logits = logits.float().clone()
    for i in rows:
        shape_row(logits[i], batch.requests[i].params, batch.requests[i].prompt, batch.requests[i].output)
    return logits


def shape_row(row: torch.Tensor, p, prompt: list[int], output: list[int]):
    """One request's logits, in place: ``p`` its SamplingParams, ``output`` the tokens it has so far."""
    if p.min_tokens and len(output) < p.min_tokens:
        ends = list(p.stop_token_ids) + ([p.eos_token_id] if p.eos_token_id is not None and not p.ignore_eos else [])
        if ends:
            row[ends] = float("-inf")
    if p.logit_bias:
        ids, biases = zip(*p.logit_bias)
        row[list(ids)] += torch.tensor(biases, dtype=row.dtype, device=row.device)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), device=row.device)
        v = row[seen]
        row[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(output, device=row.device), minlength=row.numel()).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
