"""One table of a request's fields: each one's type, its allowed range and the name an HTTP client
sends it by (OpenAI's; vLLM's for its extensions). ``SamplingParams``, the engine's checks and the
endpoint's protocol read their ranges here, and a refusal carries its field as data
(``FieldError.field``), which the endpoint reports as OpenAI's ``param``: no code reads error text.

A range is the same in process and over HTTP unless the row says why not (``http_range``).
"""
from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass

from orca_lab.config import FieldError, range_text, check_range, shown

TOKEN_ID_MAX = (1 << 24) - 1    # any vocabulary's ids; the engine checks the model's own
MAX_LOGPROBS = 20               # most likely tokens a request may ask for at each position (vLLM's cap)
MIN_REPETITION_PENALTY = 0.01   # vLLM takes any positive value; 5e-324 divides a logit to infinity
MAX_GEN_TOKENS = 1 << 20
MAX_LENGTH_PENALTY = 10.0       # beam search: a beam's score is its logprob / len ** length_penalty
# Lists a request may hold, which the engine reads at every token: one request's 300,000 stop ids
# held every other stream for 3.5 s (checked, then looked up each token). vLLM has no cap; OpenAI
# takes 4 stop strings.
MAX_IDS = 1024                  # stop_token_ids, logit_bias entries
MAX_STOPS = 64                  # stop strings
MAX_STOP_CHARS = 1024           # characters of one stop string (the text's end is searched each token)
MAX_ARRIVAL_S = 10**9            # an arrival, seconds on the run's clock: past ~9e9 a sleep until it overflows


@dataclass(frozen=True)
class Field:
    """One request field: ``kind`` int, float (a finite number) or str (text, UTF-8); ``each``: a list
    of them (``logit_bias``: a map of token ids to them). ``name`` is the engine's (``SamplingParams``),
    ``http`` OpenAI's (None: not a field of an HTTP request)."""
    name: str
    kind: type
    lo: int | float | None = None
    hi: int | float | None = None
    http: str | None = None
    http_range: tuple | None = None     # (lo, hi, why) where HTTP allows other values than the engine
    open_lo: bool = False               # lo itself is refused: (lo, hi]
    each: bool = False
    up_to: str | None = None            # hi is this other field's value, when it is given
    most: int | None = None             # each: at most this many of them

    def limits(self, http: bool = False) -> tuple:
        return self.http_range[:2] if http and self.http_range else (self.lo, self.hi)

    def range_text(self, http: bool = False) -> str:
        return range_text(*self.limits(http), self.open_lo)

    def check(self, value, *, http: bool = False, hi=None, where: str | None = None):
        """``value`` if it is of this field's kind and in its range (``hi``: the ``up_to`` field's
        value), else a FieldError naming ``where`` (default: the field) and the range."""
        if self.kind is str:
            return check_text(self.name, value, where)
        lo, top = self.limits(http)
        return check_range(where or (self.http if http else self.name), value, lo, top if hi is None else hi,
                           self.kind, field=self.name, open_lo=self.open_lo)


FIELDS = {f.name: f for f in (
    Field("prompt", int, 0, TOKEN_ID_MAX, "prompt", each=True),           # token ids (text encodes to them)
    Field("max_gen_tokens", int, 1, MAX_GEN_TOKENS, "max_tokens",
          http_range=(0, MAX_GEN_TOKENS, "0 with echo=true: the prompt's logprobs only, as lm-eval asks")),
    Field("min_tokens", int, 0, MAX_GEN_TOKENS, "min_tokens", up_to="max_gen_tokens"),
    Field("temperature", float, 0.0, 100.0, "temperature",
          http_range=(0.0, 2.0, "OpenAI's API caps it at 2 (in process, any sane value: 100 is flat enough)")),
    Field("top_k", int, 0, 1 << 24, "top_k", http_range=(-1, 1 << 24, "vLLM's -1 turns top-k off, as 0 does")),
    Field("top_p", float, 0.0, 1.0, "top_p", open_lo=True),
    Field("seed", int, 0, 2 ** 63 - 1, "seed"),
    Field("n", int, 1, 16, "n"),                                          # the endpoint's: one request a sample
    Field("eos_token_id", int, 0, TOKEN_ID_MAX),                          # the model's (not an HTTP field)
    Field("stop_token_ids", int, 0, TOKEN_ID_MAX, "stop_token_ids", each=True, most=MAX_IDS),
    Field("stop", str, 1, MAX_STOP_CHARS, "stop", each=True, most=MAX_STOPS),     # characters each
    Field("logprobs", int, 0, MAX_LOGPROBS, "logprobs"),
    Field("prompt_logprobs", int, 0, MAX_LOGPROBS, "prompt_logprobs"),
    Field("logit_bias", float, -100.0, 100.0, "logit_bias", each=True, most=MAX_IDS),   # token id -> bias
    Field("presence_penalty", float, -2.0, 2.0, "presence_penalty"),
    Field("frequency_penalty", float, -2.0, 2.0, "frequency_penalty"),
    Field("repetition_penalty", float, MIN_REPETITION_PENALTY, 100.0, "repetition_penalty"),
    Field("length_penalty", float, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY, "length_penalty"),   # beam search
    # vLLM's: keep the prompt's last k tokens; its -1 (as many as max_tokens leaves of the model's
    # length) is the endpoint's to resolve (``protocol.py``)
    Field("truncate_prompt_tokens", int, 1, MAX_GEN_TOKENS, "truncate_prompt_tokens"),
)}
BY_HTTP = {f.http: f for f in FIELDS.values() if f.http}


