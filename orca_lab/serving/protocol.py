"""The OpenAI completions API as this server speaks it: request and response shapes and their checks.

Requests are pydantic models, as FastAPI reads them; every field is checked where it enters, with a
message that names the field, the value and the allowed range, read from the table of request fields
(``orca_lab/engine/fields.py``), which ``SamplingParams`` and the engine read too. Text anywhere in a
body must be valid Unicode (a lone surrogate, valid JSON, is refused naming its field: ``Body``).
Checks that need the model (vocabulary, max length, K/V slots) are the engine's own, run by the
server before it accepts a request. vLLM's extensions ``ignore_eos``, ``top_k``, ``stop_token_ids``,
``return_token_ids``, ``repetition_penalty``, ``min_tokens``, ``truncate_prompt_tokens`` and beam search
(``use_beam_search``, ``length_penalty``) are accepted. A field this server
cannot honour is refused with a 400 naming it, never accepted and ignored: OpenAI's and vLLM's fields
it does not implement are declared with their neutral value the only one allowed (``NEUTRAL``), and
a field it does not know is refused too.

``logprobs`` (0..20) and ``echo``'s prompt log-probabilities are the model's own distribution:
``log_softmax`` of the raw logits, before penalties, bias, temperature, top-k and top-p
(``orca_lab/model/logprobs.py``; vLLM's default).
"""
from __future__ import annotations

import json
import re
import sys
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from orca_lab.config import FieldError
from orca_lab.config import shown as _short
from orca_lab.engine.fields import BY_HTTP, FIELDS, MAX_GEN_TOKENS, TOKEN_ID_MAX, check_count, check_stops, \
    check_text, http_param, lone_surrogate
from orca_lab.engine.request import FINISH_REASONS

MAX_TOKENS = MAX_GEN_TOKENS
MAX_N = FIELDS["n"].hi


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with the usage (null: as ``continuous_usage_stats``, which then
    implies it, as vLLM's default true does); ``continuous_usage_stats`` (vLLM's): with it, every
    chunk carries its choice's usage so far."""
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = False


def bounds(**schema) -> dict:
    """What the schema tells a client of a field's range; the validators below enforce it (and say
    so in their own words, naming the field, the value and the range)."""
    return {"json_schema_extra": schema}


def limits(name: str, **schema) -> dict:
    """``bounds`` of the HTTP field ``name`` as the table of fields has them (each item's, for a list)."""
    f = BY_HTTP[name]
    lo, hi = f.limits(http=True)
    bound = {"exclusiveMinimum" if f.open_lo else "minimum": lo, "maximum": hi}
    listed = {"items": {"type": "integer", **bound}} | ({"maxItems": f.most} if f.most else {})
    return bounds(**(listed if f.each else bound) | schema)


