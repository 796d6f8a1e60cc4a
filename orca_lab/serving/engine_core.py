"""The engine in a process of its own: the paper's request pool and Algorithm 1's loop, apart from
the endpoint (vLLM's EngineCore does the same).

Why a process and not a thread: between its kernels the engine runs Python, and so does the event
loop for every SSE chunk it writes; in one process they take turns on one GIL. On a 2-core machine
the server's engine ran ~25% slower than the same engine in process, and a token's chunk waited for
the GIL (p99 inter-token latency ~3x the iteration). In a process the engine keeps a core's worth
of Python to itself, and what it sends is one small message per iteration.

The two ends talk over two one-way pipes between this parent and its own child (no port, no other
peer), as pickled tuples:

    endpoint -> engine   ("add", call_id, [(stream_id, prompt, params, arrival)])   ("abort", [stream_id])
                         ("call", call_id, name, args)                        ("stop",)
    engine -> endpoint   ("ready", EngineInfo)   ("added", call_id, [rid] | exception | None)
                         ("out", now, [(stream_id, token, finish_reason, stop_at, logprob, prompt_logprobs,
                                        error)], stats, [n_tokens])
                         ("stats", stats)        ("result", call_id, value | exception)   ("failed", why)
                         ("stalled", why)        ("progress",)

``stream_id`` is the endpoint's name for a stream: the endpoint can cancel a stream before the engine's
answer with its rid has come back. A finish reason comes with a stream's last token only. Text is
made on the endpoint's side from the token ids (each stream's ``Detokenizer``): detokenizing is not
the engine's work, except for requests with stop strings, whose end it decides (``stop_at`` None
with "stop": the last token, a stop token or EOS, is no text). ``logprob`` (the token's
``TokenLogprob``) and ``prompt_logprobs`` (with a request's first token) are None unless it asked.
A request that failed alone (finish_reason "error", ``Request.fail``) ends with no token and its
``error``; the engine goes on. "stalled" says an iteration has outlasted the watchdog's bound and
where the engine is stuck (``watchdog.py``); "progress", that it returned after all.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import queue
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from orca_lab.config import EngineConfig
from orca_lab.engine.clock import RealClock
from orca_lab.serving.watchdog import STALL_S, Watchdog

HISTORY = 10_000          # requests and iterations the engine keeps for /debug/run (twice at most)
SHUTTING_DOWN = None      # an "added" answer: the engine is stopping and took nothing


@dataclass(frozen=True)
class EngineArgs:
    """What the engine process builds its ``LLM`` from: a preset (random weights of ``seed``) or a
    checkpoint directory, the engine's settings, the system, and torch's intra-op threads."""
    model: str
    seed: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    system: str = "orca"
    threads: int = 1
    plugins: str | None = None     # a learner's package (a folder or a module name): course/plug.py's pieces
    tensor_ranks: int = 1          # with plugins: the model on this many ranks cut by the learner's split_linear
    stall_s: float = STALL_S       # an iteration longer than this is a stuck engine (watchdog.py)

    def __post_init__(self):
        """Refuse a bad model or parallel degrees here, before a process is started for it."""
        from orca_lab.config import check_degrees, check_range, model_config
        from orca_lab.model.families import checkpoint_config
        path = Path(self.model)
        check_degrees(checkpoint_config(path) if path.is_dir() else model_config(self.model), self.engine)
        check_range("tensor_ranks", self.tensor_ranks, 1, 64)
        check_range("stall_s", self.stall_s, 0.1, 86400.0, kind=float)
        if self.tensor_ranks > 1 and self.plugins is None:
            raise ValueError(f"tensor_ranks={self.tensor_ranks} runs the model on a learner's split_linear and "
                             "all_reduce: give plugins too (--plugins FOLDER)")
        if self.plugins is not None:      # the engine process imports it: a folder by its absolute path
            from orca_lab.course.mine import resolve
            object.__setattr__(self, "plugins", resolve(self.plugins))

    def build(self):
        import torch
        from orca_lab.llm import LLM
        torch.set_num_threads(self.threads)
        if Path(self.model).is_dir():
            return LLM.from_pretrained(self.model, engine=self.engine)
        return LLM(self.model, seed=self.seed, engine=self.engine)


@dataclass(frozen=True)
class EngineInfo:
    """What the endpoint needs of the model: its shape, the settings as resolved (``n_slots`` on a
    GPU), and its tokenizer (None: token ids only)."""
    cfg: object
    engine_config: EngineConfig
    tokenizer: object
    eos_token_ids: tuple = ()      # every id that ends a request not ignoring EOS (beam search reads them)


# -- the engine's side (the child process) ---------------------------------------------------------
def engine_main(recipe: EngineArgs, inbox, outbox, t0: float, history: int = 0):
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: the endpoint drains its
    # requests first and then stops us, or we stop when it is gone (the pipe closes; before we serve,
    # the orphan watch).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    serving = threading.Event()
    _end_if_orphaned(mp.parent_process().pid, serving)
    try:
        llm = recipe.build()
        if llm.engine_config.device.startswith("cuda"):
            llm.warm_up()        # graphs and tuned launches at every shape before the first request
        engine = llm.new_engine(recipe.system)
        loop = None if recipe.plugins is None else plug_learner(engine, recipe.plugins, recipe.tensor_ranks,
                                                                recipe.stall_s)
    except (ValueError, TypeError) as e:        # bad settings (a model too big for the GPU): the same error
        outbox.send(("failed", e))
        return
    except BaseException as e:
        outbox.send(("failed", f"the engine could not start: {e!r}"))
        return
    engine.clock.t0 = t0                       # one clock for both processes (perf_counter is system-wide)
    outbox.send(("ready", EngineInfo(llm.cfg, llm.engine_config, llm.tokenizer, llm.eos_token_ids)))
    outbox.send(("stats", engine.stats()))      # the gauges from the start (kv_slots_total)
    serving.set()                               # from here a closed pipe ends the loop
    EngineLoop(engine, inbox, outbox, history, recipe.stall_s, recipe.plugins, loop, recipe.stall_s).run()


PR_SET_PDEATHSIG = 1      # Linux's prctl option: a signal for this process when its parent dies


def _end_if_orphaned(parent_pid: int, serving: threading.Event):
    """Until the engine serves, nothing reads the pipe: an endpoint killed while the model loads (a
    SIGTERM to it alone, which this process ignores) would leave it building a model no one will use,
    growing to the host's memory for a large one. Linux signals us when the parent dies (no thread:
    one would change the process's memory); then the engine ends, its workers first. Elsewhere, the
    pipe alone ends it, once it serves."""
    def orphaned(sig=None, frame=None):
        if serving.is_set() or os.getppid() == parent_pid:    # serving: the closed pipe ends the loop
            return
        for child in mp.active_children():
            child.kill()
        os._exit(1)

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    signal.signal(signal.SIGUSR1, orphaned)
    prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
    orphaned()                   # (the parent may have died before we asked)


def plug_learner(engine, plugins: str, tensor_ranks: int = 1, bound_s: float | None = None):
    """The learner's pieces in place of the package's (``orca-lab serve --plugins``, course/plug.py);
    ``tensor_ranks`` above 1: the model on that many ranks cut by their ``split_linear``. Each call into
    a piece is bounded by ``bound_s`` (the watchdog's ``stall_s``) and checked (course/guards.py): a
    piece at fault stops the engine, and the server, naming it. Returns their ``loop`` (notebooks 03,
    08), which then drives the engine (bounded likewise), or None."""
    from orca_lab.course.mine import PASSED, load, verdicts
    from orca_lab.course.plug import assemble
    pieces = load(plugins)
    plugged = assemble(engine, pieces, tensor_ranks, bound_s)
    if not plugged:
        raise ValueError(f"plugins={plugins!r}: none of its pieces ({', '.join(sorted(pieces)) or 'none'}) "
                         f"plugs into system {engine.scheduler.name!r}")
    loop = pieces.get("loop")
    runs = plugged + ["loop"] * (loop is not None)
    print(f"orca-lab serve: the engine runs your {', '.join(runs)} (from {plugins})", flush=True)
    saved = verdicts(plugins)
    unproven = [f"{name} ({saved.get(name, 'missing')})" for name in runs if saved.get(name) != PASSED]
    if unproven:        # served all the same (checked as they run), but the learner should know
        print(f"orca-lab serve: their chapters' checks did not pass when saved: {'; '.join(unproven)}",
              flush=True)
    return loop


class EngineLoop:
    """Algorithm 1's loop over the request pool, fed by the endpoint's messages. ``history``: the
    requests and iterations it keeps for /debug/run (``HISTORY`` with ``--debug``, up to twice as
    many); 0 keeps none once delivered, so a server's memory does not grow with what it served.
    ``stall_s``: the watchdog's bound on one turn (None: no watchdog); ``plugins``: the learner's
    pieces it names first when the engine is stuck in them; ``loop``: the learner's loop, which then
    drives the engine in place of ``Engine.step`` (``run``)."""

    def __init__(self, engine, inbox, outbox, history: int = HISTORY, stall_s: float | None = STALL_S,
                 plugins: str | None = None, loop=None, bound_s: float | None = None):
        self.engine, self.outbox, self.history, self.plugins = engine, outbox, history, plugins
        self.loop, self.bound_s = loop, bound_s
        self._sending = threading.Lock()          # the watchdog's thread sends too
        self.watchdog = None if stall_s is None else Watchdog(self._send, stall_s, plugins_folder(plugins))
        self.messages: queue.SimpleQueue = queue.SimpleQueue()
        self.rids: dict[int, int] = {}           # stream_id -> rid, while the request runs
        self.stream_ids: dict[int, int] = {}     # rid -> stream_id
        self.n_sent: dict[int, int] = {}         # rid -> tokens delivered, of requests that ask for logprobs
        self._n_records = 0
        # A thread empties the pipe as messages come, so the endpoint never blocks on a full pipe
        # while the engine runs an iteration.
        threading.Thread(target=self._receive, args=(inbox,), daemon=True).start()

    def _receive(self, inbox):
        try:
            while True:
                self.messages.put(inbox.recv())
        except (EOFError, OSError):               # the endpoint is gone: stop
            self.messages.put(("stop",))

    def run(self):
        engine = self.engine
        try:
            if self.loop is not None:
                self._run_learners()
                return
            while True:
                msgs = self._take(block=not engine.has_work())
                if self._stopping(msgs):
                    return
                with self._turn():
                    self._handle_all(msgs)
                    if engine.has_work():
                        self.turn()
        except BaseException as e:
            # the client learns the kind of failure only (a learner's piece at fault: which, and why);
            # the traceback, with the server's files, goes to the server's log, as multiprocessing
            # prints it when the process exits (code 1)
            self._send(("failed", self._failure(e)))
            raise
        finally:
            engine.close()

    def _run_learners(self):
        """The learner's loop as the engine's: the endpoint's messages come in at each ``has_work`` it
        calls, a watchdog's turn runs from one to the next, and tokens go out as batches return
        (``course/arrivals.py``). It returns once told to stop; earlier, it is an error."""
        from orca_lab.course.arrivals import Arriving
        from orca_lab.course.ch03_iteration_level_scheduling import run_loop
        turns, stopped = contextlib.ExitStack(), []

        def admit(wait: bool):
            turns.close()
            msgs = [] if stopped else self._take(block=wait)
            if stopped or self._stopping(msgs):
                stopped.append(True)
                return
            turns.enter_context(self._turn())
            self._handle_all(msgs)

        scheduler = Arriving(self.engine, admit, lambda: not stopped, self._deliver)
        with turns:
            run_loop(self.engine, self.loop, [], scheduler, self.bound_s)
        if not stopped:
            raise RuntimeError("your loop returned while the server runs: loop while scheduler.has_work() "
                               "(it waits for requests)")

    def _turn(self):
        return self.watchdog.turn() if self.watchdog else contextlib.nullcontext()

    def _stopping(self, msgs) -> bool:
        """Told to stop: every request ends ("abort") and the loop returns."""
        if any(m[0] == "stop" for m in msgs):
            self._stop(msgs)
            return True
        return False

    def _handle_all(self, msgs):
        for m in msgs:
            self.handle(m)
        if msgs and not self.engine.has_work():
            self._send(("stats", self.engine.stats()))

    def _failure(self, e: BaseException) -> str:
        said = f"the engine failed ({type(e).__name__}); the server's log has the traceback"
        if self.plugins is not None:
            from orca_lab.course.guards import PieceFault, raised_in
            where = raised_in(e, self.plugins)
            if isinstance(e, PieceFault):
                said = f"the engine failed: {e}"
            elif where is not None:          # a learner's piece raised: named to every client it failed
                said = f"the engine failed: your code at {where} raised {type(e).__name__}: {e}"
        return said

    def handle(self, msg):
        """One message of the endpoint's (add, abort, call), between two iterations."""
        getattr(self, "_" + msg[0])(*msg[1:])

    def turn(self):
        """One turn of Algorithm 1's loop; its tokens go to their streams."""
        self._deliver(self.engine.step(timeout=0.01))

    def _take(self, block: bool) -> list:
        msgs = []
        try:
            msgs.append(self.messages.get(timeout=0.5) if block else self.messages.get_nowait())
            while True:
                msgs.append(self.messages.get_nowait())
        except queue.Empty:
            return msgs

    def _add(self, call_id, items):
        """All of a completion's prompts or none (``Engine.add_requests``)."""
        try:
            reqs = self.engine.add_requests([(prompt, params, arrival) for _, prompt, params, arrival in items])
        except (ValueError, TypeError) as e:
            self._send(("added", call_id, e))
            return
        for (stream_id, *_), req in zip(items, reqs):
            self.rids[stream_id], self.stream_ids[req.rid] = req.rid, stream_id
        self._send(("added", call_id, [req.rid for req in reqs]))

    def _abort(self, stream_ids):
        """The client is gone: its stream ends with "abort" whatever the engine answers. A request
        that already finished but is held in the request-level baseline's batch (``abort`` says
        False) computes on until the batch ends; its tokens are dropped then."""
        out = []
        for stream_id in stream_ids:
            rid = self.rids.pop(stream_id, None)
            if rid is None:                        # delivered whole already, or never added
                continue
            del self.stream_ids[rid]
            self.engine.abort(rid)
            self.n_sent.pop(rid, None)
            out.append((stream_id, None, "abort", None, None, None, None))
        if out:
            self._send(("out", self.engine.clock.now(), out, self.engine.stats(), []))

    def _call(self, call_id, name, args=()):
        try:
            value = {"records": records_json, "check_requests": check_requests}[name](self.engine, *args)
        except Exception as e:
            value = e
        self._send(("result", call_id, value))

    def _deliver(self, events):
        """Each token to its stream; a request's finish reason goes with its last token only (the
        request-level baseline hands a request all its tokens at once, when it has long finished)."""
        last = {req.rid: i for i, (req, _) in enumerate(events)}
        out = []
        for i, (req, token) in enumerate(events):
            stream_id = self.stream_ids.get(req.rid)
            if stream_id is None:                        # aborted meanwhile: its token is dropped
                continue
            lp, plp = self._logprobs(req) if req.params.needs_host_state and token is not None else (None, None)
            if not (req.finished and last[req.rid] == i):
                out.append((stream_id, token, None, None, lp, plp, None))
                continue
            out.append((stream_id, token, req.finish_reason, req.stop_at, lp, plp, req.error))
            del self.stream_ids[req.rid], self.rids[stream_id]
            self.n_sent.pop(req.rid, None)
        records = self.engine.records
        tokens = [r.n_tokens for r in records[self._n_records:] if r.stage == 0]
        self._n_records = len(records)
        if len(records) > 2 * self.history or len(self.engine.requests) > 2 * self.history:
            self.engine.forget(self.history, self.history)   # a server runs for days: keep its memory bounded
            self._n_records = len(self.engine.records)
        self._send(("out", self.engine.clock.now(), out, self.engine.stats(), tokens))

    def _logprobs(self, req):
        """The ``TokenLogprob`` of the request's next token to deliver, and its prompt's with its first."""
        k = self.n_sent.get(req.rid, 0)
        self.n_sent[req.rid] = k + 1
        lp = req.logprobs[k] if req.params.logprobs is not None and k < len(req.logprobs) else None
        plp = req.prompt_logprobs if k == 0 and req.params.prompt_logprobs is not None else None
        return lp, plp

    def _stop(self, msgs):
        """Adds still queued are refused, every running request ends with "abort"."""
        for m in msgs:
            if m[0] == "add":
                self._send(("added", m[1], SHUTTING_DOWN))
        self._abort(list(self.rids))

    def _send(self, msg):
        try:
            with self._sending:
                self.outbox.send(msg)
        except (BrokenPipeError, OSError):        # the endpoint is gone; the loop stops on its EOF
            pass


def plugins_folder(plugins: str | None) -> Path | None:
    """The folder a learner's pieces are read from: ``plugins`` itself, or its module's folder."""
    if plugins is None or Path(plugins).is_dir():
        return None if plugins is None else Path(plugins)
    import importlib.util
    spec = importlib.util.find_spec(plugins)
    origin = None if spec is None else spec.origin
    return None if origin is None else Path(origin).parent


def check_requests(engine, items):
    """What the engine would refuse of ``items``, adding nothing (``Engine.check_requests``)."""
    engine.check_requests(items)


def records_json(engine, since: float) -> bytes:
    """The engine's ``RunResult`` of what is new since ``since`` (engine clock: requests not finished
    by then, iterations ended after it) and ``now``, the ``since`` of the next page, as JSON: encoded
    here, so the endpoint's event loop passes bytes on and never decodes thousands of records."""
    return json.dumps({"since": since, "now": engine.clock.now(), **engine.result(since=since).to_json()}).encode()


# -- the endpoint's side (this process) ------------------------------------------------------------
class EngineProcess:
    """Starts the engine process and waits until it serves; the endpoint's ``EngineClient`` then
    talks to it. ``history``: what it keeps for /debug/run (``EngineLoop``)."""

    def __init__(self, recipe: EngineArgs, start_timeout: float = 600.0, history: int = 0):
        ctx = mp.get_context("spawn")              # a fresh interpreter: no inherited threads or CUDA state
        engine_in, self.send = ctx.Pipe(duplex=False)       # (reader, writer)
        self.receive, engine_out = ctx.Pipe(duplex=False)
        self.clock = RealClock()
        self.stall_s = recipe.stall_s              # the endpoint's bound too (EngineClient.unhealthy)
        self.proc = ctx.Process(target=engine_main, args=(recipe, engine_in, engine_out, self.clock.t0, history),
                                name="orca-engine")
        self.proc.start()
        engine_in.close(), engine_out.close()     # the child's ends: its exit closes the pipes
        self.info = self._wait_ready(start_timeout)

    def _wait_ready(self, timeout: float) -> EngineInfo:
        if not self.receive.poll(timeout):
            self.kill()
            raise RuntimeError(f"the engine process did not start within {timeout:.0f} s")
        try:
            kind, value = self.receive.recv()
        except EOFError:
            value, kind = f"the engine process exited with code {self.proc.exitcode}", "failed"
        if kind != "ready":
            self.kill()
            raise value if isinstance(value, Exception) else RuntimeError(value)
        return value

    def join(self, timeout: float):
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
