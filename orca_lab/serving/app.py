"""The endpoint: the FastAPI app, its routes and the checks at its door, the OpenAI error shapes
and the schema it publishes (``/openapi.json``)."""
from __future__ import annotations

import asyncio
import contextlib
import uuid

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from orca_lab.engine.detokenizer import Detokenizer, undecodable
from orca_lab.engine.fields import check_context, http_error
from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.serving.auth import OPEN_PATHS, carries_key
from orca_lab.serving.beam_search import beam_answer
from orca_lab.serving.chat import (ChatRequest, DetokenizeRequest, TokenizeRequest, bound, chat_chunk,
                                   chat_response, render)
from orca_lab.serving.completions import sse_answer, whole_answer
from orca_lab.serving.engine_client import RETRY_AFTER_S, EngineClient, HTTPError, Stream
from orca_lab.serving.engine_core import HISTORY, EngineProcess
from orca_lab.serving.logprob_text import ChatLogprobs, LogprobText
from orca_lab.serving.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from orca_lab.serving.protocol import (
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    MAX_BODY_BYTES,
    ModelList,
    RunPage,
    error_body,
    unreadable_body,
    validation_error,
)
from orca_lab.serving.state import HTTPRecord, ServerState
from orca_lab.tokenizer import token_name


def build_app(core: EngineProcess, system: str = "orca", max_queue: int = 1024, model_name: str | None = None,
              ready=None, stop_timeout: float = 5.0, debug: bool = False, chat_template: str | None = None,
              api_key: str | None = None) -> FastAPI:
    """The FastAPI app over a started engine process; its lifespan's end stops that engine (which
    cancels what is left and stops its workers). ``ready(app)`` is called once it serves.
    ``debug``: serve ``GET /debug/run``, the engine's own records and the HTTP side's (the last
    ``HISTORY`` of each; without it neither side keeps any). ``chat_template``: the Jinja
    template of /v1/chat/completions (default: the tokenizer's ``chat_template``, if it has one).
    ``api_key``: the key every route but /health and /metrics asks for (``_RequireKey``, ``auth``)."""
    metrics = ServerMetrics()
    state = ServerState(model_name or core.info.cfg.name, system, EngineClient(core, metrics, max_queue), metrics,
                        history=HISTORY if debug else 0)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.pool.start(asyncio.get_running_loop())
        if ready is not None:
            ready(app)
        try:
            yield
        finally:
            state.draining = True
            state.pool.stop()
            await asyncio.to_thread(core.join, stop_timeout)   # the loop reads the engine's last words
            state.pool.close()
            state.tokenizing.shutdown(wait=False)     # what it holds is answered by the stopped engine

    app = FastAPI(title="orca_lab", lifespan=lifespan)
    app.openapi = _openapi_of(app)
    app.state.orca = state
    app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)
    if api_key is not None:
        app.add_middleware(_RequireKey, key=api_key)           # outside the body limit: no body held without it
    app.add_middleware(_StampArrival, clock=state.pool.clock)     # added last: the outer one

    @app.exception_handler(HTTPError)
    async def _http_error(request, e: HTTPError):
        return JSONResponse(error_body(e.status, e.message, e.param), e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request, e: StarletteHTTPException):
        """Starlette's own refusals (a body it cannot parse, an unknown path) in OpenAI's shape too; a
        body unreadable for a number too long names that number's field, one not UTF-8 says so."""
        said = None
        if e.status_code == 400:
            try:
                said = unreadable_body(await request.body())
            except ClientDisconnect:             # the client left while sending it: nothing to read
                pass
        message, param = said or (str(e.detail), None)
        return JSONResponse(error_body(e.status_code, message, param), e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        message, param = validation_error(e.errors())
        kind = request.headers.get("content-type", "")
        if param is None and kind.split(";")[0].strip().lower() != "application/json":   # JSON, not read as JSON
            message = f"the request body must be JSON sent as content-type: application/json, not {kind or 'none'!r}"
        return JSONResponse(error_body(400, message, param), 400)

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        """A fault of the server's own on one request: OpenAI's error shape naming it (the log has its
        traceback); the engine and every other request go on."""
        return JSONResponse(error_body(500, f"the server failed on this request ({type(e).__name__}: {e})"), 500)

    def check_healthy():
        """503 while the engine is dead or stuck (``EngineClient.unhealthy``): a load balancer or a
        supervisor reading /health or /v1/models sees it."""
        why = state.pool.unhealthy()
        if why is not None:
            raise HTTPError(503, why)

    @app.get("/health", responses=_errors(503))
    async def health():
        check_healthy()
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList, responses=_errors(503))
    async def models():
        check_healthy()
        return ModelList(data=[_model_card(state)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_errors(404))
    async def model(model_id: str):
        if model_id != state.model_name:
            raise HTTPError(404, f"model={model_id!r} does not exist: this server serves {state.model_name!r}",
                            "model")
        return _model_card(state)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_page():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/run", include_in_schema=debug, response_model=RunPage, responses=_errors(400, 503))
    async def run_records(since: float = Query(0.0, ge=0.0, allow_inf_nan=False)):
        """The engine's ``RunResult`` of what is new since ``since`` (engine clock, seconds:
        requests not finished by then, iterations ended after it, with their HTTP records by
        completion id) and ``now``, the ``since`` of the next page. Only with ``--debug``."""
        if not debug:
            raise HTTPError(404, "GET /debug/run is off: start the server with orca-lab serve --debug")
        engine_part = await state.pool.call("records", since)              # JSON made by the engine
        http_part = await state.completions_json(since)
        return Response(engine_part[:-1] + b', "completions": ' + http_part + b"}", media_type="application/json")

    @app.post("/v1/completions", response_model=CompletionResponse, responses={
        **_errors(400, 404, 503), 200: {"content": {"text/event-stream": {"schema": SSE_EVENT}},
                                        "description": "the completion, or with stream=true its server-sent events"}})
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(state, body, request)

    tokenizer = core.info.tokenizer
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)

    def prompt_of(messages, add_generation_prompt: bool) -> str:
        if template is None:
            raise HTTPError(400, f"model {state.model_name!r} has no chat template (its tokenizer carries none): "
                            "use /v1/completions, or start the server with --chat-template FILE (Jinja)", "messages")
        try:
            return render(template, messages, add_generation_prompt, tokenizer)
        except ValueError as e:
            raise HTTPError(400, str(e), "messages") from None

    @app.post("/v1/chat/completions", responses={
        **_errors(400, 404, 503), 200: {"content": {"text/event-stream": {"schema": SSE_EVENT}},
                                        "description": "the chat completion, or with stream=true its events"}})
    async def chat_completions(body: ChatRequest, request: Request):
        """A completion of the text the chat template makes of ``messages``."""
        text, raw = prompt_of(body.messages, body.add_generation_prompt), await request.json()
        try:
            fields, name = body.completion_fields(raw), bound(raw)
            ids = [] if tokenizer is None else await state.tokenized(_tokens, tokenizer, text, "messages")
            room = core.info.cfg.max_seq_len - len(ids)
            if name is None:              # no bound: the rest of the model's length
                fields["max_tokens"] = max(1, room)
            elif fields["max_tokens"] > room >= 1:      # (no room at all: the prompt is refused, named)
                raise HTTPError(400, f"{name}={fields['max_tokens']} is out of range: the chat's prompt is {len(ids)} "
                                f"tokens, so allowed [1, {room}] (the model's max length {room + len(ids)})", name)
            comp = CompletionRequest(prompt=ids or text, **fields)
        except ValidationError as e:
            raise HTTPError(400, *validation_error(e.errors())) from None
        except ValueError as e:
            raise HTTPError(400, *http_error(e)) from None
        try:
            out = await _complete(state, comp, request, ChatLogprobs)
        except HTTPError as e:          # a chat has no prompt field: its messages made the prompt
            if e.param != "prompt":
                raise
            raise HTTPError(e.status, f"messages, as the chat template renders them: {e.message}", "messages") from None
        if isinstance(out, StreamingResponse):
            started = set()
            events = out.body_iterator
            return StreamingResponse((chat_chunk(data, started) async for data in events),
                                     media_type="text/event-stream")
        if isinstance(out, CompletionResponse):
            return JSONResponse(chat_response(out.model_dump(mode="json")))
        return out

    @app.post("/tokenize", responses=_errors(400, 404))
    async def tokenize(body: TokenizeRequest):
        """vLLM's: the token ids of ``prompt`` (or of ``messages`` through the chat template)."""
        _check_model(state, body.model)
        if tokenizer is None:
            raise HTTPError(400, f"model {state.model_name!r} has no tokenizer: it takes token ids only", "prompt")
        if body.prompt is None and body.messages is None:
            raise HTTPError(400, "give prompt (text) or messages (a chat)", "prompt")
        field = "prompt" if body.prompt is not None else "messages"
        text = body.prompt if body.prompt is not None else prompt_of(body.messages, body.add_generation_prompt)
        ids = await state.tokenized(_tokens, tokenizer, text, field)
        if len(ids) > core.info.cfg.max_seq_len:     # as vLLM's: what no request could hold is refused
            raise HTTPError(400, f"{field} is {len(ids)} tokens, more than the model's max length: allowed <= "
                            f"{core.info.cfg.max_seq_len}", field)
        return {"count": len(ids), "max_model_len": core.info.cfg.max_seq_len, "tokens": ids,
                "token_strs": [token_name(tokenizer, t) for t in ids] if body.return_token_strs else None}

    @app.post("/detokenize", responses=_errors(400, 404))
    async def detokenize(body: DetokenizeRequest):
        """vLLM's: the text of ``tokens``."""
        _check_model(state, body.model)
        if tokenizer is None:
            raise HTTPError(400, f"model {state.model_name!r} has no tokenizer: it takes token ids only", "tokens")
        return {"prompt": _text(tokenizer.decode, check_ids(body.tokens, core.info.cfg.vocab_size, "tokens", "tokens"),
                                "tokens")}

    return app


