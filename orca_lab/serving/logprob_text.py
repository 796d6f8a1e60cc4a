"""A choice's log-probabilities in OpenAI's completions shape (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``), written as its tokens come: one writer per choice serves the
whole answer and each streamed chunk alike, so the chunks of a stream add up to the whole answer.

A token's text is ``decode([id])`` (``"token_id:<id>"`` for a model without a tokenizer, as vLLM
writes it); ``text_offset`` counts those texts from the start of the choice's text (the prompt's,
with echo). ``top_logprobs`` holds the ``k`` most likely tokens and the chosen one (so ``k + 1``
entries when it is not among them, as vLLM gives them); two ids of one text keep the likelier.
"""
from __future__ import annotations


class LogprobText:
    def __init__(self, decode):
        self.decode, self.offset = decode, 0

    def text_of(self, token: int) -> str:
        return f"token_id:{token}" if self.decode is None else self.decode([token])

    def chunk(self, pairs) -> dict:
        """``pairs``: ``(token id, TokenLogprob or None)`` in order (None: the prompt's first token)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in pairs:
            text = self.text_of(token)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top = {}
            for t, lp in entry.top:
                top.setdefault(self.text_of(t), lp)
            top.setdefault(text, entry.logprob)
            out["token_logprobs"].append(entry.logprob)
            out["top_logprobs"].append(top)
        return out


def merged(chunks: list[dict]) -> dict:
    """Chunks of one choice as one."""
    return {k: [x for c in chunks for x in c[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
