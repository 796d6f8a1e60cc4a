"""Chapter 03, iteration-level scheduling: the graders of Algorithm 1's Select (by hand and as a
function) and of its loop, and their plug points, ``use_select`` and ``run_loop``. Chapter 08 grades
the loop with several batches in flight (``check_loop_cases``)."""
from __future__ import annotations

import functools
import random

from orca_lab.config import EngineConfig, ModelConfig
from orca_lab.course.bounded import PackageCode, TooSlow, refuse_package_code, run_bounded
from orca_lab.course.forked import grader
from orca_lab.course.guards import guarded, handed_out, same_tokens, select_answer, token_ids, watched
from orca_lab.course.harness import (N_CASES, Mismatch, Piece, check_by_hand, correct, differ, mismatch, place_on, read,
                                     request)
from orca_lab.engine.batch import Batch
from orca_lab.engine.engine import Engine
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.request import RequestState
from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.engine.scheduler import OrcaScheduler, enqueue
from orca_lab.llm import LLM


def schedule(sched, arrivals, n_workers: int, limit: int) -> list[tuple[list[int], int]]:
    """Drive ``sched`` without a model for at most ``limit`` iterations: ``arrivals[i]`` requests
    join before iteration ``i``; up to ``n_workers`` batches in flight, the oldest returns first.
    Returns each Select's (rids, n_rsrv after it), empty batches included."""
    log, in_flight, it = [], [], 0
    while (sched.has_work() or in_flight or it < len(arrivals)) and it < limit:
        for req in arrivals[it] if it < len(arrivals) else ():
            sched.add(req)
        it += 1
        batch = None
        if len(in_flight) < n_workers:
            batch = sched.select(float(it))
            log.append(([r.rid for r in batch.requests] if batch is not None else [], sched.n_rsrv))
        if batch is not None:
            in_flight.append(batch)
        if in_flight and (batch is None or len(in_flight) == n_workers):
            done = in_flight.pop(0)
            sched.on_batch_return(done, [0] * len(done), float(it))
    return log


def requests_of(groups) -> list[list]:
    """Fresh requests of ``(rid, prompt_len, gen)`` groups, group ``i`` arriving at time ``i``."""
    return [[request(r, p, g, arrival=i) for r, p, g in grp] for i, grp in enumerate(groups)]


def random_arrivals(rng, n_slots: int):
    out, rid = [], 0
    for _ in range(rng.randint(1, 4)):
        group = []
        for _ in range(rng.randint(1, 4)):
            gen = rng.randint(1, 5)
            group.append((rid, rng.randint(1, max(1, min(20, n_slots - gen))), gen))
            rid += 1
        out.append(group)
        out += [[]] * rng.randint(0, 3)
    return out


def _graded_select(select, expected: list, label: str):
    """The learner's ``select``, bounded, and its ``k``-th answer compared with the package's
    ``k``-th (both schedules are the same up to the first answer that differs)."""
    def graded(pool, n_rsrv, max_bs, n_slots):
        k = len(graded.calls)
        where = f"{label}, Select call {k} (pool (rid, state, max_tokens) " \
                f"{[(r.rid, r.state.value, r.max_tokens) for r in pool]}, n_rsrv={n_rsrv})"
        got = run_bounded(select, list(pool), n_rsrv, max_bs, n_slots, case=where,
                          references=(OrcaScheduler.select,))
        batch, n = read("the answer", where, got, select_answer(pool), "(batch, n_rsrv): a list of requests and an int")
        graded.calls.append(k)
        want = expected[k] if k < len(expected) else ([], n_rsrv)
        if ([getattr(r, "rid", r) for r in batch], n) != want:
            differ("the batch (request ids) and n_rsrv after Select", where, want,
                   ([getattr(r, "rid", r) for r in batch], n), _select_hint(pool, n_rsrv, max_bs, n_slots, want, batch, n))
        return batch, n
    graded.calls = []
    return graded


