"""A request's text, made incrementally: each token costs the decoding of a few tokens, not of the
whole output, so a stream of n tokens costs O(n) and not O(n^2). The engine's stop strings and the
endpoint's streamed text are both read from it.

Like vLLM's detokenizer it keeps two offsets into the token ids: ``ids[read:]`` have not been made
text for good yet, and ``ids[prefix:read]`` are a little context decoded with them (a tokenizer may
decode a token differently at the start of a text). It relies on what byte-level tokenizers (bytes,
GPT-2's BPE) guarantee: the text of a prefix of tokens that ends on a whole character does not
change when tokens are added. Two things are held back:

- an incomplete character: its UTF-8 bytes may be split across tokens, and until the last of them
  comes the window decodes to U+FFFD at its end (shown as U+FFFD only if the request ends there);
- while the request runs, the end of the text that could begin a stop string, so a client is never
  shown text that a stop string spanning several tokens takes back.
"""
from __future__ import annotations

INCOMPLETE = "\ufffd"       # what an incomplete (or invalid) UTF-8 sequence decodes to


def undecodable(e: Exception) -> str:
    """Why a request fails alone when its tokenizer raised on its tokens (its text, its stop check):
    a fault of its own, never the engine's or another request's."""
    return f"its tokenizer could not decode its tokens ({type(e).__name__}: {e})"


class Detokenizer:
    """Text of a growing list of token ids: ``add`` a token, ``take`` what became visible."""

    def __init__(self, decode, stop: tuple[str, ...] = (), min_tokens: int = 0):
        self.decode, self.stop, self.min_tokens = decode, tuple(stop), min_tokens
        self.ids: list[int] = []           # the tokens of the text (a stop token or EOS is none)
        self.stop_at: int | None = None    # where the first stop string begins in the text
        self._prefix = self._read = 0      # ids[prefix:] are decoded each token, ids[:read] are text
        self._n_context = 0                # characters of that window that ids[prefix:read] make
        self._n_window = 0                 # characters of that window already text
        self._keep = max(map(len, self.stop), default=1) - 1
        self._tail = ""                    # the text's last _keep characters: stop strings span tokens
        self._n_text = 0                   # characters of text made
        self._unshown: list[str] = []      # text made and not taken yet
        self._shown: list[str] = []
        self._n_shown = 0

    @property
    def text(self) -> str:
        """All the text taken so far."""
        return "".join(self._shown)

    def add(self, token: int) -> int | None:
        """A token of the text; returns where the first stop string begins once the text holds one.
        Before ``min_tokens`` tokens are out, a stop string that ends in a token's text is text like
        any other (vLLM's rule; the engine's stop and the endpoint's text both read it here)."""
        self.ids.append(token)
        window = self.decode(self.ids[self._prefix:])
        self._made(window.rstrip(INCOMPLETE)[self._n_window:], look=len(self.ids) >= self.min_tokens)
        if not window.endswith(INCOMPLETE):    # it ends on a whole character: text for good
            self._prefix, self._read = self._read, len(self.ids)
            self._n_context = self._n_window = len(window) - self._n_context
        return self.stop_at

    def update(self, tokens, finish_reason: str | None = None, stop_at: int | None = None) -> str:
        """``tokens`` added, then what became visible (``take``). A request that ended with "stop"
        and no stop string (``stop_at`` None) ended at EOS or a stop token: that last token is no text."""
        ended_by_token = finish_reason == "stop" and stop_at is None
        for t in tokens[:len(tokens) - ended_by_token]:
            self.add(t)
        return self.take(final=finish_reason is not None)

    def take(self, final: bool = False) -> str:
        """The text that became visible since the last call: while the request runs, all but the end
        that could begin a stop string; once it has ended (``final``), the rest, up to the stop
        string that ended it (an incomplete last character as U+FFFD)."""
        if final and self.stop_at is None:
            self._made(self.decode(self.ids[self._prefix:])[self._n_window:])
        end = self.stop_at if self.stop_at is not None else self._n_text - (0 if final else self._held())
        if end <= self._n_shown:
            return ""
        unshown = "".join(self._unshown)
        out, rest = unshown[:end - self._n_shown], unshown[end - self._n_shown:]
        self._unshown = [rest] if rest else []
        self._shown.append(out)
        self._n_shown = end
        return out

    def _made(self, new: str, look: bool = True):
        """``new`` characters of text; look for a stop string ending in them (if ``look``)."""
        if not new:
            return
        self._n_window += len(new)
        if self.stop and self.stop_at is None:
            hay = self._tail + new
            hits = [i for i in (hay.find(s) for s in self.stop) if i >= 0] if look else []
            if hits:
                self.stop_at = self._n_text - len(self._tail) + min(hits)
            self._tail = hay[-self._keep:] if self._keep else ""
        self._n_text += len(new)
        self._unshown.append(new)

    def _held(self) -> int:
        """Characters at the text's end that could begin a stop string: the longest such end (it
        starts where the tail holds a stop string's first character, most often nowhere)."""
        tail, held = self._tail, 0
        for s in self.stop:
            i = tail.find(s[0], max(0, len(tail) - len(s) + 1))
            while 0 <= i < len(tail) - held:
                if s.startswith(tail[i:]):
                    held = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return held
