"""``POST /v1/chat/completions`` and vLLM's ``/tokenize`` / ``/detokenize``: shapes, checks and the
chat template.

A chat is a completion of the text its template makes of the messages: the template is Jinja, the
tokenizer's own (``chat_template`` of a checkpoint's ``tokenizer_config.json``) or the file given
with ``orca-lab serve --chat-template FILE`` (as vLLM takes it), rendered as Hugging Face renders
it (a sandbox; ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``raise_exception``). A model without one answers 400 and says so. The sampling fields, their
checks, streaming, ``usage`` and ``stop`` are the completions endpoint's own.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, create_model, field_validator

from orca_lab.config import check_range
from orca_lab.engine.fields import MAX_LOGPROBS, check
from orca_lab.serving.protocol import MAX_TOKENS, Body, CompletionRequest, _short

ROLES = ("system", "user", "assistant", "tool", "developer")
# the completions fields a chat takes as they are (the checks are CompletionRequest's)
SHARED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n", "stream",
          "stream_options", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "min_tokens", "logit_bias", "user", "return_tokens_as_token_ids", "return_token_ids")


def _some(messages: list) -> list:
    """A chat's messages (to complete, or to tokenize): at least one."""
    if not messages:
        raise ValueError("messages=[] is empty: a chat needs at least one message")
    return messages


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str = Field(**{"json_schema_extra": {"enum": list(ROLES)}})
    content: str | list[dict] | None = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, v):
        if v not in ROLES:
            raise ValueError(f"role={v!r} is not allowed: choose one of {', '.join(ROLES)}")
        return v

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        """A string, or OpenAI's list of parts of which this server reads the text ones."""
        if isinstance(v, list):
            parts = []
            for p in v:
                if p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise ValueError(f"content part {_short(p)} is not supported: only {{'type': 'text', "
                                     "'text': ...}} parts")
                parts.append(p["text"])
            return "".join(parts)
        return v


class ChatFields(Body):
    """What only a chat has; the sampling fields (``SHARED``) are added from ``CompletionRequest``,
    their schema as they are, and are checked by it (``completion_fields``)."""
    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage] = Field(**{"json_schema_extra": {"minItems": 1}})
    max_tokens: int | None = Field(None, **{"json_schema_extra": {"minimum": 1, "maximum": MAX_TOKENS}})
    max_completion_tokens: int | None = Field(None, **{"json_schema_extra": {"minimum": 1, "maximum": MAX_TOKENS}})
    add_generation_prompt: StrictBool = True
    logprobs: StrictBool | None = Field(False, description="each output token's log-probability")
    top_logprobs: StrictInt | None = Field(None, description="with logprobs: the k most likely tokens at each "
                                           "position too", **{"json_schema_extra": {"minimum": 0,
                                                                                    "maximum": MAX_LOGPROBS}})
    # not implemented: the neutral value only
    tools: Any = Field(None, **{"json_schema_extra": {"enum": [None]}})
    tool_choice: Any = Field(None, **{"json_schema_extra": {"enum": [None, "none"]}})
    response_format: Any = Field(None, **{"json_schema_extra": {"enum": [None]}})

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        return _some(v)

    @field_validator("logprobs")
    @classmethod
    def _null_is_false(cls, v):
        return bool(v)          # null: OpenAI's default

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError(f"top_logprobs={v} needs logprobs=true")
        return v if v is None else check("logprobs", v, http=True, where="top_logprobs")

    @field_validator("tools", "response_format")
    @classmethod
    def _not_implemented(cls, v, info):
        if v is not None:
            raise ValueError(f"{info.field_name}={_short(v)} is not supported by this server's chat endpoint: "
                             "leave it out")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v not in (None, "none"):
            raise ValueError(f"tool_choice={_short(v)} is not supported by this server: allowed none")
        return v

    def completion_fields(self, raw: dict) -> dict:
        """What the completions endpoint checks and runs: the shared fields as the client sent them
        (``raw``, the JSON body: pydantic's reading here would turn ``"0.5"`` into 0.5); ``max_tokens``
        only if the client bounded the answer (``bound``)."""
        out = {k: raw[k] for k in SHARED if k in raw}
        if self.logprobs:
            out["logprobs"] = self.top_logprobs or 0
        if name := bound(raw):             # named as sent, in a chat's range: it has no echo to take 0
            out["max_tokens"] = check_range(name, raw[name], 1, MAX_TOKENS)
        return out


