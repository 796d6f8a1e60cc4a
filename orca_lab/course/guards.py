"""The learner's pieces guarded where they run (the capstone's engine, ``orca-lab serve --plugins``):
every call into their code bounded in time, and what the engine assumes of each piece checked as
it goes. A grader tries a piece on chosen cases; here it runs on whatever the engine meets, so a
bug the grader missed stops the engine naming the piece (``PieceFault``) instead of corrupting its
state, which would give wrong text with 200 OK.

``guarded(pieces, bound_s)`` (``plug.assemble`` calls it): the same pieces, each wrapped.

- The bound. A call runs in the engine's own thread (no thread per call: the serving loop calls
  pieces several times an iteration); one watcher thread for the process stops a call past its
  deadline with an asynchronous exception (``bounded.interrupt``, as graders stop theirs), and the
  call raises ``PieceFault`` "did not return within ...", naming the line it was stopped at. Where a
  piece calls back into the package, the package's time does not count: the bound is on the
  learner's own code between two calls. The learner's ``loop``, which drives the scheduler and
  executor, is bounded in its time without progress: between two batches submitted or come back.
  A stop lands at the next bytecode, so a piece blocked in one C call (``time.sleep``) holds it off;
  the capstone's runs go on in a thread of their own (``watched``), given up and named when a stop
  has not landed within ``GRACE_S`` (a server's watchdog names such a piece: 503 on /health).
- The checks, with the truth each wrapper keeps:
  ``SlotManager`` (ch. 05): slots handed out are ``n`` distinct ids of the pool held by no other
  request; ``n_reserved`` and ``can_reserve`` agree with what is held; once no request holds a slot,
  every slot can be reserved again (a probe reservation, given back at once: a leak shows there).
  ``select`` (ch. 03, Algorithm 1): at most ``max_bs`` requests, none twice, only waiting or
  between-iteration ones, admitted while their ``max_tokens`` fit, earliest arrivals first: a
  request is left out only after the batch is full or at the first that does not fit (break, never
  skip), and the ``n_rsrv`` it returns counts what it admitted.
  ``BlockAllocator`` (ch. 11): blocks taken are ``n`` distinct ids held by nobody; once none is
  held, all can be taken again (probe). ``victim`` (ch. 11): a running request that arrived after
  the one that needs room, holds blocks, is between iterations and not in the batch being formed.
  The pieces whose answer the package can give for the same call are checked at their plug point,
  against it, before the engine uses theirs (``fault_of`` names them): ``flatten`` (ch. 04, every
  field of every iteration's flat batch), ``block_hashes`` and ``cached_prefix`` (ch. 12, every
  lookup), ``split_linear`` (ch. 07, every shard, once) and ``all_reduce`` (every sum);
  ``fill_budget``'s calls are checked by ``ch11.use_budget``; the ``loop``'s hand-backs carry their
  batch's own tokens; ``BlockLRU``'s and ``BlockRefs``' evictions take a cached block no request holds,
  and ``BlockRefs``' releases free none another request holds (``ch12.CheckedRefs``).
  ``form_batch`` (ch. 02): the first requests of ``waiting``, taken off it in order while the batch
  is under ``max_bs`` and ``max_seq_len`` slots fit, each reserved, and the shortest prompt's length.

A ``PieceFault`` means the engine's shared state may be wrong: the caller stops. The capstone's
cell fails with it; a server fails every request in flight with its message (HTTP 503), and exits
1 as for any dead engine (``serving/engine_core.py``).
"""
from __future__ import annotations

import inspect
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from orca_lab.course import bounded
from orca_lab.course.bounded import _Stopped, describe, interrupt
from orca_lab.engine.request import RequestState
from orca_lab.engine.scheduler import arrival_order

TICK_S = 0.05           # how often the watcher looks at the deadlines
PACKAGE = str(Path(__file__).resolve().parents[1])        # orca_lab/: not the learner's code


class PieceFault(AssertionError):
    """A learner's piece broke what the engine needs of it (or never returned): ``piece`` names it."""

    def __init__(self, piece: str, message: str):
        super().__init__(message)
        self.piece = piece


