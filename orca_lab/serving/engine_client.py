"""The endpoint's side of the engine process: the request pool's door (submit, cancel, call) and
the reader that turns each iteration's message into tokens, text and metrics, on the event loop."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

from orca_lab.engine.detokenizer import Detokenizer, undecodable
from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.serving.engine_core import SHUTTING_DOWN, EngineProcess
from orca_lab.serving.metrics import ServerMetrics

log = logging.getLogger("orca_lab.serve")
RETRY_AFTER_S = 1
REAP_S = 10.0           # how long the endpoint waits for an engine that closed its pipe to exit


class HTTPError(Exception):
    """Refuse a request with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


@dataclass(frozen=True)
class Event:
    """What a choice receives: a token (None when it ends without one), the text that became
    visible with it, its finish reason once it is done, and ``error``: why it failed alone
    (finish_reason "error"), or why the engine failed (finish_reason "abort")."""
    token: int | None
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprob: object = None              # the token's TokenLogprob, if the request asked
    prompt_logprobs: list | None = None  # with a request's first event, if it asked (echo)
    matched_stop: int | str | None = None  # with its last: the stop token id or string that ended it


@dataclass(eq=False)
class Stream:
    """One prompt of a completion request (one choice), as the endpoint follows it."""
    index: int
    prompt: list[int]
    params: SamplingParams
    arrival: float                 # at the endpoint, on the engine's clock
    out: asyncio.Queue             # shared by the choices of one HTTP request: (index, Event)
    stream_id: int = -1            # the endpoint's name for it, known to the engine
    rid: int | None = None         # the engine's, once it holds it
    t_last: float = 0.0            # engine clock of its last token
    output: list[int] = field(default_factory=list)
    detokenizer: Detokenizer | None = None     # its text (None: the model has no tokenizer)
    prompt_text: str = ""                      # what echo puts before the completion
    echo_only: bool = False                    # max_tokens=0 with echo: the engine's one token is dropped

    def text(self, tokens: list[int], finish_reason: str | None, stop_at: int | None) -> str:
        """The text that ``tokens`` (one, or none when the request ended without one) made visible."""
        if self.detokenizer is None:
            return ""
        return self.detokenizer.update(tokens, finish_reason, stop_at)

    def matched_stop(self, token: int | None, finish_reason: str | None, stop_at: int | None) -> int | str | None:
        """SGLang's ``matched_stop``: what ended the choice with "stop", the token id (EOS or a stop
        token, ``stop_at`` None) or the stop string that begins at ``stop_at`` of its text."""
        if finish_reason != "stop" or self.echo_only:
            return None
        if stop_at is None:
            return token
        rest = self.detokenizer.decode(self.output)[stop_at:]
        return next((s for s in self.params.stop if rest.startswith(s)), None)


