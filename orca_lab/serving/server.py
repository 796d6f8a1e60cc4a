"""``orca-lab serve``: an OpenAI-compatible endpoint over the engine loop (ORCA §3, Figure 4).

The endpoint (FastAPI on an asyncio event loop) checks each request and hands it to the request
pool; the engine thread owns the ``Engine`` and runs Algorithm 1's iterations over that pool. They
meet at two places only: a thread-safe inbox (endpoint -> engine: add, abort, snapshot, stop) and
each HTTP request's asyncio queue (engine -> endpoint: one ``call_soon_threadsafe`` per iteration
carries that iteration's tokens). No engine work runs on the event loop, so a long iteration never
stalls the HTTP side, and the engine never waits on a slow client.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import queue
import threading
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from orca_lab.engine.request import SamplingParams
from orca_lab.serving.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from orca_lab.serving.protocol import (CompletionChoice, CompletionRequest, CompletionResponse, ModelCard,
                                       ModelList, Usage, error_body, validation_error)

log = logging.getLogger("orca_lab.serve")
RETRY_AFTER_S = 1
MAX_RECORDS = 100_000          # completions whose HTTP records /debug/run keeps
HISTORY = 10_000               # requests and iterations the engine keeps for /debug/run (twice at most)


class HTTPError(Exception):
    """Refuse a request with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


@dataclass(frozen=True)
class Event:
    """What the engine thread sends a choice: a token (None when it ends without one), the text so
    far, and its finish reason once it is done."""
    token: int | None
    text: str
    finish_reason: str | None = None


@dataclass(eq=False)
class Stream:
    """One prompt of a completion request (one choice), as the endpoint follows it."""
    index: int
    prompt: list[int]
    params: SamplingParams
    arrival: float                 # at the endpoint, on the engine's clock
    out: asyncio.Queue             # shared by the choices of one HTTP request: (index, Event)
    rid: int | None = None         # set by the engine thread once the engine holds it
    last: float = 0.0              # engine clock of its last token (engine thread only)


