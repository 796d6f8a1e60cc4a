"""The OpenAI completions API as this server speaks it: request and response shapes and their checks.

Requests are pydantic models, as FastAPI reads them; every field is checked where it enters, with a
message that names the field, the value and the allowed range (``orca_lab.config.check_range``).
Checks that need the model (vocabulary, max length, K/V slots) are the engine's own, run by the
server before it accepts a request. vLLM's extensions ``ignore_eos``, ``top_k``, ``stop_token_ids``
and ``return_token_ids`` are accepted; options this server cannot honour are refused, never ignored.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from orca_lab.config import check_range

MAX_TOKENS = 1 << 20
MAX_N = 16


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


def bounds(**schema) -> dict:
    """What the schema tells a client of a field's range; the validators below enforce it (and say
    so in their own words, naming the field, the value and the range)."""
    return {"json_schema_extra": schema}


FLOATS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
TEXT = {"type": "string", "minLength": 1}


class CompletionRequest(BaseModel):
    """``POST /v1/completions``; unknown fields are ignored, as by vLLM."""
    model_config = ConfigDict(extra="ignore", validate_default=True)

    model: str | None = None
    prompt: Any = Field(description="a string, a list of token ids, or a list of either",
                        **bounds(anyOf=[TEXT, IDS, {"type": "array", "items": {"anyOf": [TEXT, IDS]}, "minItems": 1}]))
    max_tokens: int | None = Field(16, **bounds(minimum=1, maximum=MAX_TOKENS))
    temperature: float | None = Field(1.0, **bounds(minimum=0.0, maximum=2.0))
    top_p: float | None = Field(1.0, **bounds(exclusiveMinimum=0.0, maximum=1.0))
    top_k: int | None = Field(None, **bounds(minimum=-1, maximum=1 << 24))
    seed: int | None = Field(None, **bounds(minimum=0, maximum=2 ** 63 - 1))
    stop: str | list[str] | None = Field(None, **bounds(anyOf=[TEXT, {"type": "array", "items": TEXT}, {"type": "null"}]))
    stop_token_ids: list[int] | None = Field(None, **bounds(items={"type": "integer", "minimum": 0, "maximum": 1 << 24}))
    n: int = Field(1, **bounds(minimum=1, maximum=MAX_N))
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    # OpenAI fields this server does not implement: only their neutral value is accepted
    echo: StrictBool = Field(False, **bounds(enum=[False]))
    logprobs: int | None = Field(None, **bounds(enum=[None]))
    best_of: int | None = Field(None, **bounds(enum=[None, 1]))
    suffix: str | None = Field(None, **bounds(enum=[None]))
    presence_penalty: float | None = Field(0.0, **bounds(enum=[None, 0.0]))
    frequency_penalty: float | None = Field(0.0, **bounds(enum=[None, 0.0]))
    logit_bias: dict | None = Field(None, **bounds(maxProperties=0))
    user: str | None = None

    @field_validator("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "n", "logprobs",
                     "best_of", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _numbers(cls, v, info):
        """A number is a JSON number: pydantic would take ``true`` as 1 and ``"5"`` as 5 (``5.0`` is
        an integer, in JSON Schema as here)."""
        kind = "a number" if info.field_name in FLOATS else "an integer"
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, (bool, str)):
                raise ValueError(f"{info.field_name}={_short(v)}: {x!r} is not {kind}")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        return normalize_prompt(v)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        return 16 if v is None else check_range("max_tokens", v, 1, MAX_TOKENS)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        return 1.0 if v is None else check_range("temperature", v, 0.0, 2.0, kind=float)

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if v is None:
            return 1.0
        check_range("top_p", v, 0.0, 1.0, kind=float)
        if v == 0:
            raise ValueError("top_p=0.0 is out of range: allowed (0, 1]")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        """vLLM's -1 (and 0) turn top-k off."""
        return 0 if v is None or v == -1 else check_range("top_k", v, 0, 1 << 24)

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        return v if v is None else check_range("seed", v, 0, 2 ** 63 - 1)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops):
            raise ValueError(f"stop={v!r} holds an empty string: each stop string needs >= 1 character")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        return [check_range("stop_token_ids[]", t, 0, 1 << 24) for t in v or []]

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        return check_range("n", v, 1, MAX_N)

    @field_validator("echo", "logprobs", "best_of", "suffix", "logit_bias")
    @classmethod
    def _unsupported(cls, v, info):
        if not (v is None or v is False or v == {} or (info.field_name == "best_of" and v == 1)):
            raise ValueError(f"{info.field_name}={v!r} is not supported by this server: "
                             f"allowed {'false' if info.field_name == 'echo' else 'null'}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v, info):
        return 0.0 if v is None else check_range(info.field_name, v, 0.0, 0.0, kind=float)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


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


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


# -- responses --------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "abort"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None
    # vLLM's return_token_ids; left out of the JSON unless asked for
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


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
    max_model_len: int                  # vLLM's field
    vocab_size: int                     # lets a load generator draw token-id prompts
    system: str                         # orca or ft
    max_bs: int
    n_slots: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable",
               500: "server_error"}


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
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


def validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """The first of pydantic's errors as ``(message, field)``: our own checks already name the field,
    value and range; a type error gets them prepended. Malformed JSON names the position."""
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    field = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        where = err.get("ctx", {}).get("error", err.get("msg", ""))
        return f"malformed JSON body: {where}", None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "value_error":
        return msg.removeprefix("Value error, "), field
    if err.get("type") == "missing":
        return f"{field} is required", field
    if field is None:                       # the body itself is not a JSON object
        return f"the request body must be a JSON object: {msg}", None
    return f"{field}={_short(err.get('input'))}: {msg}", field