def _select_hint(pool, n_rsrv, max_bs, n_slots, want, batch, n) -> str:
    """What the learner's ``(batch, n)`` shows, against the package's ``want`` for this pool."""
    by_rid = {r.rid: r for r in pool}
    got, exp = [getattr(r, "rid", r) for r in batch], want[0]
    fresh = [r.rid for r in pool if r.state is RequestState.INITIATION]
    if len(got) > max_bs:
        return f"more than max_bs requests ({len(got)} > max_bs={max_bs}): stop when len(batch) == max_bs"
    if any(r not in by_rid for r in got):
        return "the batch holds requests of the pool it was given"
    if any(by_rid[r].state is RequestState.RUNNING for r in got):
        return "a RUNNING request is in flight (its batch has not returned): it cannot be batched again"
    increment = [r for r in got if by_rid[r].state is RequestState.INCREMENT]
    missed = [r for r in exp if r not in got]
    if (increment and n == n_rsrv + sum(by_rid[r].max_tokens for r in got)) or \
            (missed and by_rid[missed[0]].state is RequestState.INCREMENT):
        return "max_tokens reserved again for a request in INCREMENT: only its first iteration (INITIATION) " \
               "reserves; later it already holds its slots, so it neither reserves nor is refused for room"
    if got == exp:
        return "the same requests chosen with another n_rsrv: add max_tokens of each request in INITIATION " \
               "chosen, to the n_rsrv passed in"
    if sorted(got) == sorted(exp):
        return "the same requests in another order: the batch is in arrival order (the pool's order)"
    passed = [r for r in fresh if r not in got and any(g > r for g in got)]
    if passed:
        before = [r for r in exp if r < passed[0] and by_rid[r].state is RequestState.INITIATION]
        if by_rid[passed[0]].max_tokens > n_slots - n_rsrv - sum(by_rid[r].max_tokens for r in before):
            return f"Select breaks (does not skip) at the first request that does not fit (request {passed[0]}): " \
                   "no later one overtakes it"
        return "newest first: Select takes the earliest arrivals first (FCFS), in the pool's order"
    if len(got) < len(exp):
        first = next(r for r in exp if r not in got)
        room = n_slots - n_rsrv - sum(by_rid[r].max_tokens for r in exp[:exp.index(first)]
                                      if by_rid[r].state is RequestState.INITIATION)
        if by_rid[first].state is RequestState.INITIATION and by_rid[first].max_tokens == room:
            return f"request {first} fits exactly (max_tokens {room} = the slots left): it fits when " \
                   "n_rsrv + max_tokens <= n_slots (refuse with >, not >=)"
        if not got and not any(r.state is RequestState.RUNNING for r in pool):
            return "an empty batch with requests waiting and nothing in flight: nothing would ever change"
        if len(got) == max_bs - 1 and len(exp) == max_bs:
            return f"one request short of max_bs={max_bs}: the batch is full at len(batch) == max_bs"
        return f"request {first} fits ({room} slots left) and should be in the batch"
    if n > n_slots:
        return f"n_rsrv {n} > n_slots={n_slots}: a request that does not fit ends the batch"
    return "pool order is arrival order; take requests while they fit, up to max_bs"


@grader
def check_select(select, seed: int = 0):
    """The learner's ``select(pool, n_rsrv, max_bs, n_slots) -> (batch, n_rsrv)`` plugged into the
    scheduler (``PluggedSelect``), against ``OrcaScheduler`` on random traces: requests joining
    mid-run, a pool too small for all of them, one or two batches in flight. Each call is compared
    with the package's Select at the same point."""
    refuse_package_code(select, OrcaScheduler.select)
    rng = random.Random(seed)
    for case in range(N_CASES):
        max_bs, n_slots, n_workers = rng.randint(1, 4), rng.randint(24, 60), rng.randint(1, 2)
        groups = random_arrivals(rng, n_slots)
        expected = schedule(OrcaScheduler(KVSlotManager(n_slots), max_bs), requests_of(groups), n_workers, 10_000)
        sizes = {r: p + g for grp in groups for r, p, g in grp}
        label = f"case {case} (max_bs={max_bs}, n_slots={n_slots}, n_workers={n_workers}, max_tokens by rid {sizes})"
        graded = _graded_select(select, expected, label)
        schedule(PluggedSelect(KVSlotManager(n_slots), max_bs, graded), requests_of(groups), n_workers,
                 len(expected) * n_workers + 1)
        if len(graded.calls) != len(expected):
            differ("the number of Select calls", label, len(expected), len(graded.calls))
    correct(N_CASES, "OrcaScheduler.select")