class EngineThread:
    """The engine in a thread of its own, fed by a thread-safe inbox: the paper's request pool."""

    def __init__(self, engine, metrics: ServerMetrics, max_queue: int):
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[int, Stream] = {}          # rid -> stream still running (engine thread)
        self.error: str | None = None                 # why the engine thread stopped, if it failed
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._in_inbox = 0                            # accepted, not handed to the engine yet
        self._waiting = 0                             # never scheduled (engine), as last published
        self._n_records = 0
        self.text = engine.tokenizer is not None      # without one, answers carry token ids only
        self._thread = threading.Thread(target=self._run, name="orca-engine", daemon=True)

    @property
    def clock(self):
        return self.engine.clock                      # reading it is thread-safe

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the event loop's side -----------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._publish()
        self._thread.start()

    def submit(self, streams: list[Stream]) -> asyncio.Future:
        """Queue ``streams`` for the engine; the future settles once the engine took them (or
        refused them: ValueError/TypeError). Past ``max_queue`` waiting requests: 503."""
        if not self._thread.is_alive():
            raise HTTPError(503, self.error or "the engine is not running")
        with self._lock:
            waiting = self._in_inbox + self._waiting
            if waiting + len(streams) > self.max_queue:
                raise HTTPError(503, f"the server is overloaded: {waiting} requests waiting, max_queue="
                                f"{self.max_queue}; retry after {RETRY_AFTER_S} s",
                                headers={"Retry-After": str(RETRY_AFTER_S)})
            self._in_inbox += len(streams)
        fut = self.loop.create_future()
        self.inbox.put(("add", streams, fut))
        return fut

    def cancel(self, streams: list[Stream]):
        self.inbox.put(("abort", streams, None))

    def call(self, fn) -> asyncio.Future:
        """Run ``fn(engine)`` on the engine thread, between two iterations."""
        fut = self.loop.create_future()
        self.inbox.put(("call", fn, fut))
        return fut

    def stop(self, timeout: float = 5.0):
        """Cancel what is left, stop the engine and its workers, and join the thread."""
        if self._thread.is_alive():
            self.inbox.put(("stop", None, None))
            self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self):
        engine = self.engine
        try:
            while True:
                msgs = self._messages(block=not engine.has_work())
                if any(kind == "stop" for kind, _, _ in msgs):
                    self._cancel_all(msgs)
                    return
                for kind, arg, fut in msgs:
                    {"add": self._add, "abort": self._abort, "call": self._call}[kind](arg, fut)
                if engine.has_work():
                    self._deliver_step(engine.step(timeout=0.01))
                else:
                    self._publish()
        except BaseException as e:                    # a bug: fail every client, report unhealthy
            log.exception("engine thread failed")
            self.error = f"engine thread failed: {e!r}"
            self._cancel_all([])
        finally:
            engine.close()

    def _messages(self, block: bool) -> list:
        msgs = []
        try:
            msgs.append(self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait())
            while True:
                msgs.append(self.inbox.get_nowait())
        except queue.Empty:
            return msgs

    def _add(self, streams: list[Stream], fut):
        engine = self.engine
        try:                                          # checked by the endpoint already
            for s in streams:
                s.rid = engine.add_request(s.prompt, s.params, arrival=s.arrival).rid
                s.last = s.arrival
                self.streams[s.rid] = s
        except (ValueError, TypeError) as e:
            self._settle(fut, error=e)
        else:
            self._settle(fut)
        finally:
            with self._lock:
                self._in_inbox -= len(streams)
                self._waiting = engine.stats().waiting

    def _abort(self, streams: list[Stream], _):
        out = []
        for s in streams:
            if self.streams.pop(s.rid, None) is not None and self.engine.abort(s.rid):
                out.append((s, Event(None, "", "abort")))
                self.metrics.requests.labels("abort").inc()
        self._send(out)

    def _call(self, fn, fut):
        try:
            self._settle(fut, fn(self.engine))
        except Exception as e:
            self._settle(fut, error=e)

    def _deliver_step(self, events):
        now, out, m = self.clock.now(), [], self.metrics
        for req, token in events:
            s = self.streams.get(req.rid)
            if s is None:                              # aborted meanwhile: its token is dropped
                continue
            (m.ttft if len(req.output) == 1 else m.itl).observe(now - s.last)
            s.last = now
            out.append((s, Event(token, req.text if self.text else "", req.finish_reason)))
            if req.finished:
                del self.streams[req.rid]
                m.requests.labels(req.finish_reason).inc()
        records = self.engine.records
        for rec in records[self._n_records:]:
            if rec.stage == 0:
                m.iteration_tokens.observe(rec.n_tokens)
        self._n_records = len(records)
        if len(records) > 2 * HISTORY or len(self.engine.requests) > 2 * HISTORY:
            self.engine.forget(HISTORY, HISTORY)       # a server runs for days: keep its memory bounded
            self._n_records = len(self.engine.records)
        self._send(out)

    def _cancel_all(self, msgs):
        """Shutting down (or failed): every running request ends with "abort", every add waiting in
        the inbox is refused with 503, and nothing is left in the engine."""
        for kind, arg, fut in msgs:
            if kind == "add":
                self._settle(fut, error=HTTPError(503, "the server is shutting down"))
        self._abort(list(self.streams.values()), None)

    def _publish(self):
        stats = self.engine.stats()
        self._waiting = stats.waiting
        self.metrics.set_state(stats, self._in_inbox)

    def _send(self, out):
        """Hand ``out`` to the event loop, the gauges first: a client that reads /metrics as soon
        as it got a token sees the state that token came from."""
        self._publish()
        if out:
            self.loop.call_soon_threadsafe(_put_events, out)

    def _settle(self, fut, result=None, error=None):
        if fut is not None:
            self.loop.call_soon_threadsafe(_settle_future, fut, result, error)


def _put_events(out):
    for s, ev in out:
        s.out.put_nowait((s.index, ev))


def _settle_future(fut: asyncio.Future, result, error):
    if not fut.done():                            # a client that left cancelled it
        fut.set_exception(error) if error is not None else fut.set_result(result)


# -- the endpoint --------------------------------------------------------------------------------
@dataclass
class ServerState:
    llm: object
    model_name: str
    system: str
    pool: EngineThread
    metrics: ServerMetrics
    draining: bool = False
    completions: dict = field(default_factory=dict)   # completion id -> HTTPRecord (the last MAX_RECORDS)

    def record(self, cid: str, rec: "HTTPRecord"):
        self.completions[cid] = rec
        if len(self.completions) > MAX_RECORDS:
            del self.completions[next(iter(self.completions))]


@dataclass
class HTTPRecord:
    """One completion as the endpoint served it (engine clock): arrival at the app, the first chunk
    holding a token handed to the connection (streams only), the last byte handed over."""
    rids: list[int]
    arrival: float
    first_token: float | None = None
    finish: float | None = None