class Body(BaseModel):
    """A request body. Text anywhere in it (a key too) must be valid Unicode: a lone surrogate is
    valid JSON (``"\\ud800"``) but no character, and no tokenizer takes it; refused before any field
    is read, naming the field that holds it."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data):
        for key, value in data.items() if isinstance(data, dict) else ():
            where, text = ("a field name", key) if lone_surrogate(key) is not None else _unencodable(value, key)
            if text is not None:
                check_text(key, text, where)         # refuses it, its field the key
        return data


def _unencodable(value, path: str) -> tuple[str, str | None]:
    """Where in ``value`` (named ``path``) the first text UTF-8 cannot encode is (keys too), and
    that text; ``(path, None)`` if there is none."""
    if isinstance(value, str):
        return path, value if lone_surrogate(value) is not None else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and lone_surrogate(k) is not None:
            return f"a key of {path}", k
        where, text = _unencodable(v, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]")
        if text is not None:
            return where, text
    return path, None


# the numbers the table of fields (engine/fields.py) checks, by their HTTP names
NUMBERS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "n", "logprobs", "prompt_logprobs",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "length_penalty")
# OpenAI's and vLLM's completion fields this server does not implement: only the neutral value passes
NEUTRAL = {"suffix": None, "min_p": 0.0, "include_stop_str_in_output": False,
           "skip_special_tokens": True, "spaces_between_special_tokens": True, "allowed_token_ids": None,
           "bad_words": None, "response_format": None, "guided_json": None, "guided_regex": None,
           "guided_choice": None, "guided_grammar": None, "logits_processors": None, "priority": 0}
IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
TEXT = {"type": "string", "minLength": 1}
STOP = {"type": "string", "minLength": 1, "maxLength": FIELDS["stop"].hi}


class CompletionRequest(Body):
    """``POST /v1/completions``; a field this server does not know is refused (a 400 naming it)."""
    model_config = ConfigDict(extra="forbid", validate_default=True)

    model: str | None = None
    prompt: Any = Field(description="a string, a list of token ids, or a list of either",
                        **bounds(anyOf=[TEXT, IDS, {"type": "array", "items": {"anyOf": [TEXT, IDS]}, "minItems": 1}]))
    echo: StrictBool | None = Field(False, description="the prompt before the completion, with its logprobs if asked")
    max_tokens: int | None = Field(16, description="0 only with echo (the prompt's logprobs, no completion)",
                                   **limits("max_tokens"))
    temperature: float | None = Field(1.0, **limits("temperature"))
    top_p: float | None = Field(1.0, **limits("top_p"))
    top_k: int | None = Field(None, **limits("top_k"))
    seed: int | None = Field(None, **limits("seed"))
    stop: str | list[str] | None = Field(None, **bounds(anyOf=[STOP, {"type": "array", "items": STOP, "maxItems": FIELDS[
        "stop"].most}, {"type": "null"}]))
    stop_token_ids: list[int] | None = Field(None, **limits("stop_token_ids"))
    n: int | None = Field(1, **limits("n"))
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = Field(None, description="only with stream=true")
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool = Field(False, description="logprobs name each token token_id:<id>")
    logprobs: int | None = Field(None, description="the log-probabilities of the k most likely tokens at each "
                                 "position (log_softmax of the raw logits)", **limits("logprobs"))
    presence_penalty: float | None = Field(0.0, **limits("presence_penalty"))
    frequency_penalty: float | None = Field(0.0, **limits("frequency_penalty"))
    repetition_penalty: float | None = Field(1.0, **limits("repetition_penalty"))
    prompt_logprobs: int | None = Field(None, description="vLLM's: each prompt token's log-probability with the "
                                        "k most likely at its position, in choice.prompt_logprobs",
                                        **limits("prompt_logprobs"))
    min_tokens: int | None = Field(0, description="at most max_tokens", **limits("min_tokens"))
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias added to its logit",
                                                **bounds(maxProperties=FIELDS["logit_bias"].most, additionalProperties={
                                                    "type": "number", **dict(zip(("minimum", "maximum"),
                                                                                 FIELDS["logit_bias"].limits(http=True)))}))
    best_of: int | None = Field(None, **bounds(enum=[None, 1]))
    user: str | None = None
    use_beam_search: StrictBool = Field(False, description="vLLM's: the n best sequences by beam search, n the beam "
                                        "width; whole only, and the sampling fields are refused with it")
    length_penalty: float | None = Field(1.0, description="with use_beam_search: a beam's score is its cumulative "
                                         "logprob / len(prompt + output) ** length_penalty",
                                         **limits("length_penalty"))
    truncate_prompt_tokens: int | None = Field(None, description="vLLM's: keep the prompt's last k tokens; -1: as many "
                                               "as max_tokens leaves of the model's length (at most that)",
                                               **bounds(anyOf=[{"const": -1}, {"type": "integer", "minimum": 1},
                                                                {"type": "null"}]))
    # not implemented: the neutral value only (NEUTRAL)
    suffix: str | None = Field(None, **bounds(enum=[None]))
    min_p: float | None = Field(0.0, **bounds(enum=[None, 0.0]))
    include_stop_str_in_output: StrictBool = Field(False, **bounds(enum=[False]))
    skip_special_tokens: StrictBool = Field(True, **bounds(enum=[True]))
    spaces_between_special_tokens: StrictBool = Field(True, **bounds(enum=[True]))
    allowed_token_ids: Any = Field(None, **bounds(enum=[None]))
    bad_words: Any = Field(None, **bounds(enum=[None]))
    response_format: Any = Field(None, **bounds(enum=[None]))
    guided_json: Any = Field(None, **bounds(enum=[None]))
    guided_regex: Any = Field(None, **bounds(enum=[None]))
    guided_choice: Any = Field(None, **bounds(enum=[None]))
    guided_grammar: Any = Field(None, **bounds(enum=[None]))
    logits_processors: Any = Field(None, **bounds(enum=[None]))
    priority: int | None = Field(0, **bounds(enum=[None, 0]))

    @field_validator(*NUMBERS, mode="before")
    @classmethod
    def _in_range(cls, v, info):
        """A number's kind and range from the table of fields (``engine/fields.py``), read as JSON has
        it: ``true`` and ``"5"`` are no numbers (pydantic would read 1 and 5), ``5.0`` is an integer."""
        name = info.field_name
        f = BY_HTTP[name]
        if v is None:                                           # the default (``_null_is_default``)
            return v
        if f.each:                                              # stop_token_ids: pydantic refuses a non-list
            return [f.check(_json_number(x, f.kind), http=True, where=f"{name}[{i}]")
                    for i, x in enumerate(check_count(f.name, v))] if isinstance(v, list) else v
        v = _json_number(v, f.kind)
        if name == "max_tokens" and v == 0:
            if info.data.get("echo") is True:                   # lm-eval's scoring request: the prompt only
                return 0
            raise FieldError(f"max_tokens=0 is out of range: allowed {f.range_text()}, or 0 with echo=true", f.name)
        return f.check(v, http=True, hi=info.data.get(FIELDS[f.up_to].http) if f.up_to else None)  # min_tokens

    @field_validator("echo", "max_tokens", "temperature", "top_p", "n", "stream", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens", "length_penalty")
    @classmethod
    def _null_is_default(cls, v, info):
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator(*NEUTRAL, mode="before")
    @classmethod
    def _not_implemented(cls, v, info):
        """``0 == False`` and ``1.0 == True`` in Python: the neutral value must be of its own type."""
        neutral = NEUTRAL[info.field_name]
        if not (v is None or (type(v) is type(neutral) and v == neutral)
                or (isinstance(neutral, float) and type(v) is int and v == neutral)):
            raise ValueError(f"{info.field_name}={_short(v)} is not supported by this server: allowed "
                             f"{json.dumps(neutral)} (or leave it out)")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v is not None and v != 1:
            raise ValueError(f"best_of={v!r} is not supported by this server: allowed null or 1")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        return normalize_prompt(v)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        """vLLM's -1 (and 0, and null) turn top-k off."""
        return 0 if v is None or v == -1 else v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return list(check_stops([] if v is None else v))

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v, info):
        if v is not None and info.data.get("stream") is not True:
            raise ValueError("stream_options is only allowed with stream=true")
        return v

    @field_validator("truncate_prompt_tokens", mode="before")
    @classmethod
    def _truncate_prompt_tokens(cls, v):
        """-1, or in the table's range (a range with a hole at 0 and below); the model's bound,
        max_seq_len - max_tokens, is the endpoint's to check."""
        if v is None:
            return v
        f = BY_HTTP["truncate_prompt_tokens"]
        v = _json_number(v, f.kind)
        if type(v) is int and v < 1:
            if v == -1:
                return v
            raise FieldError(f"truncate_prompt_tokens={_short(v)} is out of range: allowed -1 or >= 1", f.name)
        return f.check(v)                                       # its kind, and the range above 0

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v):
        """OpenAI's ``{"token id": bias}`` (keys are strings in JSON), biases in [-100, 100]."""
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ValueError(f"logit_bias={_short(v)} must be an object mapping token ids to biases")
        for k, b in check_count("logit_bias", v).items():
            k = str(k)
            if not (k.isascii() and k.isdigit()):          # "²" is a digit to str.isdigit, not to int()
                raise FieldError(f"logit_bias key {_short(k)} is not a token id: keys are token ids (0 or more)",
                                 "logit_bias")
            long = len(k.lstrip("0")) > 12                 # (int() refuses 4300 digits and more)
            if long or int(k) > TOKEN_ID_MAX:
                raise FieldError(f"logit_bias key {_short(k)}{f' ({len(k)} digits)' if long else ''} is out of "
                                 f"range: allowed [0, {TOKEN_ID_MAX}]", "logit_bias")
            FIELDS["logit_bias"].check(b, http=True, where=f"logit_bias[{k!r}]")
        return {str(k): float(b) for k, b in v.items()}

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The k of the prompt's entries the engine computes: echo's and ``prompt_logprobs``'s."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asked, default=None)

    @property
    def include_usage(self) -> bool:
        so = self.stream_options
        return bool(so and (so.continuous_usage_stats if so.include_usage is None else so.include_usage))

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: every chunk's usage only with the last chunk's too."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), b) for k, b in (self.logit_bias or {}).items())