def check_first_select(first_batch, first_n_rsrv, second_batch, second_n_rsrv):
    """Notebook 03's by-hand Select: W, X, Y, Z (max_tokens 12, 30, 5, 8) arrive in that order,
    max_bs=3, n_slots=40; the first batch, then the next once W finished, from ``OrcaScheduler``.
    A wrong answer is named with its hint, never shown beside the right one (the exercise's answer)."""
    names = "WXYZ"
    sched = OrcaScheduler(KVSlotManager(40), 3)
    for rid, m in enumerate((12, 30, 5, 8)):
        sched.add(request(rid, m - 1, 1, arrival=rid))        # max_tokens = prompt + 1 generated
    answers = []
    for _ in range(2):
        batch = sched.select()
        answers.append(([names[r.rid] for r in batch.requests], sched.n_rsrv))
        sched.on_batch_return(batch, [0] * len(batch), 0.0)   # W generates its one token and leaves
    pick = "in arrival order, reserve max_tokens while it fits in 40; at the first request that does not fit, " \
           "stop (later ones wait too)"
    added = "n_rsrv: the max_tokens of every request that holds slots, added"
    check_by_hand("W, X, Y, Z with max_tokens 12, 30, 5, 8, max_bs=3, n_slots=40", {
        "first_batch": (first_batch, answers[0][0], pick),
        "first_n_rsrv": (first_n_rsrv, answers[0][1], added + " (after the first batch)"),
        "second_batch (W finished and released its 12 slots)": (second_batch, answers[1][0], pick),
        "second_n_rsrv": (second_n_rsrv, answers[1][1], added + " (W's 12 released, the second batch's reserved)")})
    print(f"correct: {answers[0][0]} (n_rsrv {answers[0][1]}), then {answers[1][0]} (n_rsrv {answers[1][1]})")


class PluggedSelect(OrcaScheduler):
    """``OrcaScheduler`` whose choice is the learner's ``select(pool, n_rsrv, max_bs, n_slots) ->
    (batch, n_rsrv)`` (Algorithm 1's Select, as notebook 03 writes it). The scheduler applies it: a
    chosen request in INITIATION is admitted and its ``max_tokens`` reserved from the real K/V manager."""
    name = "orca"

    def __init__(self, kv, max_bs: int, select):
        super().__init__(kv, max_bs)
        self.learner_select = select

    def select(self, now: float = 0.0) -> Batch | None:
        pool = self.running + list(self.waiting)            # arrival order; RUNNING ones included
        batch, n_rsrv = self.learner_select(pool, self.kv.n_reserved, self.max_bs, self.kv.n_slots)
        for req in batch:
            if req.state is RequestState.INITIATION:
                if not self.kv.can_reserve(req.max_tokens):
                    raise AssertionError(f"your select chose request {req.rid} (max_tokens {req.max_tokens}) "
                                         f"with {self.kv.n_slots - self.kv.n_reserved} slots free")
                self.waiting.remove(req)
                enqueue(self.running, req)
                self.kv.reserve(req, req.max_tokens)
                req.t_scheduled = now
        if n_rsrv != self.kv.n_reserved:
            raise AssertionError(f"your select returned n_rsrv={n_rsrv}; its batch reserves {self.kv.n_reserved}")
        if not batch:
            return None
        for req in batch:
            req.state = RequestState.RUNNING
        return Batch.selective(batch)