def check(name: str, value, **kw):
    """``FIELDS[name].check(value, **kw)``."""
    return FIELDS[name].check(value, **kw)


def as_token(token):
    """An integer of any library (numpy's, a one-element integer tensor's) as Python's ``int``;
    anything else (a float, a bool, a digit string) as it is, for ``check_token`` to refuse: a token
    id is never rounded or parsed into another one."""
    if isinstance(token, int) or not hasattr(token, "__index__"):
        return token
    try:
        return operator.index(token)
    except TypeError:
        return token


def check_context(n_prompt: int, max_gen_tokens: int, max_seq_len: int):
    """A prompt of ``n_prompt`` tokens and ``max_gen_tokens`` more within the model's length; named by
    the field at fault: the prompt if it leaves no room for one token."""
    if n_prompt + max_gen_tokens > max_seq_len:
        raise FieldError(f"prompt ({n_prompt} tokens) + max_gen_tokens ({max_gen_tokens}) = {n_prompt + max_gen_tokens} "
                         f"exceeds the model's max length: allowed <= {max_seq_len}",
                         "prompt" if n_prompt >= max_seq_len else "max_gen_tokens")


def check_arrival(arrival, name: str = "arrival") -> float:
    """A request's arrival, seconds from a trace's start or on an engine's clock: a finite number in
    [0, MAX_ARRIVAL_S] (a nan one never comes, so the engine would wait for it for ever)."""
    if isinstance(arrival, numbers.Real) and not isinstance(arrival, bool):
        arrival = float(arrival)        # numpy's scalars too: a trace built from an array
    return check_range(name, arrival, 0, MAX_ARRIVAL_S, kind=float)


def check_token(name: str, token, vocab_size: int | None = None, where: str | None = None) -> int:
    """A token id of field ``name``: an integer in [0, TOKEN_ID_MAX], and in the model's vocabulary
    when ``vocab_size`` is given (said so: "out of the vocabulary")."""
    where, hi = where or name, TOKEN_ID_MAX if vocab_size is None else vocab_size - 1
    if vocab_size is None or isinstance(token, bool) or not isinstance(token, int):
        return check_range(where, token, 0, hi, field=name)
    if not 0 <= token <= hi:
        raise FieldError(f"{where}={shown(token)} is out of the vocabulary: allowed [0, {hi}]", name)
    return token


def check_text(name: str, text, where: str | None = None) -> str:
    """Text of field ``name``: a string of ``lo`` to ``hi`` characters that UTF-8 can encode (a lone
    surrogate, valid in JSON's escapes and in a Python string, is no character: no tokenizer takes it)."""
    f = FIELDS.get(name)
    where, (lo, hi) = where or name, (f.lo, f.hi) if f is not None and f.kind is str else (None, None)
    if not isinstance(text, str):
        raise FieldError(f"{where}={shown(text)} must be a string", name)
    if lo and len(text) < lo:
        raise FieldError(f"{where}={text!r} is an empty string: needs >= {lo} character", name)
    if hi and len(text) > hi:
        raise FieldError(f"{where} is {len(text)} characters long: allowed at most {hi}", name)
    bad = lone_surrogate(text)
    if bad is not None:
        raise FieldError(f"{where} holds a lone surrogate ({text[bad]!r} at index {bad}), which is no character: "
                         "text must be valid Unicode (UTF-8 encodable)", name)
    return text


def check_stops(value) -> tuple[str, ...]:
    """``stop``: one string or a list of them (``MAX_STOPS``), each text of 1 to ``MAX_STOP_CHARS``
    characters."""
    stops = check_count("stop", as_tuple("stop", value, str))
    return tuple(check_text("stop", s, f"stop[{i}]") for i, s in enumerate(stops))


def check_count(name: str, items):
    """``items`` of list field ``name`` if there are at most its ``most``, before any is read."""
    most = FIELDS[name].most
    if most is not None and len(items) > most:
        raise FieldError(f"{name} holds {len(items)} items: allowed at most {most}", name)
    return items


def as_tuple(name: str, value, kind) -> tuple:
    """One ``kind`` or a list of them (of field ``name``), as a tuple."""
    items = (value,) if isinstance(value, kind) else value
    try:
        items = tuple(items)
    except TypeError:
        items = None
    if items is None or any(not isinstance(x, kind) or isinstance(x, bool) for x in items):
        raise FieldError(f"{name}={shown(value)} must be a {kind.__name__} or a list of them", name)
    return items


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in ``text``, or None (the common case: one encode)."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def http_param(field: str | None) -> str | None:
    """OpenAI's ``param`` of a field: the table's HTTP name, else the field as it is named."""
    return FIELDS[field].http if field in FIELDS else field


def http_error(e: Exception) -> tuple[str, str | None]:
    """A refusal as an HTTP client reads it: the message (saying which of its fields the engine's
    name is, where they differ) and the ``param``, from the error's field."""
    field = getattr(e, "field", None)
    f = FIELDS.get(field)
    note = f" ({f.name} is the request's {f.http})" if f is not None and f.http and f.http != f.name else ""
    return str(e) + note, http_param(field)