def bound(raw: dict) -> str | None:
    """The field a chat's client bounded its answer with (OpenAI's max_completion_tokens over the
    older max_tokens), or None: then the answer may run to the model's length, as OpenAI's and vLLM's."""
    return next((name for name in ("max_completion_tokens", "max_tokens") if raw.get(name) is not None), None)


ChatRequest = create_model(
    "ChatRequest", __base__=ChatFields, __doc__="``POST /v1/chat/completions``: a field this server does not "
    "know is refused (a 400 naming it).",
    **{k: (CompletionRequest.model_fields[k].annotation, CompletionRequest.model_fields[k]) for k in SHARED})


def render(template: str, messages: list[ChatMessage], add_generation_prompt: bool, tokenizer) -> str:
    """The prompt text of a chat, as Hugging Face's ``apply_chat_template`` renders it."""
    from jinja2.exceptions import TemplateError
    try:
        return _compiled(template).render(
            messages=[m.model_dump(exclude_none=True) for m in messages], add_generation_prompt=add_generation_prompt,
            bos_token=getattr(tokenizer, "bos_token", "") or "", eos_token=getattr(tokenizer, "eos_token", "") or "")
    except TemplateError as e:
        raise ValueError(f"messages: the chat template refused them: {e}") from None


_CACHE: dict[str, Any] = {}


def _compiled(template: str):
    if template not in _CACHE:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            from jinja2.exceptions import TemplateError
            raise TemplateError(message)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        _CACHE[template] = env.from_string(template)
    return _CACHE[template]


def check_template(template: str, where: str) -> str:
    """Refuse a template Jinja cannot parse at startup, naming where it came from."""
    from jinja2.exceptions import TemplateSyntaxError
    try:
        _compiled(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {where}: not a Jinja template: {e}") from None
    return template


def chat_response(completion: dict) -> dict:
    """A completions answer (``CompletionResponse`` as a dict, its logprobs already in the chat's
    shape) as OpenAI's chat answer. With ``return_token_ids``, as vLLM's chat gives them: each
    choice's ``token_ids``, and the prompt's once, ``prompt_token_ids`` beside the choices."""
    choices = completion["choices"]
    return {"id": "chat" + completion["id"], "object": "chat.completion", "created": completion["created"],
            "model": completion["model"], "usage": completion["usage"], **_prompt_ids(choices),
            "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                         "logprobs": c["logprobs"], "finish_reason": c["finish_reason"],
                         "matched_stop": c["matched_stop"], **_own(c, "error", "token_ids")} for c in choices]}


def _own(choice: dict, *keys) -> dict:
    """Those of ``keys`` the choice carries (not None): left out of the answer otherwise."""
    return {k: choice[k] for k in keys if choice.get(k) is not None}


def _prompt_ids(choices: list) -> dict:
    ids = next((c["prompt_token_ids"] for c in choices if c.get("prompt_token_ids") is not None), None)
    return {} if ids is None else {"prompt_token_ids": ids}


def chat_chunk(data: str, started: set) -> str:
    """One server-sent event of a streamed completion as the chat's: the text as ``delta.content``,
    the role with each choice's first chunk, ``[DONE]`` as it is."""
    if data.strip() == "data: [DONE]":
        return data
    chunk = json.loads(data[len("data: "):])
    if "error" in chunk:                          # a choice failed: the error event is the same
        return data
    choices = []
    for c in chunk["choices"]:
        delta = {} if c["text"] == "" and c["finish_reason"] is not None and c["index"] in started else \
            {"content": c["text"]}
        if c["index"] not in started:
            started.add(c["index"])
            delta = {"role": "assistant", **delta}
        choices.append({"index": c["index"], "delta": delta, "logprobs": c["logprobs"], "finish_reason": c["finish_reason"],
                        "matched_stop": c["matched_stop"], **_own(c, "token_ids")})
    out = {"id": "chat" + chunk["id"], "object": "chat.completion.chunk", "created": chunk["created"],
           "model": chunk["model"], **_prompt_ids(chunk["choices"]), "choices": choices, "usage": chunk.get("usage")}
    return f"data: {json.dumps(out)}\n\n"


# -- /tokenize and /detokenize, as vLLM serves them ------------------------------------------------
class TokenizeRequest(Body):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False

    @field_validator("messages")
    @classmethod
    def _one_of(cls, v, info):
        if v is not None and info.data.get("prompt") is not None:
            raise ValueError("give prompt or messages, not both")
        return v if v is None else _some(v)


class DetokenizeRequest(Body):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