def use_select(engine, select):
    """Put the learner's ``select`` into ``engine`` (a fresh one, from ``LLM.new_engine()``)."""
    old = engine.scheduler
    engine.scheduler = PluggedSelect(old.kv, old.max_bs, select)
    return engine


class LoopExecutor:
    """``engine``'s executor as the learner's loop sees it (``submit``, ``wait``, ``clock``): through
    ``Engine.submit`` and ``Engine.wait``, which number, time and record each batch as ``Engine.step``
    does."""

    def __init__(self, engine):
        self.engine, self.clock = engine, engine.clock

    def submit(self, batch):
        self.engine.submit(batch)

    def wait(self, timeout=None):
        return self.engine.wait(timeout)


def run_loop(engine, loop, trace, scheduler=None, bound_s: float | None = None):
    """Serve ``trace`` offline (every request there at the start) with the learner's ``loop(scheduler,
    executor, n_workers)`` (notebook 03, extended to ``n_workers`` batches in flight in 08) in place
    of ``Engine.run``'s: the engine's ``RunResult``. ``scheduler``: what the loop drives, if not the
    engine's (requests arriving: ``arrivals.py``). The loop is guarded (``guards.py``): bounded by
    ``bound_s`` between its calls into the scheduler and executor, and stopped by a piece's fault,
    in a thread of its own (``guards.watched``: one blocked where no stop lands is named all the same)."""
    start = engine.clock.now()
    for it in trace:
        engine.add_request(list(it.prompt), it.sampling_params(), arrival=start)
    watched(guarded({"loop": loop}, bound_s)["loop"], scheduler or engine.scheduler, LoopExecutor(engine),
            engine.n_workers)
    if engine.has_work():
        raise AssertionError(f"your loop returned with work left: {engine.scheduler.n_waiting} requests "
                             f"waiting, {engine.n_scheduled} batches in flight")
    return engine.result(start)


LOOP_CASES = 2       # cases per (n_workers, system), and 8 at least
LOOP_S = 20.0        # wall time one case of the loop may take (under a second when right)
IDLE_SELECTS = 3     # selects in a row that find no batch and change nothing, before the loop is stopped


@functools.cache
def _model():
    """The GPT every engine of the loop's grader runs: the tiny preset's layers (4: up to 4 pipeline
    stages) and vocabulary, narrower, so that a case costs milliseconds (random weights, built once)."""
    return LLM(ModelConfig("grader", n_layers=4, d_model=32, n_heads=2, vocab_size=257), seed=0).model


class _Logged:
    """An engine's executor keeping the tokens each batch returned, by iteration."""

    def __init__(self, executor):
        self.executor, self.tokens = executor, {}

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def wait(self, timeout=None):
        done = self.executor.wait(timeout)
        if done is not None:
            self.tokens[done.batch.iteration] = token_ids(done.tokens)
        return done


def _iterations(engine) -> list[tuple]:
    """Per iteration that returned, in order: its request ids, the batches in flight once it was
    submitted, the tokens it returned."""
    first = sorted((r for r in engine.records if r.stage == 0), key=lambda r: r.iteration)
    return [(r.rids, r.in_flight, engine.executor.tokens[r.iteration]) for r in first]


class _Calls:
    """The learner's loop as the grader sees it: the batches it selected and has not submitted, those
    that returned and that it has not handed back, and each call checked against Algorithm 1. A call
    Algorithm 1 never makes raises a ``Mismatch`` in the loop, and is kept: a loop that catches it
    is refused all the same."""

    def __init__(self, engine, label: str, limit: int):
        self.engine, self.label, self.limit = engine, label, limit     # limit: the package's iterations
        self.selected, self.returned, self.handed = [], [], []
        self.n_submitted = self.n_selects = self.idle = 0
        self.early = False          # a select while a returned batch was not handed back yet
        self.refused: str | None = None

    def refuse(self, expected: str, got: str, hint: str):
        n = self.n_submitted
        when = f"after {n} submit{'s' * (n != 1)}" if n else "before any submit"
        e = mismatch(f"your loop's call {when}", self.label, expected, got, hint)
        self.refused = self.refused or str(e)
        raise e


