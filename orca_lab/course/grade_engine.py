"""Graders of the exercises that write a piece of the learner's engine (``mine.py``), bounded: each
case runs the learner's code in a thread with a time limit and the driving loop with an iteration
cap, so code that loops forever or never returns stops the check with the case it was given, not the
notebook. The first case that differs is named, with both answers labelled."""
from __future__ import annotations

import functools
import random
import threading
from collections import OrderedDict

from orca_lab import LLM, EngineConfig, ModelConfig
from orca_lab.course.bounded import PackageCode, TooSlow, refuse_package_code, run_bounded
from orca_lab.course.plug import PluggedFormation, _Recorded
from orca_lab.engine.engine import Engine
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.request import Request
from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.engine.scheduler import RequestLevelScheduler

N_CASES = 40
CASE_S = 10.0          # wall time a case may take (a few ms when right)
MAX_ITERATIONS = 2000  # scheduler steps a case may take (tens when right)


class Mismatch(AssertionError):
    """The learner's answer differs from the package's on one case."""


class Stuck(AssertionError):
    """The learner's code did not return within a case's time or iteration bound."""


def bounded(fn, *args, label: str, seconds: float | None = None):
    """``fn(*args)`` in a thread, its result or its exception; past ``seconds``, ``Stuck`` naming
    ``label`` (the thread is left behind, a daemon: Python cannot stop it)."""
    out, seconds = {}, CASE_S if seconds is None else seconds

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:     # re-raised below, in the notebook's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise Stuck(f"{label}: your code did not return within {seconds:g} s (a loop that never ends?)")
    if "error" in out:
        e = out["error"]
        if isinstance(e, (NotImplementedError, Mismatch, Stuck)):
            raise e
        raise AssertionError(f"{label}: your code raised {type(e).__name__}: {e}") from e
    return out["value"]


def mismatch(what: str, case: str, expected, got, hint: str = "") -> Mismatch:
    return Mismatch(f"{what} differs on {case}:\n  expected (the package's): {expected}\n  got (yours):"
                    f"              {got}" + (f"\n  hint: {hint}" if hint else ""))


def differ(what: str, case: str, expected, got, hint: str = ""):
    raise mismatch(what, case, expected, got, hint)


def correct(n: int, against: str):
    print(f"correct: {n} random cases agree with {against}")


def request(rid: int, prompt_len: int, gen: int) -> Request:
    return Request(rid, [rid % 256] * prompt_len, SamplingParams(max_gen_tokens=gen), arrival=float(rid))


# -- 02: the request-level baseline forms a batch ----------------------------------------------------
def drive(sched, lens, label: str = "", limit: int = MAX_ITERATIONS) -> list[tuple]:
    """Serve requests of ``(prompt, gen)`` lengths on ``sched`` (no model, one batch in flight): per
    iteration ``(rids, first position fed, new tokens, slots reserved)``, then each request's finish."""
    reqs = [request(i, p, g) for i, (p, g) in enumerate(lens)]
    for r in reqs:
        sched.add(r)
    log, it = [], 0
    while sched.has_work():
        if it == limit:
            raise Stuck(f"{label}: {limit} iterations and requests are left: a batch that never ends?")
        batch = sched.select(float(it))
        if batch is None:
            raise Mismatch(f"{label}: no batch at iteration {it} with {sched.n_waiting} requests waiting and none in "
                           "flight: form_batch took no request (hint: take from the head of waiting while "
                           "the batch is under max_bs and kv.can_reserve(max_seq_len))")
        log.append((tuple(r.rid for r in sched.active), tuple(r.rid for r in batch.requests), tuple(batch.q_lens),
                    sched.kv.n_reserved))
        it += 1
        sched.on_batch_return(batch, [0] * len(batch), float(it))
    return log + [tuple(r.t_finish for r in reqs)]


def _formation_hint(expected, got, max_bs: int) -> str:
    if len(got[0]) > max_bs:
        return f"more than max_bs={max_bs} requests in the batch"
    if len(got[0]) > len(expected[0]):
        return "a request taken without room: take one only while kv.can_reserve(max_seq_len)"
    if len(got[0]) < len(expected[0]):
        return "too few requests: take from waiting while the batch is under max_bs and kv.can_reserve(max_seq_len)"
    if got[0] != expected[0]:
        return "the first requests of waiting, in arrival order (waiting.popleft())"
    if got[2] != expected[2]:
        return "the first iteration feeds the shortest prompt's length to every request"
    return "reserve max_seq_len slots for each request taken: kv.reserve(req, max_seq_len)"