def build_app(llm, system: str = "orca", max_queue: int = 1024, model_name: str | None = None,
              ready=None) -> FastAPI:
    """The FastAPI app over a fresh engine of ``llm``; its lifespan starts and stops the engine
    thread. ``ready(app)`` is called once it serves."""
    metrics = ServerMetrics()
    state = ServerState(llm, model_name or llm.cfg.name, system, EngineThread(llm.new_engine(system), metrics,
                                                                              max_queue), metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.pool.start(asyncio.get_running_loop())
        if ready is not None:
            ready(app)
        try:
            yield
        finally:
            state.draining = True
            await asyncio.to_thread(state.pool.stop)

    app = FastAPI(title="orca_lab", lifespan=lifespan)
    app.state.orca = state
    app.add_middleware(_StampArrival, clock=state.pool.clock)

    @app.exception_handler(HTTPError)
    async def _http_error(request, e: HTTPError):
        return JSONResponse(error_body(e.status, e.message, e.param), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        message, param = validation_error(e.errors())
        return JSONResponse(error_body(400, message, param), 400)

    @app.get("/health")
    async def health():
        if state.pool.error or not state.pool.alive:
            raise HTTPError(503, state.pool.error or "the engine is not running")
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[_model_card(state)])

    @app.get("/metrics")
    async def metrics_page():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/run")
    async def run_records():
        """The engine's ``RunResult`` so far (per-request and per-iteration records, engine clock),
        and which engine requests served each completion id."""
        result = await state.pool.call(lambda engine: engine.result().to_json())
        return {**result, "completions": {c: dataclasses.asdict(r) for c, r in state.completions.items()}}

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request):
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
        resp = await _until_done_or_gone(state, request, _collect(state, body, cid, streams), streams)
        rec.finish = state.pool.clock.now()
        return resp

    return app


class _StampArrival:
    """ASGI middleware: a request's arrival is the first moment the app sees it (engine clock), before
    its body is read and checked, so the server's records count that time too."""

    def __init__(self, app, clock):
        self.app, self.clock = app, clock

    async def __call__(self, scope, receive, send):
        scope["orca_arrival"] = self.clock.now()
        await self.app(scope, receive, send)


def _model_card(state: ServerState) -> ModelCard:
    ec, cfg = state.llm.engine_config, state.llm.cfg
    return ModelCard(id=state.model_name, max_model_len=cfg.max_seq_len, vocab_size=cfg.vocab_size,
                     system=state.system, max_bs=ec.max_bs, n_slots=ec.n_slots)


def _streams(state: ServerState, body: CompletionRequest, arrival: float) -> list[Stream]:
    """One stream per prompt and per ``n``: token ids, sampling parameters; refused here (before the
    engine) if the server is draining or the model is not this one."""
    if state.draining:
        raise HTTPError(503, "the server is shutting down", headers={"Retry-After": str(RETRY_AFTER_S)})
    if body.model is not None and body.model != state.model_name:
        raise HTTPError(404, f"model={body.model!r} does not exist: this server serves "
                        f"{state.model_name!r}", "model")
    prompts = [_encode(state.llm.tokenizer, p, i, len(body.prompt)) for i, p in enumerate(body.prompt)]
    out, q = [], asyncio.Queue()
    for i, ids in enumerate(prompts):
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j       # n samples, n different draws
            try:
                params = SamplingParams(max_gen_tokens=body.max_tokens, temperature=body.temperature,
                                        top_k=body.top_k, top_p=body.top_p, seed=seed,
                                        ignore_eos=body.ignore_eos, stop=tuple(body.stop),
                                        stop_token_ids=tuple(body.stop_token_ids or ()))
            except ValueError as e:
                raise HTTPError(400, _http_names(str(e)), _param_of(str(e))) from None
            out.append(Stream(len(out), _checked(state, ids, params), params, arrival, q))
    return out


def _checked(state: ServerState, prompt, params) -> list[int]:
    """The engine's own submission checks (vocabulary, max length, K/V slots), run here so that a
    request is refused whole, before any of its prompts is accepted (they read fixed settings only)."""
    try:
        return state.pool.engine.check_request(prompt, params)
    except (ValueError, TypeError) as e:
        raise HTTPError(400, _http_names(str(e)), _param_of(str(e))) from None


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
    for name in ("prompt", "max_tokens", "max_gen_tokens", "stop_token_ids", "stop", "top_p", "top_k",
                 "temperature", "seed", "eos_token_id"):
        if message.startswith(name):
            return "max_tokens" if name == "max_gen_tokens" else name
    return "prompt" if "prompt" in message else None