class _Executor(LoopExecutor):
    """The engine's executor as the learner's loop gets it (``LoopExecutor``: the engine keeps its
    records), refusing a submit past ``n_workers`` in flight or past the package's iterations, and a
    wait with nothing in flight."""

    def __init__(self, engine, calls: _Calls):
        super().__init__(engine)
        self.calls, self.n_workers = calls, engine.n_workers

    def submit(self, batch):
        c, n = self.calls, self.n_workers
        if batch is None:
            c.refuse("a batch", "executor.submit(None)", "select returns None when it finds no batch: then there is "
                     "nothing to submit; wait for a batch in flight instead")
        if self.engine.n_scheduled == n:
            c.refuse(f"executor.wait(): {n} in flight, n_workers={n}", "executor.submit(batch): one more in flight",
                     f"more than n_workers={n} batches in flight: with {n} in flight, wait for the oldest "
                     "(executor.wait()) and hand it back before the next select")
        if c.n_submitted == c.limit:
            c.refuse(f"no batch more: the package's loop ran {c.limit}", f"batch {c.limit + 1}",
                     "the loop ends when the scheduler has no work (scheduler.has_work()) and nothing is in flight")
        c.selected = [b for b in c.selected if b is not batch]
        c.n_submitted, c.idle = c.n_submitted + 1, 0
        super().submit(batch)

    def wait(self, timeout=None):
        c = self.calls
        if not self.engine.n_scheduled:
            c.refuse("a submitted batch to wait for", "executor.wait() with no batch in flight",
                     "wait only while a batch is in flight: count them (one more at each submit, one less at "
                     "each wait)")
        done = super().wait()
        c.returned.append(done)
        c.idle = 0
        return handed_out(done)


class _Scheduler:
    """The engine's scheduler as the learner's loop gets it: ``select`` and ``on_batch_return``
    checked, the rest read through."""

    def __init__(self, scheduler, calls: _Calls):
        self.scheduler, self.calls = scheduler, calls

    def __getattr__(self, name):
        return getattr(self.scheduler, name)

    def select(self, now: float = 0.0):
        c = self.calls
        c.n_selects += 1
        c.early |= bool(c.returned)
        batch = self.scheduler.select(now)
        if batch is not None:
            c.selected.append(batch)
            c.idle = 0
            return batch
        c.idle += 1
        if not c.engine.n_scheduled and self.scheduler.has_work():
            c.refuse("a batch (requests are left and nothing is in flight)", "None: no request could be selected",
                     _stuck_hint(c))
        if c.idle > IDLE_SELECTS:
            c.refuse("executor.wait() for the oldest batch in flight" if c.engine.n_scheduled else "the loop ends",
                     f"select again: {c.idle} in a row found no batch", _idle_hint(c))
        return None

    def on_batch_return(self, batch, tokens, now):
        c = self.calls
        done = next((d for d in c.returned if d.batch is batch), None)
        if done is None:
            twice = any(b is batch for b in c.handed)
            c.refuse("the batch that executor.wait() returned (done.batch), once",
                     "a batch handed back twice" if twice else "a batch that has not come back",
                     "hand back each returned batch once" if twice else
                     "hand back done.batch, the batch executor.wait() returned, with its done.tokens")
        if not same_tokens(tokens, done.tokens):
            c.refuse(f"its tokens {list(done.tokens)} (done.tokens)", _shown_tokens(tokens),
                     "hand back the tokens the batch returned: scheduler.on_batch_return(done.batch, done.tokens, now)")
        c.returned.remove(done)
        c.handed.append(batch)
        return self.scheduler.on_batch_return(batch, done.tokens, now)     # the same, read as plain ints