# -- the bound -------------------------------------------------------------------------------------
class _Call:
    __slots__ = ("bound_s", "deadline", "fired", "start", "stuck")

    def __init__(self, bound_s: float | None, stuck=None):
        self.bound_s, self.fired, self.start, self.stuck = bound_s, None, time.monotonic(), stuck
        self.deadline = None if bound_s is None else self.start + bound_s


class _Watcher:
    """The calls under way, a stack per thread (a piece calling back into the package, which calls
    another piece); the top one of each past its deadline is stopped."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stacks: dict[int, list[_Call]] = {}
        self.thread: threading.Thread | None = None

    def run(self, fn, bound_s, args, kwargs, then=None, stuck=None):
        """``fn(*args, **kwargs)`` under ``bound_s`` (None: unbounded); ``_Stopped`` if it ran past it.
        ``then(value)``: what its return does to the outer call's clock: "restart" it (the default),
        "pause" it (the call's time not counted), or "count" (the call's time counted). ``stuck(where)``:
        the fault to name if its stop cannot land (``watched``)."""
        tid, call, outer = threading.get_ident(), _Call(bound_s, stuck), "restart"
        try:
            with self.lock:
                self.stacks.setdefault(tid, []).append(call)
                if self.thread is None and bound_s is not None:
                    self.thread = threading.Thread(target=self._watch, name="orca-piece-bound", daemon=True)
                    self.thread.start()
            value = fn(*args, **kwargs)
            outer = then(value) if then else outer
        finally:
            self._leave(tid, call, outer)
        if call.fired is not None:  # it returned past its bound, before the stop landed
            raise _Stopped
        return value

    def _leave(self, tid: int, call: _Call, outer: str):
        popped = False
        while True:                 # a stop raised while leaving lands here: leave all the same
            try:
                if not popped:
                    with self.lock:
                        stack = self.stacks.get(tid, [])
                        if stack and stack[-1] is call:
                            stack.pop()
                            up = stack[-1] if stack else None
                            if up is not None and up.bound_s is not None:    # the outer call's clock runs on
                                now = time.monotonic()
                                up.deadline = now + up.bound_s if outer == "restart" else \
                                    up.deadline + (now - call.start) if outer == "pause" else up.deadline
                            if not stack:
                                del self.stacks[tid]
                    popped = True
                if call.fired is not None:
                    _let_land()
                return
            except _Stopped:
                continue

    def _watch(self):
        while True:
            time.sleep(TICK_S)
            now = time.monotonic()
            with self.lock:
                for tid, stack in self.stacks.items():
                    top = stack[-1]
                    if top.fired is None and top.deadline is not None and now > top.deadline:
                        top.fired = now
                        interrupt(tid)

    def stuck(self, tid: int, grace_s: float):
        """The fault of a call of thread ``tid`` whose stop fired ``grace_s`` ago and has not landed
        (an asynchronous exception waits for the end of the C call the thread is in), else None."""
        with self.lock:
            stack = list(self.stacks.get(tid, ()))
        fired = [c for c in stack if c.fired is not None and time.monotonic() - c.fired > grace_s]
        named = [c for c in stack[:stack.index(fired[-1]) + 1] if c.stuck] if fired else []
        if not named:
            return None
        frame = sys._current_frames().get(tid)
        where = _frame_where(frame, lambda filename: not filename.startswith(PACKAGE)) if frame else None
        return named[-1].stuck(f" (blocked at {where})" if where else "")


_WATCHER = _Watcher()
GRACE_S = 2.0           # how long a fired stop may take to land before ``watched`` gives up on its thread


def watched(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (an engine serving with the learner's pieces) in a thread of its own,
    the caller waiting for it: a piece whose stop cannot land (blocked in one C call: ``time.sleep``,
    a lock, a read) still ends the wait, as its ``PieceFault`` naming the line it is blocked at. That
    thread is left behind, a daemon holding an engine no one uses again. What ``fn`` returns or
    raises comes back as if it had run here; an interrupt of the caller (Jupyter's stop) stops it too."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001  (raised again in the caller)
            box["error"] = e

    thread = threading.Thread(target=run, name="orca-pieces", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(TICK_S)
            fault = _WATCHER.stuck(thread.ident, GRACE_S) if thread.is_alive() else None
            if fault is not None:
                raise fault
    except KeyboardInterrupt:
        interrupt(thread.ident, KeyboardInterrupt)
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


def _let_land():
    """A stop fired at this thread and not raised yet is raised at its next instruction: here, not
    later in the package. (Cancelling it instead, ``PyThreadState_SetAsyncExc(id, NULL)`` after it had
    landed, left CPython 3.11 spinning in the next thread that ran with a profile function: a
    grader's.)"""
    for _ in range(64):
        pass


class Piece:
    """One of the learner's pieces (a function, or a class and its methods): its calls bounded and
    its faults named."""

    def __init__(self, name: str, obj, bound_s: float | None = None):
        self.name, self.obj, self.bound_s = name, obj, bound_s

    def where(self, member: str | None = None) -> str:
        """``name.member (file:line)`` of the learner's code."""
        fn = getattr(self.obj, member, None) if member else self.obj
        code = getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None
        label = f"{self.name}.{member}" if member else self.name
        return f"{label} ({code.co_filename}:{code.co_firstlineno})" if code else label

    def fault(self, symptom: str, member: str | None = None) -> PieceFault:
        return PieceFault(self.name, f"your {self.where(member)} {symptom}: the engine stops here "
                          "(its state can no longer be trusted)")

    def call(self, fn, *args, member: str | None = None, stalled: str = "did not return", **kwargs):
        bound_s = bounded.TIMEOUT_S if self.bound_s is None else self.bound_s
        stuck = lambda where: self.fault(f"{stalled} within {bound_s:g} s and cannot be stopped: it is blocked "
                                         f"in one call{where}", member)
        try:
            return _WATCHER.run(fn, bound_s, args, kwargs, stuck=stuck)
        except _Stopped as e:
            raise self.fault(f"{stalled} within {bound_s:g} s{self._stopped_at(e)}", member) from None

    def _stopped_at(self, e: BaseException) -> str:
        """Where the learner's code was when stopped: its innermost frame outside this package."""
        where = _innermost(e, lambda filename: not filename.startswith(PACKAGE))
        return f" (stopped at {where})" if where else ""

    def bounded(self, fn, member: str | None = None):
        return lambda *args, **kwargs: self.call(fn, *args, member=member, **kwargs)


class _Guarded:
    """A learner's object whose method calls are bounded; its other attributes read through."""
    piece: Piece

    def __init__(self, *args, **kwargs):
        vars(self)["obj"] = self.piece.call(self.piece.obj, *args, member="__init__", **kwargs)

    def __getattr__(self, name):
        attr = getattr(self.obj, name)
        return self.piece.bounded(attr, name) if callable(attr) else attr

    def __setattr__(self, name, value):
        setattr(self.obj, name, value)

    def __len__(self):
        return self.piece.call(len, self.obj, member="__len__")

    def _set(self, **values):
        vars(self).update(values)


def _guarded_class(piece: Piece, base=_Guarded):
    """A class standing for the learner's: made the same way (``cls(*args)``), its instances guarded."""
    return type(describe(piece.obj), (base,), {"piece": piece})


def _piece_of(obj, name: str) -> Piece:
    """The learner's piece ``obj`` as ``guarded`` made it (its bound), or bare."""
    return getattr(obj, "guarded_piece", None) or Piece(name, obj)


def fault_of(obj, name: str, symptom: str) -> PieceFault:
    """The fault of the learner's piece ``obj`` (as ``guarded`` made it, or bare), found at its plug
    point (a chapter's ``use_*`` checking its answers), named with where the learner's code is."""
    return _piece_of(obj, name).fault(symptom)


def answer_of(obj, name: str, value, reader):
    """What the learner's piece ``obj`` returned, read by its grader's ``reader`` into plain values
    (its objects' own ``__eq__`` never runs in a check) under the piece's bound (reading a generator
    runs its code), or its fault: a value its grader would not take either."""
    piece = _piece_of(obj, name)
    try:
        return piece.call(reader, value)
    except PieceFault:
        raise
    except Exception as e:  # noqa: BLE001  (whatever reading it raised, the answer is not of its shape)
        raise piece.fault(f"returned a value its grader would not read ({type(e).__name__}: {e})") from None


# -- the checks ------------------------------------------------------------------------------------
class _Held:
    """The truth a manager's wrapper keeps: which holder holds which ids."""

    def __init__(self):
        self.of: dict[int, list[int]] = {}      # holder -> ids
        self.owner: dict[int, int] = {}         # id -> holder

    def take(self, piece: Piece, member: str, holder: int, ids, n: int, n_ids: int, what: str) -> list[int]:
        """Record ``ids`` handed to ``holder``: ``n`` distinct ids of ``range(n_ids)`` no one holds;
        returned as read (a generator is walked once, here, under the piece's bound)."""
        try:
            ids = piece.call(bounded.ints, ids, member=member)
        except TypeError as e:
            raise piece.fault(f"returned no list of {what} ids for {n} {what}s ({e})", member) from None
        if len(ids) != n or len(set(ids)) != n:
            raise piece.fault(f"handed out {len(set(ids))} distinct {what}s ({len(ids)} ids) when {n} were asked "
                              f"for: {ids[:8]}{'...' if len(ids) > 8 else ''}", member)
        for i in ids:
            if not 0 <= i < n_ids:
                raise piece.fault(f"handed out {what} {i}, outside the pool's 0..{n_ids - 1}", member)
            if i in self.owner:
                raise piece.fault(f"handed out {what} {i} while {self.owner[i]} still holds it "
                                  f"(given back twice, or never taken off the free list?)", member)
        for i in ids:
            self.owner[i] = holder
        self.of.setdefault(holder, []).extend(ids)
        return ids

    def give(self, holder: int, ids=None) -> list[int]:
        ids = self.of.pop(holder, []) if ids is None else bounded.ints(ids)
        for i in ids:
            self.owner.pop(i, None)
        return ids

    @property
    def n(self) -> int:
        return len(self.owner)


class _CheckedSlots(_Guarded):
    """A ``SlotManager(n_slots)`` (notebook 05) checked against the slots each request holds."""

    def __init__(self, n_slots: int):
        super().__init__(n_slots)
        self._set(n_slots_=n_slots, held=_Held())

    def can_reserve(self, n: int) -> bool:
        said = self.piece.call(self.obj.can_reserve, n, member="can_reserve")
        free = self.n_slots_ - self.held.n
        if bool(said) != (n <= free):
            raise self.piece.fault(f"said {said} for {n} slots with {free} of {self.n_slots_} free", "can_reserve")
        return said

    def reserve(self, req, n: int):
        self.piece.call(self.obj.reserve, req, n, member="reserve")
        self.held.take(self.piece, "reserve", f"request {req.rid}", [] if req.slots is None else req.slots, n,
                       self.n_slots_, "slot")
        self._count("reserve")

    def release(self, req):
        self.piece.call(self.obj.release, req, member="release")
        self.held.give(f"request {req.rid}")
        self._count("release")
        if not self.held.n:
            self._drained()

    def _count(self, member: str):
        said = self.piece.call(_attr_answer, self.obj, "n_reserved", member=member)  # a property is code too
        if said != self.held.n:
            raise self.piece.fault(f"left n_reserved={said} while requests hold {self.held.n} slots", member)

    def _drained(self):
        """No request holds a slot: every slot must be free again."""
        probe = SimpleNamespace(rid=-1, slots=None, n_cached=0, max_tokens=self.n_slots_)
        self.piece.call(self.obj.reserve, probe, self.n_slots_, member="reserve")
        got = set(self.piece.call(bounded.ints, [] if probe.slots is None else probe.slots, member="reserve"))
        if got != set(range(self.n_slots_)):
            raise self.piece.fault(f"does not give every slot back: with no request holding one, reserve("
                                   f"{self.n_slots_}) found {len(got)} of them free", "release")
        self.piece.call(self.obj.release, probe, member="release")


class _CheckedAllocator(_Guarded):
    """A ``BlockAllocator(n_blocks)`` (notebook 11) checked against the blocks it handed out."""

    def __init__(self, n_blocks: int):
        super().__init__(n_blocks)
        self._set(n_blocks=n_blocks, held=_Held(), n_taken=0)

    def take(self, n: int) -> list[int]:
        blocks = self.piece.call(self.obj.take, n, member="take")
        vars(self)["n_taken"] += 1
        return self.held.take(self.piece, "take", f"the take #{self.n_taken}", blocks, n, self.n_blocks, "block")

    def free(self, blocks):
        blocks = list(blocks)
        self.piece.call(self.obj.free, blocks, member="free")
        self.held.give(None, blocks)
        if not self.held.n:
            self._drained()

    def _drained(self):
        blocks = self.piece.call(bounded.ints, self.piece.call(self.obj.take, self.n_blocks, member="take"), member="take")
        if sorted(blocks) != list(range(self.n_blocks)):
            raise self.piece.fault(f"keeps the free list wrong: with no block held, take({self.n_blocks}) gave "
                                   f"{len(blocks)} ids, {len(set(blocks))} distinct", "free")
        self.piece.call(self.obj.free, blocks, member="free")


def _innermost(e: BaseException, keep) -> str | None:
    """``file:line`` of the innermost frame of ``e``'s traceback whose file ``keep`` accepts."""
    return _last_kept(traceback.extract_tb(e.__traceback__), keep)


def _frame_where(frame, keep) -> str | None:
    """``file:line`` of the innermost frame of a running thread's stack whose file ``keep`` accepts."""
    return _last_kept(traceback.extract_stack(frame), keep)


def _last_kept(frames, keep) -> str | None:
    frames = [f for f in frames if keep(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def raised_in(e: BaseException, folder: str) -> str | None:
    """Where in ``folder`` (the learner's package) ``e`` was raised: its innermost frame there."""
    return _innermost(e, lambda filename: Path(filename).is_relative_to(folder))


def _attr_answer(obj, name: str):
    """``obj.name`` as plain values (``bounded.as_answer``): compared, it never runs the learner's code."""
    return bounded.as_answer(getattr(obj, name, None))


def token_ids(tokens) -> list:
    """A batch's tokens as exact ints (None: a request the baseline holds, which gets no token); a
    learner's int whose ``__int__`` or ``__eq__`` says another is read as the int it is."""
    return [None if t is None else bounded.an_int(t) for t in bounded.listed(tokens)]


def handed_out(done):
    """A batch's completion as a learner's loop gets it: its tokens a list of its own, so a loop that
    changes them in place changes nothing the engine keeps, and handing them back is seen to differ."""
    return replace(done, tokens=list(done.tokens))


def same_tokens(got, expected) -> bool:
    """Whether a loop handed back ``expected``, a batch's tokens (ch. 03's grader, the loop's guard);
    what cannot be read as token ids is not them. Run it under the loop's bound: reading runs its code."""
    try:
        return token_ids(got) == token_ids(expected)
    except Exception:       # noqa: BLE001  (whatever reading it raised: not the batch's tokens)
        return False


def select_answer(pool):
    """The reader of a Select's answer over ``pool`` (ch. 03's grader and the capstone's guard; a
    ``form_batch``'s too, over the waiting requests): its batch as the pool's own requests, by identity
    (None for anything else: no object of the learner's runs its ``rid`` or ``__eq__`` where the
    reader's caller compares them), and its int (``n_rsrv``, ``first_q_len``) an int.
    Run it under the learner's bound: reading the answer runs its code (``__iter__``, ``__int__``)."""
    own = {id(r): r for r in pool}

    def read(answer):
        batch, n = answer
        return [own.get(id(r)) for r in batch], bounded.an_int(n)
    return read


def _answered(fn, pool, *args):
    """The learner's ``fn(*args)`` (``select``, ``form_batch``) and the reading of its answer as
    ``select_answer(pool)`` reads it, both under its piece's bound; None when the answer is no
    ``(batch of pool's requests, int)``."""
    answer = fn(*args)
    try:
        return select_answer(pool)(answer)
    except (TypeError, ValueError):
        return None


def _answer(piece: Piece, among, args, pair: str, foreign: str) -> tuple:
    """The learner's ``select`` or ``form_batch`` called on ``args``, its answer read as ``(requests of
    among, int)`` (``_answered``), or its fault: no such ``pair``, or a ``foreign`` request."""
    out = piece.call(_answered, piece.obj, among, *args)
    if out is None:
        raise piece.fault(f"returned no ({pair}): a list of requests and an int")
    if None in out[0]:
        raise piece.fault(foreign)
    return out


def _checked_select(piece: Piece):
    def select(pool, n_rsrv, max_bs, n_slots):
        batch, n_out = _answer(piece, pool, (pool, n_rsrv, max_bs, n_slots), "batch, n_rsrv",
                               "chose something that is not a request of the pool it was given")
        _check_algorithm_1(piece, pool, batch, n_rsrv, n_out, max_bs, n_slots)
        return batch, n_out
    return select


def _check_algorithm_1(piece, pool, batch, n_rsrv, n_out, max_bs, n_slots):
    """``batch`` is what Algorithm 1's Select takes of ``pool``: see the module's docstring."""
    if len(batch) > max_bs:
        raise piece.fault(f"chose {len(batch)} requests, more than max_bs={max_bs}")
    ids = [r.rid for r in batch]
    if len(set(ids)) != len(ids):
        raise piece.fault(f"chose a request twice: {ids}")
    eligible = sorted((r for r in pool if r.state in (RequestState.INITIATION, RequestState.INCREMENT)),
                      key=arrival_order)
    if not {r.rid for r in batch} <= {r.rid for r in eligible}:
        bad = next(r for r in batch if r.rid not in {e.rid for e in eligible})
        raise piece.fault(f"chose request {bad.rid} in state {bad.state.name}: only a request waiting "
                          "(INITIATION) or between iterations (INCREMENT) can run")
    chosen, n = set(ids), n_rsrv
    for i, req in enumerate(eligible):
        fits = req.state is not RequestState.INITIATION or n + req.max_tokens <= n_slots
        if req.rid not in chosen:
            later = [r.rid for r in eligible[i + 1:] if r.rid in chosen]
            if later or (len(batch) < max_bs and fits):
                why = f"chose request {later[0]}, which arrived after" if later else "stopped before"
                raise piece.fault(f"{why} request {req.rid} ({'fits' if fits else 'does not fit'}: "
                                  f"max_tokens {req.max_tokens}, {n_slots - n} slots free): Algorithm 1 takes the "
                                  "earliest arrivals first and stops at max_bs or at the first that does not fit "
                                  "(break, never skip)")
            break
        if not fits:
            raise piece.fault(f"admitted request {req.rid} (max_tokens {req.max_tokens}) with {n_slots - n} slots free")
        n += req.max_tokens if req.state is RequestState.INITIATION else 0
    if n_out != n:
        raise piece.fault(f"returned n_rsrv={n_out}; its batch makes it {n}")


def _checked_form_batch(piece: Piece):
    """The baseline's batch formation (ch. 02) as ``RequestLevelScheduler.form_batch``: the first
    requests of ``waiting``, in order, taken off it while the batch is under ``max_bs`` and
    ``max_seq_len`` slots fit, each holding its reservation; ``first_q_len`` the shortest prompt. A
    formation that takes none while requests wait and slots fit would leave the engine spinning."""
    def form_batch(waiting, kv, max_bs, max_seq_len):
        before = list(waiting)          # read against it: the call takes requests off waiting
        batch, first = _answer(piece, before, (waiting, kv, max_bs, max_seq_len), "batch, first_q_len",
                               "took something that is not a request of waiting")
        ids, k, shortest = [r.rid for r in batch], len(batch), min((len(r.prompt) for r in batch), default=0)
        if batch != before[:k]:
            raise piece.fault(f"took requests {ids} of waiting {[r.rid for r in before]}: the baseline takes the "
                              "first ones, in arrival order (waiting.popleft())")
        if [r.rid for r in waiting] != [r.rid for r in before[k:]]:
            raise piece.fault(f"left waiting as {[r.rid for r in waiting]} after taking {ids}: take each request "
                              "off it (waiting.popleft())")
        if k > max_bs:
            raise piece.fault(f"took {k} requests, more than max_bs={max_bs}")
        if waiting and k < max_bs and kv.can_reserve(max_seq_len):
            raise piece.fault(f"stopped at {k} requests while request {waiting[0].rid} waits and its {max_seq_len} "
                              f"slots fit (max_bs={max_bs}): take while under max_bs and kv.can_reserve(max_seq_len)")
        if any(r.slots is None for r in batch):
            raise piece.fault("took a request without reserving its slots: kv.reserve(req, max_seq_len)")
        if first != shortest:
            raise piece.fault(f"returned first_q_len={first}; the batch's shortest prompt has {shortest} tokens")
        return batch, first
    return form_batch


def _checked_victim(piece: Piece):
    def victim(running, req, chosen):
        v = piece.call(piece.obj, running, req, chosen)
        if v is None:
            return None
        why = ("is not a running request" if not any(v is r for r in running) else
               "arrived before it (or is it): only a later arrival gives way" if arrival_order(v) <= arrival_order(req)
               else "holds no blocks" if v.slots is None else
               "is in this iteration's batch" if v.rid in chosen else
               f"is in flight (state {v.state.name})" if v.state is not RequestState.INCREMENT else None)
        if why:
            raise piece.fault(f"chose request {getattr(v, 'rid', v)} to give way to request {req.rid}, which {why}")
        return v
    return victim


# What each of the loop's calls does to its clock: the bound is on the loop's time without progress.
# A batch submitted, one come back or handed back restarts it; ``has_work`` pauses it (a server's
# scheduler waits there for requests); any other call counts, so a loop spinning on selects that
# make no batch, or dropping the batches they make, is stopped (each select used to restart it).
_PROGRESS = {"submit": lambda value: "restart", "on_batch_return": lambda value: "restart",
             "wait": lambda done: "count" if done is None else "restart", "has_work": lambda value: "pause"}


def _bounded_loop(piece: Piece):
    """The learner's loop bounded in its time without progress (``_PROGRESS``), the tokens it hands
    back checked against those its batch came back with (the scheduler gets those, read as ints); a
    fault of another piece met there stops the run even if the loop catches it."""
    faults = []

    def between(fn, then):
        def call(*args, **kwargs):
            try:
                return _WATCHER.run(fn, None, args, kwargs, then)
            except PieceFault as e:
                faults.append(e)
                raise
        return call

    class Between:
        def __init__(self, obj, **checked):
            vars(self).update(obj=obj, checked=checked)

        def __getattr__(self, name):
            attr = self.checked.get(name) or getattr(self.obj, name)
            return between(attr, _PROGRESS.get(name, lambda value: "count")) if callable(attr) else attr

    def loop(scheduler, executor, n_workers):
        came_back = {}                 # id(batch) -> the tokens it came back with

        def wait(*args, **kwargs):
            done = executor.wait(*args, **kwargs)
            if done is None:
                return None
            came_back[id(done.batch)] = done.tokens
            return handed_out(done)

        def on_batch_return(batch, tokens, now):
            truth = came_back.pop(id(batch), None)
            if truth is not None and not piece.call(same_tokens, tokens, truth):
                raise piece.fault(f"handed back tokens other than its batch's (executor.wait()'s done.tokens) for "
                                  f"iteration {getattr(batch, 'iteration', '?')}")
            return scheduler.on_batch_return(batch, tokens if truth is None else truth, now)

        value = piece.call(piece.obj, Between(scheduler, on_batch_return=on_batch_return),
                           Between(executor, wait=wait), n_workers,
                           stalled="made no progress (no batch submitted, come back or handed back)")
        if faults:
            raise faults[0]
        return value
    return loop


CHECKED = {"SlotManager": lambda p: _guarded_class(p, _CheckedSlots), "select": _checked_select,
           "form_batch": _checked_form_batch,
           "BlockAllocator": lambda p: _guarded_class(p, _CheckedAllocator), "victim": _checked_victim,
           "loop": _bounded_loop}


def guarded(pieces: dict, bound_s: float | None = None) -> dict:
    """``pieces`` (``mine.load()``), each bounded by ``bound_s`` seconds a call (None:
    ``bounded.TIMEOUT_S`` at the call) and checked as the module's docstring says."""
    out = {}
    for name, obj in pieces.items():
        if getattr(obj, "guarded_piece", None) is not None:        # guarded already
            out[name] = obj
            continue
        piece = Piece(name, obj, bound_s)
        if name in CHECKED:
            out[name] = CHECKED[name](piece)
        elif inspect.isclass(obj):
            out[name] = _guarded_class(piece)
        else:
            out[name] = piece.bounded(obj)
        try:
            out[name].guarded_piece = piece
        except AttributeError:
            pass
    return out

