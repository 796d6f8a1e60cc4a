"""Graders of the exercises that write a piece of the learner's engine (``mine.py``), bounded: each
case runs the learner's code in a thread with a time limit and the driving loop with an iteration
cap, so code that loops forever or never returns stops the check with the case it was given, not the
notebook. The first case that differs is named, with both answers labelled."""
from __future__ import annotations

import random
import threading
from collections import OrderedDict

from orca_lab.course.bounded import refuse_package_code, run_bounded
from orca_lab.course.plug import PluggedFormation
from orca_lab.engine import policies
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


def differ(what: str, case: str, expected, got, hint: str = ""):
    raise Mismatch(f"{what} differs on {case}:\n  expected (the package's): {expected}\n  got (yours):"
                   f"              {got}" + (f"\n  hint: {hint}" if hint else ""))


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


# -- 11: the chunked-prefill token budget -----------------------------------------------------------
class _Runs:
    """One case's ``run(request, n)``: each call noted as ``(rid, n, ran)``; the requests of
    ``refused`` cannot run (no room, or in flight) and get False. Past ``cap`` calls, ``Stuck``."""

    def __init__(self, reqs: dict, refused: set, cap: int, label: str):
        self.reqs, self.refused, self.cap, self.label, self.calls = reqs, refused, cap, label, []

    def __call__(self, req, n) -> bool:
        if len(self.calls) == self.cap:
            raise Stuck(f"{self.label}: run was called {self.cap} times: each request is offered once; run it once "
                        "at most")
        rid = req.rid if any(req is r for r in self.reqs.values()) else repr(req)
        self.calls.append((rid, n, rid in self.reqs and rid not in self.refused))
        return self.calls[-1][2]


def budget_calls(fill, case: tuple, label: str, learner: bool = True) -> list[tuple]:
    """The ``run`` calls ``fill(decodes, prompts, budget, max_bs, run)`` makes on ``case`` =
    ``(decodes, prompts, budget, max_bs, refused)`` (``(rid, tokens)`` pairs, offered once, as
    iterators, as the scheduler does), ``learner``'s bounded in time and in calls."""
    decodes, prompts, budget, max_bs, refused = case
    reqs = {rid: request(rid, n, 1) for rid, n in decodes + prompts}
    runs = _Runs(reqs, refused, 2 * len(reqs) + 2, label)
    args = (iter([(reqs[r], n) for r, n in decodes]), iter([(reqs[r], n) for r, n in prompts]), budget, max_bs, runs)
    if learner:
        run_bounded(fill, *args, case=label, references=(policies.fill_budget,))
    else:
        fill(*args)
    return runs.calls


def _budget_case(rng, part: int) -> tuple:
    """One iteration's candidates: the rules alone first (``part`` 0: max_bs never reached, every run
    succeeds), then max_bs reached (1), then runs refused too (2), so a hint names the first rule
    broken."""
    budget = rng.choice([rng.randint(1, 6), rng.randint(6, 40)])
    rids = iter(range(100))
    decodes = [(next(rids), 1) for _ in range(rng.randint(0, 5))]
    prompts = [(next(rids), rng.randint(1, 2 * budget + 2)) for _ in range(rng.randint(0 if decodes else 1, 5))]
    n = len(decodes) + len(prompts)
    max_bs = rng.randint(n + 1, n + 2) if part == 0 else rng.randint(1, 8)
    refused = {rid for rid, _ in decodes + prompts if part == 2 and rng.random() < 0.15}
    return decodes, prompts, budget, max_bs, refused