def _shown_tokens(tokens) -> str:
    try:
        return str(token_ids(tokens))
    except Exception:       # noqa: BLE001  (shown by its type alone: its repr is the learner's code)
        return f"a {type(tokens).__name__}"


def _stuck_hint(c: _Calls) -> str:
    if c.returned:
        return ("a returned batch not handed back: call scheduler.on_batch_return(done.batch, done.tokens, now) "
                "after its wait, before the next select; until then its requests stay RUNNING and Select "
                "cannot choose them")
    if c.selected:
        return ("a batch that select returned was never submitted: its requests stay RUNNING until it comes "
                "back; submit every batch select returns")
    return "no request can run and none is in flight"


def _idle_hint(c: _Calls) -> str:
    if c.engine.n_scheduled:
        return ("select finds no batch while every request is in flight: wait for the oldest batch "
                "(executor.wait()) and hand it back")
    return "every request has finished: stop once scheduler.has_work() is False and nothing is in flight"


def _slow_hint(c: _Calls) -> str:
    if not c.engine.has_work():
        return "every request has finished, but your loop went on: stop once scheduler.has_work() is False"
    if c.returned:
        return _stuck_hint(c)
    if not c.n_selects:
        return ("your loop never asked for a batch: while scheduler.has_work(), select a batch, submit it, wait "
                "for it, hand its tokens back")
    return "each turn must submit a batch, or wait for one and hand it back"


def _loop_hint(expected, got, c: _Calls, n_workers: int) -> str:
    """The hint for the first differing iteration, ``expected[-1]`` and ``got[-1]`` (if there is one)."""
    a = expected[-1]
    if len(got) < len(expected):
        return "your loop returned with work left: loop while scheduler.has_work() (a request in flight is work too)"
    b = got[-1]
    if a[1] > 1 and max(it[1] for it in got) == 1:
        return (f"only one batch ever in flight with n_workers={n_workers}: the pipeline bubble. Select and submit "
                "while fewer than n_workers are in flight; wait for the oldest only once n_workers are, or when "
                "select finds no batch")
    if b[1] != a[1]:
        return (f"{'fewer' if b[1] < a[1] else 'more'} batches in flight than the package's: select and submit while "
                f"fewer than n_workers={n_workers} are in flight; wait only once n_workers are, or when select "
                "finds no batch")
    if c.early:
        return ("hand each returned batch back (scheduler.on_batch_return) before the next select: until then its "
                "requests are RUNNING and Select passes them over")
    return "other requests in the batch: one select per turn, its batch submitted as it is"