def check_form_batch(form_batch, seed: int = 0):
    """``form_batch(waiting, kv, max_bs, max_seq_len) -> (batch, first_q_len)`` in the
    baseline's scheduler (``plug.PluggedFormation``) against ``RequestLevelScheduler``, iteration by
    iteration, on random traces and pools that hold fewer than ``max_bs`` reservations."""
    rng = random.Random(seed)
    for case in range(N_CASES):
        max_bs, max_seq_len = rng.randint(1, 4), 16
        n_slots = max_seq_len * rng.randint(1, max_bs + 1)
        lens = [(rng.randint(1, 9), rng.randint(1, 6)) for _ in range(rng.randint(1, 7))]
        label = f"case {case} (max_bs={max_bs}, n_slots={n_slots}, max_seq_len={max_seq_len}, (prompt, gen) {lens})"
        expected = drive(RequestLevelScheduler(KVSlotManager(n_slots), max_bs, max_seq_len), lens, label)
        got = bounded(drive, PluggedFormation(KVSlotManager(n_slots), max_bs, max_seq_len, None, form_batch), lens,
                      label, label=label)
        for i, (a, b) in enumerate(zip(expected[:-1], got[:-1])):
            if a != b:
                differ(f"iteration {i} (the batch's request ids, this iteration's, new tokens each, slots reserved)",
                       label, a, b, _formation_hint(a, b, max_bs))
        if expected != got:
            differ("the iterations, then each request's finish", label, expected, got,
                   "a batch runs until its longest request is done, then the next one forms")
    correct(N_CASES, "RequestLevelScheduler")


# -- 11: the paged block allocator -------------------------------------------------------------------
def allocations(cls, n_blocks: int, steps, label: str) -> list:
    """Replay ``steps`` (``("take", n)`` or ``("free", i)``: the blocks of the i-th take) on
    ``cls(n_blocks)``: the blocks of each take, in order."""
    allocator, taken = cls(n_blocks), []
    for op, arg in steps:
        if op == "take":
            got = allocator.take(arg)
            taken.append([int(b) for b in got] if got is not None else None)
        else:
            allocator.free(list(taken[arg]))
    return taken


class _Reference:
    """The package's allocator in block units: ``KVSlotManager``'s spans, one slot per block."""

    def __init__(self, n_blocks: int):
        self.kv = KVSlotManager(n_blocks)

    def take(self, n: int) -> list[int]:
        return [b for a, e in self.kv._take(n) for b in range(a, e)]

    def free(self, blocks):
        for b in blocks:
            self.kv._give(b, b + 1)


def _random_steps(rng, n_blocks: int):
    steps, held, free = [], [], n_blocks
    for _ in range(rng.randint(4, 24)):
        if held and (rng.random() < 0.4 or free == 0):
            i, n = held.pop(rng.randrange(len(held)))
            steps.append(("free", i))
            free += n
        else:
            n = rng.randint(1, min(free, 6))
            held.append((sum(op == "take" for op, _ in steps), n))
            steps.append(("take", n))
            free -= n
    return steps


def _allocator_hint(expected: list[int], got, held: set[int], freed: set[int]) -> str:
    if got is None or len(got) != len(expected):
        return "take(n) returns n block ids"
    if len(set(got)) < len(got) or set(got) & held:
        return "a block handed out twice: take must remove the blocks it hands out from the free ones"
    if set(expected) - set(got) & freed:
        return "a freed block was not handed out again: free(blocks) must give them back"
    if sorted(got) == sorted(expected):
        return "the blocks in increasing order"
    if expected == list(range(expected[0], expected[0] + len(expected))):
        return "one run of n consecutive free blocks when there is one, the lowest such run"
    return "no run of n consecutive free blocks: the n lowest free blocks"


def check_block_allocator(cls, seed: int = 0):
    """``cls(n_blocks)`` with ``take(n)`` and ``free(blocks)`` against the package's block manager
    (the spans ``BlockManager`` takes whole blocks from), block for block, on random takes and frees."""
    rng = random.Random(seed)
    for case in range(N_CASES):
        n_blocks = rng.randint(4, 24)
        steps = _random_steps(rng, n_blocks)
        label = f"case {case} (n_blocks={n_blocks}, steps {steps})"
        expected = allocations(_Reference, n_blocks, steps, label)
        got = bounded(allocations, cls, n_blocks, steps, label, label=label)
        for i, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                j = [k for k, (op, _) in enumerate(steps) if op == "take"][i]
                gone = {arg for op, arg in steps[:j] if op == "free"}        # takes freed before this one
                held = {x for k, blocks in enumerate(got[:i]) if k not in gone for x in blocks or ()}
                freed = {x for k in gone for x in expected[k]}
                differ(f"take number {i} (step {j}: take({steps[j][1]}))", label, a, b,
                       _allocator_hint(a, b, held, freed))
    correct(N_CASES, "BlockManager's blocks")