class EngineClient:
    """The endpoint's side of the engine process: the request pool's door (``submit``, ``cancel``,
    ``call``), and the reader that turns each iteration's message into tokens, text and metrics.
    Everything here runs on the event loop: no lock."""

    def __init__(self, core: EngineProcess, metrics: ServerMetrics, max_queue: int):
        self.core, self.metrics, self.max_queue = core, metrics, max_queue
        self.tokenizer = core.info.tokenizer
        self.decode = getattr(self.tokenizer, "decode", None)   # None: answers carry token ids only
        self.streams: dict[int, Stream] = {}          # stream_id -> stream the engine holds
        self.pending: dict[int, tuple[asyncio.Future, list[Stream]]] = {}   # adds and calls unanswered
        self.error: str | None = None                 # why the engine stopped, if it failed
        self.loop: asyncio.AbstractEventLoop | None = None
        self._call_ids, self._stream_ids = itertools.count(), itertools.count()
        self.stopping = False                         # asked to stop: its exit is no failure
        self.exiting: str | None = None               # why the engine failed, as it said before it exits
        self._reading = False
        self._in_inbox = 0                            # sent to the engine, not answered yet
        self._waiting = 0                             # never scheduled (engine), as last reported
        self.stalled: str | None = None               # where the engine is stuck, as its watchdog said
        self.heard = time.monotonic()                 # when the engine last sent anything (or was asked, idle)
        self.on_dead = None                           # called with why, once the engine failed (server.py)

    @property
    def clock(self):
        return self.core.clock

    @property
    def alive(self) -> bool:
        return self.error is None and self._reading and self.exiting is None and self.core.proc.is_alive()

    def unhealthy(self) -> str | None:
        """Why the engine cannot serve now, or None: it is dead, its watchdog says an iteration is
        stuck, or it has sent nothing for its ``stall_s`` while it holds requests (a process that cannot
        run at all, whose watchdog cannot speak either)."""
        if not self.alive:
            return self.error or self.exiting or "the engine is not running"   # (exiting: said, not reaped yet)
        if self.stalled is not None:
            return self.stalled
        silent = time.monotonic() - self.heard
        if (self.streams or self.pending) and silent > self.core.stall_s:
            return (f"the engine is stuck: it has sent nothing for {silent:.0f} s while it holds "
                    f"{len(self.streams)} requests")
        return None

    def start(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        loop.add_reader(self.core.receive.fileno(), self._on_readable)
        self._reading = True

    def submit(self, streams: list[Stream], field: str = "n") -> asyncio.Future:
        """Send ``streams`` to the engine; the future settles once the engine took them all (or
        refused them: ValueError/TypeError). Past ``max_queue`` waiting requests: 503; more streams
        than it can ever hold: 400 naming ``field``, what made them so many (prompts, or ``n``)."""
        if why := self.unhealthy():                        # dead, or stuck: it would never be served
            raise HTTPError(503, why)
        if len(streams) > self.max_queue:           # not a matter of time: retrying never helps
            raise HTTPError(400, f"the request is {len(streams)} sequences (prompts x n), more than max_queue="
                            f"{self.max_queue} waiting requests (--max-queue) can ever hold: send at most "
                            f"{self.max_queue}", field)
        waiting = self._in_inbox + self._waiting
        if waiting + len(streams) > self.max_queue:
            raise HTTPError(503, f"the server is overloaded: {waiting} requests waiting, max_queue="
                            f"{self.max_queue}; retry after {RETRY_AFTER_S} s",
                            headers={"Retry-After": str(RETRY_AFTER_S)})
        for s in streams:
            s.stream_id = next(self._stream_ids)
        self._in_inbox += len(streams)
        self.metrics.waiting.set(self._waiting + self._in_inbox)     # accepted is waiting, before the engine says so
        fut = self._expect(streams)
        self._send(("add", fut.call_id, [(s.stream_id, s.prompt, s.params, s.arrival) for s in streams]))
        return fut

    def cancel(self, streams: list[Stream]):
        self._send(("abort", [s.stream_id for s in streams]))

    def abort_all(self):
        """End every request the engine holds with "abort" (the drain time is over): each stream's
        client reads its end, as the engine's answer comes back like any other."""
        if self.streams:
            self._send(("abort", list(self.streams)))

    def call(self, name: str, *args) -> asyncio.Future:
        """``name(engine, *args)`` run by the engine between two iterations (``EngineLoop._call``)."""
        fut = self._expect([])
        self._send(("call", fut.call_id, name, args))
        return fut

    def stop(self):
        """Ask the engine to cancel what is left and exit (then ``core.join``)."""
        self._send(("stop",))
        self.stopping = True

    def close(self):
        self._stop_reading()
        self.core.send.close(), self.core.receive.close()

    def _expect(self, streams) -> asyncio.Future:
        fut = self.loop.create_future()
        fut.call_id = next(self._call_ids)
        if not (self.streams or self.pending):     # an idle engine has nothing to say: its silence
            self.heard = time.monotonic()          # counts from when it is first asked again
        self.pending[fut.call_id] = (fut, streams)
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
                self.heard = time.monotonic()
                getattr(self, "_on_" + msg[0])(*msg[1:])
        except (EOFError, OSError):                   # it is exiting: join it (no zombie), then say how
            self._stop_reading()
            if self.stopping:                         # the lifespan's end joins it
                self._failed("the server is shutting down")
            else:
                self.loop.create_task(self._reap())

    async def _reap(self):
        await asyncio.to_thread(self.core.proc.join, REAP_S)
        why = f": {self.exiting}" if self.exiting else ""
        self._failed(f"the engine process exited (code {self.core.proc.exitcode}){why}")

    def _stop_reading(self):
        if self._reading:
            self._reading = False
            self.loop.remove_reader(self.core.receive.fileno())

    def _on_added(self, call_id, answer):
        fut, streams = self.pending.pop(call_id)
        self._in_inbox -= len(streams)
        if isinstance(answer, list):
            for s, rid in zip(streams, answer):
                s.rid, s.t_last = rid, s.arrival
                self.streams[s.stream_id] = s
            _settle(fut)
        else:
            _settle(fut, error=HTTPError(503, "the server is shutting down") if answer is SHUTTING_DOWN else answer)

    def _on_out(self, now, items, stats, iteration_tokens):
        m, out = self.metrics, []
        self._on_stats(stats)                          # first: a client that reads /metrics as soon
        for n in iteration_tokens:                     # as it got a token sees the state it came from
            m.iteration_tokens.observe(n)
        for stream_id, token, reason, stop_at, lp, plp, error in items:
            s = self.streams.get(stream_id)
            if s is None:
                continue
            if s.echo_only:                            # the prompt alone was asked for
                token, lp, reason = None, None, reason and ("abort" if reason == "abort" else "length")
            if token is not None:
                (m.ttft if not s.output else m.itl).observe(now - s.t_last)
                s.t_last = now
                s.output.append(token)
            try:
                text = "" if s.echo_only else s.text([] if token is None else [token], reason, stop_at)
                matched = s.matched_stop(token, reason, stop_at)
            except Exception as e:        # its tokenizer cannot decode its tokens: it alone fails
                if reason is None:
                    self.cancel([s])          # its slots free; the engine's answer finds no stream
                text, matched, reason, error = "", None, "error", undecodable(e)
            out.append((s, Event(token, text, reason, error, lp, plp, matched)))
            if reason is not None:
                del self.streams[stream_id]
                m.requests.labels(reason).inc()
        for s, ev in out:
            s.out.put_nowait((s.index, ev))

    def _on_stats(self, stats):
        self._waiting = stats.waiting
        self.metrics.set_state(stats, self._in_inbox)

    def _on_result(self, call_id, value):
        fut, _ = self.pending.pop(call_id)
        _settle(fut, error=value) if isinstance(value, Exception) else _settle(fut, value)

    def _on_stalled(self, why: str):
        log.error(why)
        self.stalled = why

    def _on_progress(self):
        log.warning("the engine makes progress again (it was stuck: %s)", self.stalled)
        self.stalled = None

    def _on_failed(self, why: str):
        """The engine raised (its traceback is in the server's log): it exits next, and its pipe's
        end tells (``_on_readable``)."""
        self.exiting = why

    def _failed(self, why: str):
        """The engine is gone: every waiting future gets 503, every running stream ends with
        "abort", and /health says why."""
        if self.error is not None:
            return
        if not self.stopping:
            log.error(why)
        self.error = why
        if not self.stopping and self.on_dead is not None:
            self.on_dead(why)
        self._stop_reading()
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

