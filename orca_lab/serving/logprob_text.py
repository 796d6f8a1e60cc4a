"""A choice's log-probabilities in OpenAI's completions shape (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``: ``LogprobText``) or its chat shape (``content``, a list of tokens
each with its bytes and its most likely tokens: ``ChatLogprobs``), written as its tokens come: one
writer per choice serves the whole answer and each streamed chunk alike, so the chunks of a stream
add up to the whole answer.

A token's text is ``decode([id])`` (``"token_id:<id>"`` for a model without a tokenizer, as vLLM
writes it); ``text_offset`` counts those texts from the start of the choice's text (the prompt's,
with echo). ``top_logprobs`` holds the ``k`` most likely tokens and the chosen one (so ``k + 1``
entries when it is not among them, as vLLM gives them); two ids of one text keep the likelier.
"""
from __future__ import annotations

from orca_lab.serving.protocol import ChatChoiceLogprobs, CompletionLogprobs


def token_text(decode, token: int) -> str:
    return f"token_id:{token}" if decode is None else decode([token])


class LogprobText:
    def __init__(self, tokenizer):
        self.decode, self.offset = getattr(tokenizer, "decode", None), 0

    def text_of(self, token: int) -> str:
        return token_text(self.decode, token)

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

    @staticmethod
    def whole(chunks: list[dict]) -> CompletionLogprobs:
        """Chunks of one choice as one."""
        return CompletionLogprobs(**{k: [x for c in chunks for x in c[k]]
                                     for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")})


class ChatLogprobs:
    """The chat's shape: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}]}]}``, the ``top_logprobs`` most likely first. ``bytes`` come from the tokenizer's
    ``token_bytes``, so a byte-level token that is a piece of a character keeps its own byte (its
    text is U+FFFD); a tokenizer without it (a Hugging Face one, whose decoder hides such a piece)
    gives its text's bytes, as vLLM does."""

    def __init__(self, tokenizer):
        self.decode = getattr(tokenizer, "decode", None)
        self.token_bytes = getattr(tokenizer, "token_bytes", None)

    def item(self, token: int, logprob: float) -> dict:
        text = token_text(self.decode, token)
        raw = self.token_bytes(token) if self.token_bytes is not None else text.encode("utf-8")
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def chunk(self, pairs) -> dict:
        """``pairs``: ``(token id, TokenLogprob)`` of output tokens (a chat echoes no prompt)."""
        return {"content": [{**self.item(token, e.logprob), "top_logprobs": [self.item(t, lp) for t, lp in e.top]}
                            for token, e in pairs]}

    @staticmethod
    def whole(chunks: list[dict]) -> ChatChoiceLogprobs:
        return ChatChoiceLogprobs(content=[x for c in chunks for x in c["content"]])
