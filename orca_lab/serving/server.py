"""``orca-lab serve``: an OpenAI-compatible endpoint over the engine loop (ORCA §3, Figure 4).

The endpoint (FastAPI on an asyncio event loop) checks each request and hands it to the request
pool; the engine, in a process of its own (``engine_core``), runs Algorithm 1's iterations over
that pool. They meet at two pipes: endpoint -> engine (add, abort, call, stop) and engine ->
endpoint (one message per iteration with its tokens, read by the event loop as it arrives). No
engine work runs on the event loop, so a long iteration never stalls the HTTP side, and the engine
never waits on a slow client or on the GIL the event loop holds.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from orca_lab.engine.detokenizer import Detokenizer
from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.serving.engine_core import SHUTTING_DOWN, EngineProcess, EngineRecipe
from orca_lab.serving.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from orca_lab.serving.chat import (ChatRequest, DetokenizeRequest, TokenizeRequest, chat_chunk, chat_response,
                                   render)
from orca_lab.serving.logprob_text import LogprobText, merged
from orca_lab.serving.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                       ErrorResponse, ModelCard, ModelList, RunPage, Usage, error_body,
                                       validation_error)

log = logging.getLogger("orca_lab.serve")
RETRY_AFTER_S = 1
MAX_RECORDS = 100_000          # completions whose HTTP records /debug/run keeps


class HTTPError(Exception):
    """Refuse a request with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


@dataclass(frozen=True)
class Event:
    """What a choice receives: a token (None when it ends without one), the text that became
    visible with it, its finish reason once it is done, and why the engine failed if it did."""
    token: int | None
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprob: object = None              # the token's TokenLogprob, if the request asked
    prompt_logprobs: list | None = None  # with a request's first event, if it asked (echo)


@dataclass(eq=False)
class Stream:
    """One prompt of a completion request (one choice), as the endpoint follows it."""
    index: int
    prompt: list[int]
    params: SamplingParams
    arrival: float                 # at the endpoint, on the engine's clock
    out: asyncio.Queue             # shared by the choices of one HTTP request: (index, Event)
    sid: int = -1                  # the endpoint's name for it, known to the engine
    rid: int | None = None         # the engine's, once it holds it
    last: float = 0.0              # engine clock of its last token
    output: list[int] = field(default_factory=list)
    detokenizer: Detokenizer | None = None     # its text (None: the model has no tokenizer)
    prompt_text: str = ""                      # what echo puts before the completion
    echo_only: bool = False                    # max_tokens=0 with echo: the engine's one token is dropped

    def text(self, tokens: list[int], finish_reason: str | None, stop_at: int | None) -> str:
        """The text that ``tokens`` (one, or none when the request ended without one) made visible."""
        if self.detokenizer is None:
            return ""
        return self.detokenizer.update(tokens, finish_reason, stop_at)