def _loop_case(rng, case: int, n_workers: tuple, systems: tuple):
    """``(system, n_workers, EngineConfig, mbs, prompts, gens)`` of one case. ORCA's pool is sometimes
    too small for every request at once; the baseline's holds ``max_bs`` (it reserves max_seq_len).
    With ``n_workers`` > 1, more requests than a batch takes and room for several batches (ORCA's),
    or several micro-batches (the baseline's): the pipeline can fill."""
    n, system = n_workers[case % len(n_workers)], systems[case // len(n_workers) % len(systems)]
    n_requests = rng.randint(1, 6) if n == 1 else rng.randint(n + 1, 8)
    lens = [(rng.randint(1, 6), rng.randint(1, 4)) for _ in range(n_requests)]
    need = [p + g for p, g in lens]
    if system == "ft":
        max_bs = rng.randint(1, 4) if n == 1 else rng.randint(2, 4)
        n_slots, mbs = 1024 * max_bs, rng.randint(1, max_bs if n == 1 else max_bs // 2)
    else:
        max_bs = rng.randint(1, 4) if n == 1 else rng.randint(1, 2)
        n_slots, mbs = rng.randint(max(need) if n == 1 else max(max(need), sum(need) // 2), sum(need)), None
    prompts = [[rng.randrange(256) for _ in range(p)] for p, _ in lens]
    config = EngineConfig(max_bs=max_bs, n_slots=n_slots, pipeline_parallel=n, executor="local")
    return system, n, config, mbs, prompts, [g for _, g in lens]


def _engine(llm, system, mbs, prompts, gens):
    engine = llm.new_engine(system, mbs)
    engine.executor = _Logged(engine.executor)
    for prompt, g in zip(prompts, gens):
        engine.add_request(prompt, SamplingParams(max_gen_tokens=g))
    return engine


def _run_learner(loop, engine, calls: _Calls, n_workers: int, label: str):
    """``loop`` on ``engine``'s scheduler and executor, watched by ``calls``: a refused call, a time out
    or the package's code each stop it with what they saw."""
    try:
        run_bounded(loop, _Scheduler(engine.scheduler, calls), _Executor(engine, calls), n_workers,
                    case=label, timeout_s=LOOP_S, references=(Engine.run, Engine.step))
    except PackageCode:
        raise
    except TooSlow as e:
        raise (Mismatch(calls.refused) if calls.refused else TooSlow(f"{e}\n  hint: {_slow_hint(calls)}")) from None
    except BaseException:
        if calls.refused:
            raise Mismatch(calls.refused) from None
        raise
    if calls.refused:           # the loop caught the refusal and went on
        raise Mismatch(calls.refused)


def check_loop_cases(loop, n_workers: tuple, systems: tuple, seed: int):
    """``loop`` against ``Engine.run`` on cases of each of ``n_workers`` and ``systems`` (chapter 03's
    check and chapter 08's)."""
    refuse_package_code(loop, Engine.run, Engine.step)
    rng, n_cases = random.Random(seed), max(8, LOOP_CASES * len(n_workers) * len(systems))
    for case in range(n_cases):
        system, n, config, mbs, prompts, gens = _loop_case(rng, case, n_workers, systems)
        lens = [(len(p), g) for p, g in zip(prompts, gens)]
        label = (f"case {case} ({system}, n_workers={n}, max_bs={config.max_bs}, n_slots={config.n_slots}"
                 + (f", mbs={mbs}" if mbs else "") + f", (prompt, gen) lengths {lens})")
        llm = LLM(gpt=_model(), engine=config)
        reference = _engine(llm, system, mbs, prompts, gens)
        reference.run()
        reference.close()
        expected = _iterations(reference)
        engine = _engine(llm, system, mbs, prompts, gens)
        calls = _Calls(engine, label, len(expected))
        try:
            _run_learner(loop, engine, calls, n, label)
        finally:
            engine.close()
        got = _iterations(engine)
        for i, a in enumerate(expected):
            b = got[i] if i < len(got) else "none: your loop had returned"
            if a != b:
                differ(f"iteration {i} (its request ids, batches in flight once it was submitted, tokens returned)",
                       label, a, b, _loop_hint(expected[:i + 1], got[:i + 1], calls, n))
        if engine.has_work():
            s = engine.stats()
            differ("the work left when your loop returned", label, "none", f"{s.waiting} requests waiting, {s.running} "
                   "running", "loop while scheduler.has_work(): a batch that came back is handed back before the end")
        outputs = [[r.output for r in e.requests] for e in (reference, engine)]
        if outputs[0] != outputs[1]:
            differ("each request's output", label, *outputs, "hand back each batch's own tokens (done.tokens)")
    correct(n_cases, "Engine.run")


@grader
def check_loop(loop, seed: int = 0):
    """Chapter 03: ``loop(scheduler, executor, n_workers)``, Algorithm 1's loop with one batch in
    flight, against ``Engine.run`` on ORCA's engine (the tiny GPT, n_workers=1): per iteration the
    batch's request ids and tokens, then each request's output."""
    check_loop_cases(loop, (1,), ("orca",), seed)


PIECES = (Piece("select", "03", "orca", check_select, use_select, place=place_on("orca")),)
