"""What a request's sampling fields do to its logits before the sampler picks, one request (row) at
a time, in vLLM's order: ``min_tokens``, ``logit_bias``, then the repetition, frequency and presence
penalties (OpenAI's and vLLM's definitions). A row depends only on its own request, so a request
gets the same tokens batched as alone.
"""
from __future__ import annotations

import torch


def shape(logits: torch.Tensor, batch, faults: dict[int, str]) -> torch.Tensor:
    """``logits [B, vocab]`` with each asking request's row changed (a fp32 copy); the same tensor
    when no request of the batch asks, so the others pay nothing. A row whose shaping raises is left
    as it was and its error's text goes to ``faults[row]``: that request fails alone (``sampler``)."""
    rows = [i for i, (req, y) in enumerate(zip(batch.requests, batch.yields)) if y and req.params.shapes_logits]
    if not rows:
        return logits
    logits = logits.float().clone()
    for i in rows:
        req = batch.requests[i]
        try:
            shape_row(logits[i], req.params, req.prompt, req.output)
        except Exception as e:          # this request's own fields: it fails, the batch goes on
            faults[i] = f"its logits could not be shaped ({type(e).__name__}: {e})"
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