def _check_model(state: ServerState, model: str | None):
    if model is not None and model != state.model_name:
        raise HTTPError(404, f"model={model!r} does not exist: this server serves {state.model_name!r}", "model")


async def _complete(state: ServerState, body: CompletionRequest, request: Request, form=LogprobText):
    """A completion request, from its checks to its answer: the whole ``CompletionResponse``, a
    stream of server-sent events, or 499 when its client left first. ``form``: the shape of its
    log-probabilities (``logprob_text.py``)."""
    arrival = request.scope["orca_arrival"]
    streams = await _streams(state, body, arrival)
    cid = f"cmpl-{uuid.uuid4().hex}"
    try:
        if body.use_beam_search:          # its own requests, step by step: one prompt's streams[::n]
            return await _until_done_or_gone(state, request, beam_answer(state, body, cid, streams[::body.n]), [])
        await state.pool.submit(streams, "n" if body.n > 1 else "prompt")
    except (ValueError, TypeError) as e:
        raise HTTPError(400, *http_error(e)) from None
    rec = HTTPRecord([s.rid for s in streams], arrival)
    state.record(cid, rec)
    if body.stream:
        return StreamingResponse(sse_answer(state, body, cid, streams, rec, form), media_type="text/event-stream")
    try:
        return await _until_done_or_gone(state, request, whole_answer(state, body, cid, streams, form), streams)
    finally:
        rec.finish = state.pool.clock.now()