# -- 12: the prefix cache's eviction order ----------------------------------------------------------
def _lru_steps(rng) -> list[tuple[str, int | None]]:
    """Random ``freed(b)``, ``used(b)`` (b free and cached) and ``evict()`` calls, valid as the
    prefix cache makes them: a block is freed when it is not in the list, used or evicted when it is."""
    steps, free, held = [], [], list(range(rng.randint(3, 12)))
    for _ in range(rng.randint(4, 30)):
        op = rng.choice(["freed", "freed", "used", "evict"]) if held else rng.choice(["used", "evict"])
        if op == "freed" and held:
            b = held.pop(rng.randrange(len(held)))
            free.append(b)
            steps.append(("freed", b))
        elif free and op == "used":
            b = free.pop(rng.randrange(len(free)))
            held.append(b)
            steps.append(("used", b))
        elif free:
            held.append(free.pop(0))
            steps.append(("evict", None))
    return steps


def lru_replay(lru, steps) -> list:
    """What ``lru`` answers along ``steps``: each evicted block, and its length after every step."""
    out, reference = [], isinstance(lru, OrderedDict)
    for op, b in steps:
        try:
            if op == "evict":
                out.append(("evict", lru.popitem(last=False)[0] if reference else lru.evict()))
            elif reference:
                lru.pop(b) if op == "used" else lru.__setitem__(b, None)
            else:
                getattr(lru, op)(b)
            out.append(("len", len(lru)))
        except Exception as e:           # the learner's: shown at the call that raised it
            if reference:
                raise
            return out + [("raised", f"{type(e).__name__}: {e}")]
    return out


def _lru_hint(expected, got, steps, i) -> str:
    op = steps[i][0]
    if got[0] == "raised":
        return f"your {op}() raised {got[1]} where the package's answers {expected[1]}"
    if op == "used" or got[1] in [b for op, b in steps[:i] if op == "used"]:
        return "used(b): a request holds b again, so it leaves the list (a held block is never evicted)"
    if expected[0] == "len" and got[0] == "len":
        return f"len() counts the free cached blocks: {'freed adds one' if op == 'freed' else 'evict takes one out'}"
    return "evict the least recently freed block: the list is a queue, freed at its end, evicted from its front"


def check_block_lru(cls, seed: int = 0):
    """``cls()`` with ``freed(b)``, ``used(b)``, ``evict() -> b`` and ``len()`` against the prefix
    cache's ``OrderedDict`` of free cached blocks, on random calls as the cache makes them."""
    rng = random.Random(seed)
    for case in range(N_CASES):
        steps = _lru_steps(rng)
        label = f"case {case} (calls {[f'{op}({b})' if b is not None else f'{op}()' for op, b in steps]})"
        expected = lru_replay(OrderedDict(), steps)
        got = bounded(lambda: lru_replay(cls(), steps), label=label)
        for i, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                differ(f"answer {i} ({a[0]})", label, a[1], b[1], _lru_hint(a, b, steps, _step_of(expected, i)))
    correct(N_CASES, "PrefixCachingBlockManager's eviction order")


def _step_of(answers, i: int) -> int:
    """The step that gave answer ``i`` (each step answers its length, an eviction its block first)."""
    return sum(kind == "len" for kind, _ in answers[:i])


# -- 03 and 08: Algorithm 1's loop ------------------------------------------------------------------
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
            self.tokens[done.batch.iteration] = _token_ids(done.tokens)
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


class _Executor(_Recorded):
    """The engine's executor as the learner's loop gets it (``plug._Recorded``: the engine keeps its
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
        return done


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
        if not _same_tokens(tokens, done.tokens):
            c.refuse(f"its tokens {list(done.tokens)} (done.tokens)", repr(tokens),
                     "hand back the tokens the batch returned: scheduler.on_batch_return(done.batch, done.tokens, now)")
        c.returned.remove(done)
        c.handed.append(batch)
        return self.scheduler.on_batch_return(batch, tokens, now)


def _token_ids(tokens) -> list:
    """A batch's tokens as plain ints (None: a request the baseline holds, which gets no token)."""
    return [None if t is None else int(t) for t in tokens]


def _same_tokens(got, expected) -> bool:
    try:
        return _token_ids(got) == _token_ids(expected)
    except Exception:       # noqa: BLE001  (not a list of token ids: not the batch's tokens)
        return False


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


def _check_loop(loop, n_workers: tuple, systems: tuple, seed: int):
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


def check_loop(loop, seed: int = 0):
    """Chapter 03: ``loop(scheduler, executor, n_workers)``, Algorithm 1's loop with one batch in
    flight, against ``Engine.run`` on ORCA's engine (the tiny GPT, n_workers=1): per iteration the
    batch's request ids and tokens, then each request's output."""
    _check_loop(loop, (1,), ("orca",), seed)


def check_in_flight(loop, seed: int = 0):
    """Chapter 08: the same loop keeping up to ``n_workers`` batches in flight, n_workers in {1, 2,
    4}, on ORCA's engine and the baseline's micro-batches (``executor="local"``: a pipeline's stages
    run one after another in this process, in the pipeline's order); batches in flight compared too."""
    _check_loop(loop, (1, 2, 4), ("orca", "ft"), seed)
