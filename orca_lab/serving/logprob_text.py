"""A choice's log-probabilities in OpenAI's completions shape (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``: ``LogprobText``) or its chat shape (``content``, a list of tokens
each with its bytes and its most likely tokens: ``ChatLogprobs``), and vLLM's ``prompt_logprobs``
(``prompt_entries``), written as its tokens come: one writer per choice serves the whole answer and
each streamed chunk alike, so the chunks of a stream add up to the whole answer.

A token is named by ``orca_lab.tokenizer.token_name`` (as /tokenize's ``token_strs`` are), so ``k``
ids give ``k`` distinct names (``top_logprobs`` holds the ``k`` most likely tokens and the chosen
one: ``k + 1`` entries when it is not among them, as vLLM gives them). ``text_offset`` counts each
token's decoded text from the start of the choice's text (the prompt's, with echo).
"""
from __future__ import annotations

from orca_lab.serving.protocol import ChatChoiceLogprobs, CompletionLogprobs
from orca_lab.tokenizer import token_name


class TokenNames:
    """What names a token in an answer's logprobs: ``orca_lab.tokenizer.token_name`` (the
    tokenizer's own token strings, so distinct ids have distinct names); vLLM's ``token_id:<id>``
    with ``return_tokens_as_token_ids`` and for a model without a tokenizer."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.decode = getattr(tokenizer, "decode", None)
        self.token_bytes = getattr(tokenizer, "token_bytes", None)
        self.as_ids = as_ids or self.decode is None

    def text(self, token: int) -> str:
        """The token's own text (what it adds to the choice's text), "" without a tokenizer."""
        return "" if self.decode is None else self.decode([token])

    def raw(self, token: int) -> bytes | None:
        """The token's own bytes, None when the tokenizer cannot tell them."""
        return None if self.token_bytes is None else self.token_bytes(token)

    def name(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else token_name(self.tokenizer, token)


class LogprobText:
    def __init__(self, tokenizer, as_ids: bool = False, k: int | None = None):
        self.names, self.offset, self.k = TokenNames(tokenizer, as_ids), 0, k

    def chunk(self, pairs) -> dict:
        """``pairs``: ``(token id, TokenLogprob or None)`` in order (None: the prompt's first token)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in pairs:
            name = self.names.name(token)
            out["tokens"].append(name)
            out["text_offset"].append(self.offset)
            self.offset += len(self.names.text(token))
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top = {}
            for t, lp in (*entry.top[:self.k], (token, entry.logprob)):
                top.setdefault(self.names.name(t), lp)      # (the chosen one may be among the k)
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
    bytes}]}]}``, the ``top_logprobs`` most likely first. ``bytes`` are the token's own (a
    byte-level piece of a character keeps its byte); a tokenizer that cannot tell them, or
    ``return_tokens_as_token_ids``, gives its name's bytes, as vLLM does."""

    def __init__(self, tokenizer, as_ids: bool = False, k: int | None = None):
        self.names, self.k = TokenNames(tokenizer, as_ids), k

    def item(self, token: int, logprob: float) -> dict:
        name = self.names.name(token)
        raw = None if self.names.as_ids else self.names.raw(token)
        return {"token": name, "logprob": logprob, "bytes": list(raw if raw is not None else name.encode("utf-8"))}

    def chunk(self, pairs) -> dict:
        """``pairs``: ``(token id, TokenLogprob)`` of output tokens (a chat echoes no prompt)."""
        return {"content": [{**self.item(token, e.logprob), "top_logprobs": [self.item(t, lp) for t, lp in e.top[:self.k]]}
                            for token, e in pairs]}

    @staticmethod
    def whole(chunks: list[dict]) -> ChatChoiceLogprobs:
        return ChatChoiceLogprobs(content=[x for c in chunks for x in c["content"]])


def prompt_entries(names: TokenNames, prompt: list[int], entries: list, k: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each one ``{token id:
    {logprob, rank, decoded_token}}`` of the ``k`` most likely tokens at its position and the prompt's
    own. ``rank`` is 1 for the most likely; a prompt token outside the top ``k`` has rank None (its
    place below them is not computed)."""
    out = []
    for token, e in zip(prompt, entries):
        if e is None:
            out.append(None)
            continue
        top = {t: {"logprob": lp, "rank": r, "decoded_token": names.name(t)}
               for r, (t, lp) in enumerate(e.top[:k], start=1)}
        top.setdefault(token, {"logprob": e.logprob, "rank": None, "decoded_token": names.name(token)})
        out.append(top)
    return out