# one server-sent event of a streamed completion (Open API 3.1: an event stream's schema is each event's)
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a CompletionResponse chunk as JSON (one token of one choice, or the usage), "
                                     "then [DONE]"}}}


def _errors(*codes: int) -> dict:
    """The error answers an endpoint gives, for its OpenAPI schema: OpenAI's error body."""
    return {code: {"model": ErrorResponse} for code in codes}


def _openapi_of(app: FastAPI):
    """FastAPI's schema without the 422 it documents for every route: a request that fails
    validation is answered 400 here, as OpenAI answers it (``_invalid``)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for operations in schema["paths"].values():
                for op in operations.values():
                    op["responses"].pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(unused, None)
        return app.openapi_schema
    return openapi


class _StampArrival:
    """ASGI middleware: a request's arrival is the first moment the app sees it (engine clock), before
    its body is read and checked, so the server's records count that time too."""

    def __init__(self, app, clock):
        self.app, self.clock = app, clock

    async def __call__(self, scope, receive, send):
        scope["orca_arrival"] = self.clock.now()
        await self.app(scope, receive, send)


class _BodyLimit:
    """ASGI middleware: a body over ``limit`` bytes is refused (413) before anything holds it whole, so
    one client cannot make the server parse gigabytes of JSON. A declared length is judged at once (the
    HTTP parser ends the body there), unless the body comes chunked (which then frames it, whatever
    length was declared beside): a chunked body is read up to the limit, then handed on. The rest of a
    refused body is read and dropped (up to ``DRAIN`` limits) before the answer, as a socket closed on
    unread bytes is reset, which can destroy the answer before the client reads it; a client waiting
    for ``100 Continue`` has sent none, and is answered at once."""

    DRAIN = 8

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = None if b"transfer-encoding" in headers else headers.get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.limit:
                sent = headers.get(b"expect", b"").lower() != b"100-continue"
                return await self._refuse(scope, receive, send, f"is {int(declared)} bytes", sent)
            return await self.app(scope, receive, send)
        body, message = bytearray(), {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            if message["type"] != "http.request":        # the client left: the app hears it
                return await self.app(scope, _replaying(message, receive), send)
            body += message.get("body", b"")
            if len(body) > self.limit:
                return await self._refuse(scope, receive, send, "runs past that", message.get("more_body"))
        await self.app(scope, _replaying({"type": "http.request", "body": bytes(body), "more_body": False}, receive),
                       send)

    async def _refuse(self, scope, receive, send, size: str, more: bool):
        message = f"the request body {size}: this server takes at most {self.limit} bytes ({self.limit >> 20} MiB)"
        await _refuse_unread(scope, receive, send, 413, message, more, self.DRAIN * self.limit)


class _RequireKey:
    """ASGI middleware, outside ``_BodyLimit``: a request to a route not in ``auth.OPEN_PATHS`` without
    the key is answered 401 in OpenAI's shape before anything holds its body (a chunked one would be
    gathered whole by the limit); what it sends is read and dropped, up to one body's limit, and a
    client waiting for ``100 Continue`` has sent none and is answered at once."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or carries_key(scope["headers"], self.key):
            return await self.app(scope, receive, send)
        sent = dict(scope["headers"]).get(b"expect", b"").lower() != b"100-continue"
        message = "this server takes a key: send the header Authorization: Bearer <key> (the openai client's api_key)"
        await _refuse_unread(scope, receive, send, 401, message, sent, MAX_BODY_BYTES, {"WWW-Authenticate": "Bearer"})


async def _refuse_unread(scope, receive, send, status: int, message: str, more: bool, budget: int, headers=None):
    """Answer ``status`` to a request whose body the server will not read, then close the connection.
    What the client sends is read and dropped first (up to ``budget`` bytes; ``more``: it is sending),
    as a socket closed on unread bytes is reset, which can destroy the answer before the client reads it."""
    while more and budget > 0:
        got = await receive()
        more, budget = got.get("more_body", False), budget - len(got.get("body", b""))
    await JSONResponse(error_body(status, message), status, headers={"Connection": "close", **(headers or {})})(
        scope, receive, send)


def _replaying(first: dict, receive):
    """``receive`` that answers ``first`` once, then what the client sends."""
    pending = [first]

    async def replay():
        return pending.pop() if pending else await receive()
    return replay


def _model_card(state: ServerState) -> ModelCard:
    ec, cfg = state.pool.core.info.engine_config, state.pool.core.info.cfg
    return ModelCard(id=state.model_name, root=state.model_name, max_model_len=cfg.max_seq_len, vocab_size=cfg.vocab_size,
                     system=state.system, max_bs=ec.max_bs, n_slots=ec.n_slots)


async def _streams(state: ServerState, body: CompletionRequest, arrival: float) -> list[Stream]:
    """One stream per prompt and per ``n``: token ids, sampling parameters; refused here (before the
    engine) if the server is draining or the model is not this one."""
    if state.draining:
        raise HTTPError(503, "the server is shutting down", headers={"Retry-After": str(RETRY_AFTER_S)})
    _check_model(state, body.model)
    prompts = await state.tokenized(_prompt_ids, state.pool.core.info, body)
    out, q = [], asyncio.Queue()
    for i, ids in enumerate(prompts):
        for j in range(body.n):
            seed = None if body.seed is None else (body.seed + j) % 2 ** 63   # n samples, n different draws
            try:
                params = SamplingParams(max_gen_tokens=max(1, body.max_tokens), temperature=body.temperature,
                                        top_k=body.top_k, top_p=body.top_p, seed=seed,
                                        ignore_eos=body.ignore_eos, stop=tuple(body.stop),
                                        stop_token_ids=tuple(body.stop_token_ids or ()),
                                        logprobs=body.logprobs,
                                        prompt_logprobs=body.engine_prompt_logprobs,
                                        logit_bias=body.bias_pairs(), presence_penalty=body.presence_penalty,
                                        frequency_penalty=body.frequency_penalty,
                                        repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens)
            except ValueError as e:
                raise HTTPError(400, *http_error(e)) from None
            decode = state.pool.decode
            prompt = body.prompt[i]
            kept = isinstance(prompt, str) and body.truncate_prompt_tokens is None
            echo = "" if not body.echo else prompt if kept else _text(decode, ids, _where(body, i)) if decode else ""
            out.append(Stream(len(out), ids, params, arrival, q,
                              detokenizer=None if decode is None else Detokenizer(decode, params.stop, params.min_tokens),
                              prompt_text=echo, echo_only=body.max_tokens == 0))
    return out


def _prompt_ids(info, body: CompletionRequest) -> list[list[int]]:
    """Each prompt's token ids, in the vocabulary, truncated as asked, and within the model's length
    (checked here, before megabytes of ids travel to the engine only to be refused there)."""
    prompts = []
    for i, p in enumerate(body.prompt):
        where = _where(body, i)
        ids = check_ids(_encode(info.tokenizer, p, "prompt", where), info.cfg.vocab_size, "prompt", where)
        prompts.append(_truncated(ids, body, info.cfg.max_seq_len))
        try:
            check_context(len(prompts[-1]), max(1, body.max_tokens), info.cfg.max_seq_len)
        except ValueError as e:
            if body.max_tokens == 0:       # echo's scoring: named as the client sent it
                raise HTTPError(400, f"{where} is {len(prompts[-1])} tokens: with max_tokens 0 (echo) allowed <= "
                                f"{info.cfg.max_seq_len - 1}, the model's max length less the one step that scores "
                                "it", "prompt") from None
            raise HTTPError(400, *http_error(e)) from None
    return prompts


def _where(body: CompletionRequest, i: int) -> str:
    """How a message names the client's ``i``-th prompt."""
    return "prompt" if len(body.prompt) == 1 else f"prompt[{i}]"


def _text(decode, ids: list[int], where: str) -> str:
    """The text of ids a client sent (echo's prompt, /detokenize's tokens); ids this tokenizer cannot
    decode (tiktoken past its ranks, inside the model's vocabulary) are a 400 naming the field."""
    try:
        return decode(ids)
    except Exception as e:  # noqa: BLE001  (whatever the tokenizer raises on these ids, it is about them)
        raise HTTPError(400, f"{where}: {undecodable(e)}", where.split("[")[0]) from None


def check_ids(ids: list[int], vocab_size: int, field: str, where: str) -> list[int]:
    """Token ids a client sent, refused here if one is out of the vocabulary: before anything
    decodes them (echo's text, /detokenize), so a bad id is a 400, never a decoder's 500."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise HTTPError(400, f"{where} holds token id {bad}: out of the vocabulary, allowed [0, {vocab_size - 1}]",
                        field)
    return ids


def _truncated(ids: list[int], body: CompletionRequest, max_seq_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens, k at most what max_tokens leaves
    of the model's length (-1: that many)."""
    k, room = body.truncate_prompt_tokens, max_seq_len - max(1, body.max_tokens)
    if k is None or room < 1:             # no room at all: the engine refuses max_tokens, naming it
        return ids
    if k > room:
        raise HTTPError(400, f"truncate_prompt_tokens={k} is out of range: allowed -1 or [1, {room}] (the model's "
                        f"max length {max_seq_len} - max_tokens {max(1, body.max_tokens)})", "truncate_prompt_tokens")
    return ids[-(room if k == -1 else k):]


def _encode(tokenizer, prompt, field: str, where: str) -> list[int]:
    if not isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        raise HTTPError(400, f"{where} is text but this model has no tokenizer: send token ids", field)
    ids = _tokens(tokenizer, prompt, field, where)
    if not ids:
        raise HTTPError(400, f"{where}={prompt!r} encodes to no token: allowed 1 to max_seq_len - max_tokens "
                        "tokens", field)
    return ids


def _tokens(tokenizer, text: str, field: str, where: str | None = None) -> list[int]:
    """``tokenizer.encode(text)``; text it cannot encode is a 400 naming the client's field (the
    body's check refuses lone surrogates first; this holds whatever else a tokenizer refuses)."""
    try:
        return tokenizer.encode(text)
    except (ValueError, TypeError) as e:          # UnicodeEncodeError; a Hugging Face tokenizer's TypeError
        raise HTTPError(400, f"{where or field}: this model's tokenizer cannot encode it "
                        f"({type(e).__name__}: {e})", field) from None


async def _until_done_or_gone(state: ServerState, request: Request, work, streams: list[Stream]):
    """Await ``work``; a client that disconnects first cancels its requests (vLLM does the same)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():                 # the client left first: its requests are cancelled
            task.cancel()
            state.pool.cancel(streams)
    return task.result() if task.done() else Response(status_code=499)   # (a cancelled task is not done yet)


async def _disconnected(request: Request):
    while (await request.receive())["type"] != "http.disconnect":
        pass