async def _events(streams: list[Stream]):
    """``(index, Event)`` until every stream has finished."""
    left = len(streams)
    q = streams[0].out
    while left:
        index, ev = await q.get()
        left -= ev.finish_reason is not None
        yield index, ev


def _usage(streams, outputs) -> Usage:
    prompt = sum(len(s.prompt) for s in streams)
    completion = sum(len(o) for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _collect(state: ServerState, body: CompletionRequest, cid: str, streams: list[Stream]):
    outputs, texts, reasons = [[] for _ in streams], [""] * len(streams), [None] * len(streams)
    async for i, ev in _events(streams):
        if ev.token is not None:
            outputs[i].append(ev.token)
        texts[i], reasons[i] = (ev.text if ev.token is not None else texts[i]), ev.finish_reason
    ids = body.return_token_ids
    choices = [CompletionChoice(index=i, text=texts[i], finish_reason=reasons[i],
                                token_ids=outputs[i] if ids else None,
                                prompt_token_ids=streams[i].prompt if ids else None) for i in range(len(streams))]
    return CompletionResponse(id=cid, model=state.model_name, choices=choices, usage=_usage(streams, outputs))


async def _until_done_or_gone(state: ServerState, request: Request, work, streams: list[Stream]):
    """Await ``work``; a client that disconnects first cancels its requests (vLLM does the same)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            state.pool.cancel(streams)
        gone.cancel()
    return task.result() if not task.cancelled() else Response(status_code=499)


async def _disconnected(request: Request):
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(state: ServerState, body: CompletionRequest, cid: str, streams: list[Stream], rec: HTTPRecord):
    """Server-sent events: one chunk per token of each choice, its finish reason on its last chunk,
    the usage chunk if asked, then ``[DONE]``. A client that disconnects (the stream is cancelled)
    cancels its unfinished requests: their slots are free within one iteration."""
    sent, outputs, done = [0] * len(streams), [[] for _ in streams], [False] * len(streams)
    head = CompletionResponse(id=cid, model=state.model_name, choices=[]).model_dump(exclude={"choices", "usage"})
    head = json.dumps(head)[:-1] + ', "choices": ['       # every token chunk starts the same way
    try:
        async for i, ev in _events(streams):
            text = ev.text[sent[i]:] if ev.token is not None else ""
            sent[i] += len(text)
            if ev.token is not None:
                outputs[i].append(ev.token)
            done[i] = ev.finish_reason is not None
            choice = {"index": i, "text": text, "logprobs": None, "finish_reason": ev.finish_reason}
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
                                            usage=_usage(streams, outputs)))
        yield "data: [DONE]\n\n"
        rec.finish = state.pool.clock.now()            # [DONE] has been handed to the connection
    finally:
        left = [s for s, d in zip(streams, done) if not d]
        if left:
            state.pool.cancel(left)


def _chunk(resp: CompletionResponse) -> str:
    return f"data: {resp.model_dump_json()}\n\n"


# -- running it ----------------------------------------------------------------------------------
class _Server:
    """uvicorn's server, told about SIGINT/SIGTERM: the endpoint stops accepting at once (503),
    uvicorn closes the port and waits up to ``drain_s`` for requests in flight, cancels the rest,
    and the lifespan's end stops the engine thread and its workers."""

    def __init__(self, app: FastAPI, sock, drain_s: float):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                app.state.orca.draining = True
                super().handle_exit(sig, frame)

        config = uvicorn.Config(app, timeout_graceful_shutdown=drain_s, log_level="warning", lifespan="on",
                                access_log=False)
        self.server, self.sock = Server(config), sock

    def run(self):
        self.server.run(sockets=[self.sock])


def listen(host: str, port: int):
    """A bound socket; port 0 lets the OS choose (read it back with ``getsockname``)."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve(llm, system: str = "orca", host: str = "127.0.0.1", port: int = 8000, max_queue: int = 1024,
          drain_s: float = 5.0, model_name: str | None = None):
    """Serve ``llm`` until SIGINT/SIGTERM; prints its URL once it accepts requests."""
    sock = listen(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    ready = lambda app: print(f"orca-lab serve: {app.state.orca.model_name} ({system}) on {url}", flush=True)
    app = build_app(llm, system, max_queue, model_name, ready)
    try:
        _Server(app, sock, drain_s).run()
    except KeyboardInterrupt:          # uvicorn re-raises the SIGINT it drained for: we are done
        pass
    finally:
        sock.close()