def normalize_prompt(v) -> list[str | list[int]]:
    """The OpenAI prompt forms (a string, token ids, or a list of either) as a list of prompts."""
    form = "prompt must be a string, a list of token ids, or a list of strings or token-id lists"
    if isinstance(v, str):
        prompts = [v]
    elif isinstance(v, list) and v and all(_is_id(t) for t in v):
        prompts = [v]
    elif isinstance(v, list) and v and all(isinstance(p, str) or
                                           (isinstance(p, list) and all(_is_id(t) for t in p)) for p in v):
        prompts = v
    elif isinstance(v, list) and not v:
        raise ValueError("prompt=[] is empty: allowed 1 to max_seq_len - max_tokens tokens")
    else:
        raise ValueError(f"{form}; got {_short(v)}")
    for i, p in enumerate(prompts):
        if not p:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise ValueError(f"{where}={p!r} is empty: allowed 1 to max_seq_len - max_tokens tokens")
    return prompts


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _json_number(v, kind):
    """``v`` as the table's ``kind`` reads it: an integral JSON number is an integer (JSON Schema's);
    anything else as it is, for the table to refuse."""
    return int(v) if kind is int and isinstance(v, float) and v.is_integer() else v


# -- responses --------------------------------------------------------------------------------
FinishReason = Literal[FINISH_REASONS]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape, one entry per token (the prompt's first, with echo: null)."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatChoiceLogprobs(BaseModel):
    """OpenAI's chat shape, one entry per output token (``/v1/chat/completions``)."""
    content: list[ChatTokenLogprob]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM's return_token_ids (null unless asked for, as vLLM sends them)
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    # vLLM's: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    matched_stop: int | str | None = None     # SGLang's: the stop token id or string that ended it
    # why this choice failed alone (finish_reason "error"); left out of the JSON otherwise
    error: str | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    """The whole answer, or (``object`` the same, as OpenAI sends it) one chunk of a stream."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "orca_lab"
    root: str                           # vLLM's: the model it serves
    parent: str | None = None           # vLLM's: the base model of an adapter (none here)
    max_model_len: int                  # vLLM's field
    vocab_size: int                     # lets a load generator draw token-id prompts
    system: str                         # orca or ft
    max_bs: int
    n_slots: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 503: "service_unavailable", 500: "server_error"}
# The largest request body the server reads: a whole context of token ids as JSON (131,072 ids of up to
# 7 digits and ", ") is about 1 MiB, so 16 such prompts in one request fit, and a body of gigabytes is
# refused before it is held.
MAX_BODY_BYTES = 16 << 20


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body."""
    error: ErrorDetail


class RunPage(BaseModel):
    """``GET /debug/run``: the engine's records new since ``since`` (``engine.RunResult.to_json``),
    the HTTP records of the completions (by completion id), and ``now``, the next page's ``since``."""
    since: float
    now: float
    system: str
    config: dict
    duration: float
    requests: list[dict]
    iterations: list[dict]
    completions: dict[str, dict]


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``; text UTF-8 cannot
    encode (a lone surrogate a client sent, named back) escaped, so that the answer can be sent."""
    return {"error": {"message": _sendable(message), "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": None if param is None else _sendable(param), "code": status}}


def _sendable(text: str) -> str:
    return text if lone_surrogate(text) is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


# a number of more digits than Python converts (4,300): the body parser says only that it failed.
# JSON's tokens, strings whole (a digit in a string is text), to find that number and its field.
JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:]|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?')
TOO_LONG = sys.get_int_max_str_digits()


def unreadable_body(raw: bytes) -> tuple[str, str | None] | None:
    """``(message, param)`` for a body the parser refused: text that is not UTF-8 (JSON's encoding),
    or a number too long (``unreadable_number``); None if neither was why."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"the request body is not UTF-8, as JSON text must be: byte {raw[e.start]:#04x} at {e.start}", None
    return unreadable_number(text)


def unreadable_number(text: str) -> tuple[str, str | None] | None:
    """``(message, param)`` for a body JSON could not read because of such a number: the body's
    field that holds it (its value, or an item or entry of it) and, for a field of the request, the
    allowed range; None if that was not why."""
    depth, key, last = 0, None, None
    for token in JSON_TOKENS.finditer(text):
        t = token.group()
        if t in "{[":
            depth += 1
        elif t in "}]":
            depth -= 1
        elif t == ":":
            key = last if depth == 1 else key          # a field of the body (its value follows)
        elif t[0] == '"':
            last = t[1:-1]
        elif len(t.lstrip("-")) > TOO_LONG and t.lstrip("-").isdigit() and key is not None:
            field = BY_HTTP.get(key)
            allowed = f": allowed {field.range_text(http=True)}" if field is not None else ""
            n = len(t.lstrip("-"))
            said = f"{key}={t[:11]}... ({n} digits) is" if depth == 1 else f"{key} holds {t[:11]}... ({n} digits),"
            return f"{said} out of range{allowed}", key
    return None


def _field_path(err: dict) -> list[str]:
    """Where pydantic says an error is, as the client named it: the fields and indices, without the
    body and the forms a field may take (``stop.str``, ``stop.list[str]``: pydantic's, not the client's)."""
    return [str(p) for p in err.get("loc", ()) if p != "body" and not (isinstance(p, str) and _is_form(p))]


def _is_form(part: str) -> bool:
    return not part.isidentifier() or part in ("str", "int", "float", "bool", "list", "dict", "none")


def validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """The first of pydantic's errors as ``(message, field)``: our own checks already name the field,
    value and range; a type error gets them prepended. Malformed JSON names the position. A check of
    the whole body (``Body``) names its field as data (``FieldError.field``)."""
    err = errors[0]
    loc = _field_path(err)
    refused = err.get("ctx", {}).get("error")
    field = ".".join(loc) or (http_param(refused.field) if isinstance(refused, FieldError) else None)
    if err.get("type") == "json_invalid":
        where = err.get("ctx", {}).get("error", err.get("msg", ""))
        return f"malformed JSON body: {where}", None
    # a field of several forms (``stop``: a string or a list of them) fails once per form: say each
    msgs = list(dict.fromkeys(e.get("msg", "invalid value") for e in errors if _field_path(e) == loc))
    lead = "Input should be " if all(m.startswith("Input should be ") for m in msgs) else ""
    msg = lead + " or ".join(m.removeprefix(lead) for m in msgs)
    if err.get("type") == "value_error":
        return msg.removeprefix("Value error, "), field
    if err.get("type") == "missing":
        return (f"{field} is required", field) if field else ("the request body must be a JSON object: it is empty", None)
    if err.get("type") == "extra_forbidden":
        return (f"{field} is not a field this server knows: refused rather than ignored "
                "(see the OpenAPI schema at /openapi.json)"), field
    if field is None:                       # the body itself is not a JSON object
        return f"the request body must be a JSON object: {msg}", None
    return f"{field}={_short(err.get('input'))}: {msg}", field