class EngineClient:
    """The endpoint's side of the engine process: the request pool's door (``submit``, ``cancel``,
    ``call``), and the reader that turns each iteration's message into tokens, text and metrics.
    Everything here runs on the event loop: no lock."""

    def __init__(self, core: EngineProcess, metrics: ServerMetrics, max_queue: int):
        self.core, self.metrics, self.max_queue = core, metrics, max_queue
        self.decode = getattr(core.info.tokenizer, "decode", None)   # None: answers carry token ids only
        self.streams: dict[int, Stream] = {}          # sid -> stream the engine holds
        self.pending: dict[int, tuple[asyncio.Future, list[Stream]]] = {}   # adds and calls unanswered
        self.error: str | None = None                 # why the engine stopped, if it failed
        self.loop: asyncio.AbstractEventLoop | None = None
        self._keys, self._sids = itertools.count(), itertools.count()
        self.stopping = False                         # asked to stop: its exit is no failure
        self._in_inbox = 0                            # sent to the engine, not answered yet
        self._waiting = 0                             # never scheduled (engine), as last reported

    @property
    def clock(self):
        return self.core.clock

    @property
    def alive(self) -> bool:
        return self.error is None and self.core.proc.is_alive()

    def start(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        loop.add_reader(self.core.receive.fileno(), self._on_readable)

    def submit(self, streams: list[Stream]) -> asyncio.Future:
        """Send ``streams`` to the engine; the future settles once the engine took them all (or
        refused them: ValueError/TypeError). Past ``max_queue`` waiting requests: 503."""
        if not self.alive:
            raise HTTPError(503, self.error or "the engine is not running")
        waiting = self._in_inbox + self._waiting
        if waiting + len(streams) > self.max_queue:
            raise HTTPError(503, f"the server is overloaded: {waiting} requests waiting, max_queue="
                            f"{self.max_queue}; retry after {RETRY_AFTER_S} s",
                            headers={"Retry-After": str(RETRY_AFTER_S)})
        for s in streams:
            s.sid = next(self._sids)
        self._in_inbox += len(streams)
        fut = self._expect(streams)
        self._send(("add", fut.key, [(s.sid, s.prompt, s.params, s.arrival) for s in streams]))
        return fut

    def cancel(self, streams: list[Stream]):
        self._send(("abort", [s.sid for s in streams]))

    def abort_all(self):
        """End every request the engine holds with "abort" (the drain time is over): each stream's
        client reads its end, as the engine's answer comes back like any other."""
        if self.streams:
            self._send(("abort", list(self.streams)))

    def call(self, name: str, *args) -> asyncio.Future:
        """``name(engine, *args)`` run by the engine between two iterations (``EngineLoop._call``)."""
        fut = self._expect([])
        self._send(("call", fut.key, name, args))
        return fut

    def stop(self):
        """Ask the engine to cancel what is left and exit (then ``core.join``)."""
        self._send(("stop",))
        self.stopping = True

    def close(self):
        if not self.core.receive.closed:
            self.loop.remove_reader(self.core.receive.fileno())
        self.core.send.close(), self.core.receive.close()

    def _expect(self, streams) -> asyncio.Future:
        fut = self.loop.create_future()
        fut.key = next(self._keys)
        self.pending[fut.key] = (fut, streams)
        return fut

    def _send(self, msg):
        if self.error is None:
            try:
                self.core.send.send(msg)
            except OSError as e:
                self._failed(f"the engine process is gone: {e!r}")

    # -- what the engine sends --------------------------------------------------------------------
    def _on_readable(self):
        try:
            while self.error is None and self.core.receive.poll():
                msg = self.core.receive.recv()
                getattr(self, "_on_" + msg[0])(*msg[1:])
        except (EOFError, OSError):
            self.core.proc.join(0.5)                  # its exit code, once it has one
            self._failed("the server is shutting down" if self.stopping else
                         f"the engine process exited (code {self.core.proc.exitcode})")

    def _on_added(self, key, answer):
        fut, streams = self.pending.pop(key)
        self._in_inbox -= len(streams)
        if isinstance(answer, list):
            for s, rid in zip(streams, answer):
                s.rid, s.last = rid, s.arrival
                self.streams[s.sid] = s
            _settle(fut)
        else:
            _settle(fut, error=HTTPError(503, "the server is shutting down") if answer is SHUTTING_DOWN else answer)

    def _on_out(self, now, items, stats, iteration_tokens):
        m, out = self.metrics, []
        self._on_stats(stats)                          # first: a client that reads /metrics as soon
        for n in iteration_tokens:                     # as it got a token sees the state it came from
            m.iteration_tokens.observe(n)
        for sid, token, reason, stop_at, lp, plp in items:
            s = self.streams.get(sid)
            if s is None:
                continue
            if s.echo_only:                            # the prompt alone was asked for
                token, lp, reason = None, None, reason and ("abort" if reason == "abort" else "length")
            if token is not None:
                (m.ttft if not s.output else m.itl).observe(now - s.last)
                s.last = now
                s.output.append(token)
            text = "" if s.echo_only else s.text([] if token is None else [token], reason, stop_at)
            out.append((s, Event(token, text, reason, logprob=lp, prompt_logprobs=plp)))
            if reason is not None:
                del self.streams[sid]
                m.requests.labels(reason).inc()
        for s, ev in out:
            s.out.put_nowait((s.index, ev))

    def _on_stats(self, stats):
        self._waiting = stats.waiting
        self.metrics.set_state(stats, self._in_inbox)

    def _on_result(self, key, value):
        fut, _ = self.pending.pop(key)
        _settle(fut, error=value) if isinstance(value, Exception) else _settle(fut, value)

    def _on_failed(self, why: str):
        self._failed(why)

    def _failed(self, why: str):
        """The engine is gone: every waiting future gets 503, every running stream ends with
        "abort", and /health says why."""
        if self.error is not None:
            return
        if not self.stopping:
            log.error(why)
        self.error = why
        self.loop.remove_reader(self.core.receive.fileno())
        for fut, _ in self.pending.values():
            _settle(fut, error=HTTPError(503, why))
        self.pending.clear()
        for s in self.streams.values():
            s.out.put_nowait((s.index, Event(None, s.text([], "abort", None), "abort", error=why)))
            self.metrics.requests.labels("abort").inc()
        self.streams.clear()


def _settle(fut: asyncio.Future, result=None, error=None):
    if not fut.done():                            # a client that left cancelled it
        fut.set_exception(error) if error is not None else fut.set_result(result)


# -- the endpoint --------------------------------------------------------------------------------
@dataclass
class ServerState:
    model_name: str
    system: str
    pool: EngineClient
    metrics: ServerMetrics
    draining: bool = False
    completions: dict = field(default_factory=dict)   # completion id -> HTTPRecord (the last MAX_RECORDS)

    def record(self, cid: str, rec: "HTTPRecord"):
        self.completions[cid] = rec
        if len(self.completions) > MAX_RECORDS:
            del self.completions[next(iter(self.completions))]

    async def completions_json(self, since: float) -> bytes:
        """The completions not finished by ``since`` (engine clock), as JSON, encoded in a thread:
        there may be 100k, and the event loop has streams to serve."""
        records = list(self.completions.items())           # a snapshot: the loop adds more meanwhile
        encode = lambda: json.dumps({c: vars(r) for c, r in records if r.finish is None or r.finish > since})
        return (await asyncio.to_thread(encode)).encode()


@dataclass
class HTTPRecord:
    """One completion as the endpoint served it (engine clock): arrival at the app, the first chunk
    holding a token handed to the connection (streams only), the last byte handed over (or when
    its client left)."""
    rids: list[int]
    arrival: float
    first_token: float | None = None
    finish: float | None = None


def build_app(core: EngineProcess, system: str = "orca", max_queue: int = 1024, model_name: str | None = None,
              ready=None, stop_timeout: float = 5.0, debug: bool = False, chat_template: str | None = None) -> FastAPI:
    """The FastAPI app over a started engine process; its lifespan's end stops that engine (which
    cancels what is left and stops its workers). ``ready(app)`` is called once it serves.
    ``debug``: serve ``GET /debug/run``, the engine's own records. ``chat_template``: the Jinja
    template of /v1/chat/completions (default: the tokenizer's ``chat_template``, if it has one)."""
    metrics = ServerMetrics()
    state = ServerState(model_name or core.info.cfg.name, system, EngineClient(core, metrics, max_queue), metrics)

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

    app = FastAPI(title="orca_lab", lifespan=lifespan)
    app.openapi = _openapi_of(app)
    app.state.orca = state
    app.add_middleware(_StampArrival, clock=state.pool.clock)

    @app.exception_handler(HTTPError)
    async def _http_error(request, e: HTTPError):
        return JSONResponse(error_body(e.status, e.message, e.param), e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request, e: StarletteHTTPException):
        """Starlette's own refusals (a body it cannot parse, an unknown path) in OpenAI's shape too."""
        return JSONResponse(error_body(e.status_code, str(e.detail)), e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        message, param = validation_error(e.errors())
        return JSONResponse(error_body(400, message, param), 400)

    @app.get("/health", responses=_errors(503))
    async def health():
        if state.pool.error or not state.pool.alive:
            raise HTTPError(503, state.pool.error or "the engine is not running")
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
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
        text = prompt_of(body.messages, body.add_generation_prompt)
        try:
            comp = CompletionRequest(prompt=text, **body.completion_fields(await request.json()))
        except ValidationError as e:
            raise HTTPError(400, *validation_error(e.errors())) from None
        out = await _complete(state, comp, request)
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
        text = body.prompt if body.prompt is not None else prompt_of(body.messages, body.add_generation_prompt)
        ids = tokenizer.encode(text)
        return {"count": len(ids), "max_model_len": core.info.cfg.max_seq_len, "tokens": ids,
                "token_strs": [tokenizer.decode([t]) for t in ids] if body.return_token_strs else None}

    @app.post("/detokenize", responses=_errors(400, 404))
    async def detokenize(body: DetokenizeRequest):
        """vLLM's: the text of ``tokens``."""
        _check_model(state, body.model)
        if tokenizer is None:
            raise HTTPError(400, f"model {state.model_name!r} has no tokenizer: it takes token ids only", "tokens")
        vocab = core.info.cfg.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise HTTPError(400, f"tokens holds {bad}: out of the vocabulary, allowed [0, {vocab - 1}]", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    return app


def _check_model(state: ServerState, model: str | None):
    if model is not None and model != state.model_name:
        raise HTTPError(404, f"model={model!r} does not exist: this server serves {state.model_name!r}", "model")


async def _complete(state: ServerState, body: CompletionRequest, request: Request):
    """A completion request, from its checks to its answer: the whole ``CompletionResponse``, a
    stream of server-sent events, or 499 when its client left first."""
    arrival = request.scope["orca_arrival"]
    streams = _streams(state, body, arrival)
    cid = f"cmpl-{uuid.uuid4().hex}"
    try:
        await state.pool.submit(streams)
    except (ValueError, TypeError) as e:
        raise HTTPError(400, _http_names(str(e)), _param_of(str(e))) from None
    rec = HTTPRecord([s.rid for s in streams], arrival)
    state.record(cid, rec)
    if body.stream:
        return StreamingResponse(_sse(state, body, cid, streams, rec), media_type="text/event-stream")
    try:
        return await _until_done_or_gone(state, request, _collect(state, body, cid, streams), streams)
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


def _model_card(state: ServerState) -> ModelCard:
    ec, cfg = state.pool.core.info.engine_config, state.pool.core.info.cfg
    return ModelCard(id=state.model_name, max_model_len=cfg.max_seq_len, vocab_size=cfg.vocab_size,
                     system=state.system, max_bs=ec.max_bs, n_slots=ec.n_slots)


def _streams(state: ServerState, body: CompletionRequest, arrival: float) -> list[Stream]:
    """One stream per prompt and per ``n``: token ids, sampling parameters; refused here (before the
    engine) if the server is draining or the model is not this one."""
    if state.draining:
        raise HTTPError(503, "the server is shutting down", headers={"Retry-After": str(RETRY_AFTER_S)})
    _check_model(state, body.model)
    tokenizer = state.pool.core.info.tokenizer
    prompts = [_encode(tokenizer, p, i, len(body.prompt)) for i, p in enumerate(body.prompt)]
    out, q = [], asyncio.Queue()
    for i, ids in enumerate(prompts):
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j       # n samples, n different draws
            try:
                params = SamplingParams(max_gen_tokens=max(1, body.max_tokens), temperature=body.temperature,
                                        top_k=body.top_k, top_p=body.top_p, seed=seed,
                                        ignore_eos=body.ignore_eos, stop=tuple(body.stop),
                                        stop_token_ids=tuple(body.stop_token_ids or ()),
                                        logprobs=body.logprobs,
                                        prompt_logprobs=body.logprobs if body.echo else None,
                                        logit_bias=body.bias_pairs(), presence_penalty=body.presence_penalty,
                                        frequency_penalty=body.frequency_penalty,
                                        repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens)
            except ValueError as e:
                raise HTTPError(400, _http_names(str(e)), _param_of(str(e))) from None
            decode = state.pool.decode
            prompt = body.prompt[i]
            echo = "" if not body.echo else prompt if isinstance(prompt, str) else decode(ids) if decode else ""
            out.append(Stream(len(out), ids, params, arrival, q,
                              detokenizer=None if decode is None else Detokenizer(decode, params.stop),
                              prompt_text=echo, echo_only=body.max_tokens == 0))
    return out


def _encode(tokenizer, prompt, i: int, n: int) -> list[int]:
    if not isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        where = "prompt" if n == 1 else f"prompt[{i}]"
        raise HTTPError(400, f"{where} is text but this model has no tokenizer: send token ids", "prompt")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise HTTPError(400, f"prompt={prompt!r} encodes to no token: allowed 1 to max_seq_len - max_tokens "
                        "tokens", "prompt")
    return ids


def _http_names(message: str) -> str:
    """The engine speaks the paper's names; the HTTP client sent OpenAI's."""
    if "max_gen_tokens" in message:
        message += " (max_gen_tokens is the request's max_tokens)"
    return message


def _param_of(message: str) -> str | None:
    for name in ("prompt_logprobs", "prompt", "max_tokens", "max_gen_tokens", "stop_token_ids", "stop", "top_p",
                 "top_k", "temperature", "seed", "eos_token_id", "logprobs", "logit_bias", "min_tokens",
                 "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if message.startswith(name):
            return {"max_gen_tokens": "max_tokens", "prompt_logprobs": "logprobs"}.get(name, name)
    return "prompt" if "prompt" in message else None


async def _events(streams: list[Stream]):
    """``(index, Event)`` until every stream has finished."""
    left = len(streams)
    q = streams[0].out
    while left:
        index, ev = await q.get()
        left -= ev.finish_reason is not None
        yield index, ev


def _usage(streams, outputs, n: int) -> Usage:
    """The prompt counted once per prompt whatever ``n`` (as OpenAI, vLLM and SGLang count it): the
    ``n`` choices of one prompt are consecutive streams."""
    prompt = sum(len(s.prompt) for s in streams[::n])
    completion = sum(len(o) for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class ChoiceWriter:
    """What one choice's events add to its answer: the echoed prompt before its first event, and its
    log-probabilities in OpenAI's shape if asked (the same for a stream's chunks and a whole answer)."""

    def __init__(self, stream: Stream, body: CompletionRequest, decode):
        self.stream, self.started = stream, False
        self.logprobs = LogprobText(decode) if body.logprobs is not None else None

    def text(self, ev: Event) -> str:
        return ev.text if self.started else self.stream.prompt_text + ev.text

    def logprobs_of(self, ev: Event) -> dict | None:
        """This event's entries (the prompt's too with its first, for echo); marks the choice started."""
        first, self.started = not self.started, True
        if self.logprobs is None:
            return None
        pairs = list(zip(self.stream.prompt, ev.prompt_logprobs)) if first and ev.prompt_logprobs else []
        if ev.token is not None:
            pairs.append((ev.token, ev.logprob))
        return self.logprobs.chunk(pairs)


async def _collect(state: ServerState, body: CompletionRequest, cid: str, streams: list[Stream]):
    outputs, texts, reasons = [[] for _ in streams], [[] for _ in streams], [None] * len(streams)
    writers = [ChoiceWriter(s, body, state.pool.decode) for s in streams]
    logprobs = [[] for _ in streams]
    async for i, ev in _events(streams):
        if ev.error is not None:            # the engine died: no answer, not a partial one
            raise HTTPError(503, ev.error)
        if ev.token is not None:
            outputs[i].append(ev.token)
        texts[i].append(writers[i].text(ev))
        logprobs[i].append(writers[i].logprobs_of(ev))
        reasons[i] = ev.finish_reason
    if state.draining and "abort" in reasons:    # cut short at shutdown: say so, not a partial answer
        raise HTTPError(503, "the server is shutting down: the request was aborted once --drain-s ran out")
    ids = body.return_token_ids
    choices = [CompletionChoice(index=i, text="".join(texts[i]), finish_reason=reasons[i],
                                logprobs=None if body.logprobs is None else CompletionLogprobs(**merged(logprobs[i])),
                                token_ids=outputs[i] if ids else None,
                                prompt_token_ids=streams[i].prompt if ids else None) for i in range(len(streams))]
    return CompletionResponse(id=cid, model=state.model_name, choices=choices,
                              usage=_usage(streams, outputs, body.n))


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


async def _sse(state: ServerState, body: CompletionRequest, cid: str, streams: list[Stream], rec: HTTPRecord):
    """Server-sent events: one chunk per token of each choice, its finish reason on its last chunk,
    the usage chunk if asked, then ``[DONE]``. A client that disconnects (the stream is cancelled)
    cancels its unfinished requests: their slots are free within one iteration."""
    outputs, done = [[] for _ in streams], [False] * len(streams)
    writers = [ChoiceWriter(s, body, state.pool.decode) for s in streams]
    head = CompletionResponse(id=cid, model=state.model_name, choices=[]).model_dump(exclude={"choices", "usage"})
    head = json.dumps(head)[:-1] + ', "choices": ['       # every token chunk starts the same way
    try:
        async for i, ev in _events(streams):
            if ev.token is not None:
                outputs[i].append(ev.token)
            done[i] = ev.finish_reason is not None
            choice = {"index": i, "text": writers[i].text(ev), "logprobs": writers[i].logprobs_of(ev),
                      "finish_reason": ev.finish_reason}
            if body.return_token_ids:
                choice["token_ids"] = [] if ev.token is None else [ev.token]
            # a CompletionResponse with this one choice, written by hand: a token's chunk is the
            # server's hottest path (pydantic took ~15x longer)
            data = f"data: {head}{json.dumps(choice)}], \"usage\": null}}\n\n"
            if rec.first_token is None and ev.token is not None:
                rec.first_token = state.pool.clock.now()
            yield data
        if body.include_usage:
            yield _chunk(CompletionResponse(id=cid, model=state.model_name, choices=[],
                                            usage=_usage(streams, outputs, body.n)))
        yield "data: [DONE]\n\n"
    finally:
        rec.finish = state.pool.clock.now()            # [DONE] has been handed over, or the client left
        left = [s for s, d in zip(streams, done) if not d]
        if left:
            state.pool.cancel(left)


def _chunk(resp: CompletionResponse) -> str:
    return f"data: {resp.model_dump_json()}\n\n"


# -- running it ----------------------------------------------------------------------------------
ABORT_GRACE_S = 3.0     # after the drain, for the aborted requests' last chunks and error bodies


class _Server:
    """uvicorn's server, told about SIGINT/SIGTERM: the endpoint stops accepting at once (503),
    uvicorn closes the port and waits up to ``drain_s`` for requests in flight; then every request
    still running is aborted through the engine, so its client reads the end (a stream its
    ``finish_reason: "abort"`` and ``[DONE]``, a non-streaming request a JSON 503), and the
    lifespan's end stops the engine and its workers. uvicorn cancels only what is left
    ``ABORT_GRACE_S`` later (a client that does not read)."""

    def __init__(self, app: FastAPI, sock, drain_s: float):
        import uvicorn
        state = app.state.orca

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                state.draining = True
                super().handle_exit(sig, frame)

            async def shutdown(self, sockets=None):
                state.draining = True
                timer = asyncio.get_running_loop().call_later(drain_s, state.pool.abort_all)
                try:
                    await super().shutdown(sockets)
                finally:
                    timer.cancel()

        config = uvicorn.Config(app, timeout_graceful_shutdown=drain_s + ABORT_GRACE_S, log_level="warning",
                                lifespan="on", access_log=False)
        self.server, self.sock = Server(config), sock

    def run(self):
        # uvicorn raises the signal it drained for again once it is done (the engine stopped and
        # joined by then): SIGTERM then ends the process with code 0, as fast as the signal's
        # default action did (no interpreter teardown), instead of "killed by SIGTERM"
        signal.signal(signal.SIGTERM, _exit_0)
        self.server.run(sockets=[self.sock])


def _exit_0(sig, frame):
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def listen(host: str, port: int):
    """A bound socket; port 0 lets the OS choose (read it back with ``getsockname``)."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)       # now: a client that read the printed URL connects before uvicorn accepts
    return sock


def serve(recipe: EngineRecipe, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 1024,
          drain_s: float = 5.0, model_name: str | None = None, debug: bool = False, chat_template: str | None = None):
    """Serve the model of ``recipe`` until SIGINT/SIGTERM; prints its URL once it accepts requests.
    The port is taken first (a busy one fails at once), then the engine process builds the model."""
    sock = listen(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    ready = lambda app: print(f"orca-lab serve: {app.state.orca.model_name} ({recipe.system}) on {url}", flush=True)
    try:
        core = EngineProcess(recipe)
    except BaseException:
        sock.close()
        raise
    try:
        app = build_app(core, recipe.system, max_queue, model_name, ready, debug=debug, chat_template=chat_template)
        _Server(app, sock, drain_s).run()
    except KeyboardInterrupt:          # uvicorn re-raises the SIGINT it drained for: we are done
        pass
    finally:
        sock.close()
        core.join(5.0)                 # already gone unless uvicorn never ran the lifespan's end