def _budget_hint(case: tuple, expected: list, got: list) -> str:
    decodes, prompts, budget, max_bs, refused = case
    tokens, order, is_decode = dict(decodes + prompts), [rid for rid, _ in decodes + prompts], dict(decodes)
    done = set()
    for rid, n, _ in got:                      # a call no iteration could make
        if rid not in tokens:
            return "run(request, n) takes the request of a (request, tokens) pair, as offered"
        if rid in done:
            return f"request {rid} run twice: each request is offered once and runs at most once an iteration"
        done.add(rid)
        if not n >= 1:
            return f"request {rid} fed {n} tokens: never run a request with none; stop once the budget is spent"
        if rid in is_decode and n > 1:
            return f"a decode given {n} tokens (request {rid}): a decode feeds one token, its last"
        if n > tokens[rid]:
            return f"request {rid} fed {n} tokens, more than the {tokens[rid]} it has to feed"
    ran = [(rid, n) for rid, n, ok in got if ok]
    if sum(n for _, n in ran) > budget:
        return f"budget exceeded ({sum(n for _, n in ran)} > {budget} new tokens): a prompt is cut to what is left"
    if len(ran) > max_bs:
        return f"more than max_bs={max_bs} requests run"
    called = [rid for rid, _, _ in got]
    for a, b in zip(called, called[1:]):
        if order.index(a) > order.index(b):
            if b in is_decode:
                return f"decode {b} run after prompt {a}: decodes go first (a long prompt must not stall them)"
            return f"prompt {a} fed before prompt {b}, which arrived earlier: prompts in arrival order, as offered"
    for hint, calls in _budget_mistakes(case, expected):
        if got == calls:
            return hint
    if not got:
        rid, n, _ = expected[0]
        cut = f"; prompt {rid} is not cut to the remainder: it gets the {n} tokens of the budget" * (n < tokens[rid])
        return f"no request ran: call run(request, n) for each request you feed{cut}"
    i = _diverges(expected, got)
    if i == len(expected):
        full = sum(ok for _, _, ok in expected) == max_bs
        return f"stop once {'max_bs requests run' if full else 'the budget is spent'}"
    rid, n, _ = expected[i]
    if i < len(got) and got[i][0] == rid:
        return f"request {rid} fed {got[i][1]} tokens where {n} were left for it: min(its tokens, what is left)"
    if rid in is_decode:
        return f"decode {rid} did not run: every decode runs, one token each, before any prompt"
    if i < len(got):
        return f"prompt {rid} skipped: it {'gets what is left (a chunk)' if n < tokens[rid] else 'fits'}"
    cut = f": not cut to the remainder, it gets the {n} tokens left (a chunk)" * (n < tokens[rid])
    return (f"budget left unused while prompt {rid} waits{cut}; stop only when the budget is spent or max_bs "
            "requests run")


def _budget_mistakes(case: tuple, expected: list):
    """``(hint, calls)``: what a budget with one well-known mistake calls on ``case``, from the
    package's rule on changed input, or its calls cut short (never the rule written again)."""
    decodes, prompts, budget, max_bs, refused = case
    tokens, fill = dict(decodes + prompts), policies.fill_budget

    def skips_cuts(d, p, b, m, run):          # a prompt longer than what is left: not run, not counted
        fill(d, p, b, m, lambda req, n: n == tokens[req.rid] and run(req, n))

    def counts_refused(d, p, b, m, run):      # a run that returned False taken from the budget too
        fill(d, p, b, m, lambda req, n: run(req, n) or True)

    yield ("a run that returns False took nothing: count only the requests that ran, and the tokens they took",
           budget_calls(counts_refused, case, "", learner=False))
    ran = [i for i, c in enumerate(expected) if c[2]]
    if len(ran) == max_bs:
        yield f"one request short of max_bs={max_bs}", expected[:ran[max_bs - 2] + 1] if max_bs > 1 else []
    skipping = budget_calls(skips_cuts, case, "", learner=False)
    if len(skipping) > _diverges(skipping, expected):       # went on past the prompt it did not cut
        yield ("a prompt longer than what is left of the budget is not cut to the remainder: it gets what is "
               "left (a chunk), it is not skipped"), skipping
    by_length = (decodes, sorted(prompts, key=lambda p: p[1]), budget, max_bs, refused)
    yield ("a later prompt fed before an earlier one: prompts in arrival order, as offered (not by length)",
           budget_calls(fill, by_length, "", learner=False))


def _diverges(a: list, b: list) -> int:
    """The first index where the lists differ (the shorter one's length if one starts the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_fill_budget(fn, seed: int = 0):
    """``fn(decodes, prompts, budget, max_bs, run)`` against the chunked scheduler's token budget
    (``policies.fill_budget``): the same ``run(request, n)`` calls, in the same order, on random
    iterations (decodes, prompts longer and shorter than the budget, requests that cannot run)."""
    refuse_package_code(fn, policies.fill_budget)
    rng = random.Random(seed)
    for case in range(N_CASES):
        c = _budget_case(rng, min(2, 3 * case // N_CASES))
        decodes, prompts, budget, max_bs, refused = c
        label = (f"case {case} (budget={budget}, max_bs={max_bs}, decodes {[rid for rid, _ in decodes]}, prompts "
                 f"(request, tokens) {prompts}, run returns False for {sorted(refused)})")
        expected = budget_calls(policies.fill_budget, c, label, learner=False)
        got = budget_calls(fn, c, label)
        if got != expected:
            differ("the run calls (request, new tokens, ran)", label, expected, got, _budget_hint(c, expected, got))
    correct(N_CASES, "the chunked scheduler's token budget")
