"""Chapter 11, after ORCA (paged K/V, preemption, chunked prefill): the graders of the block table's
slots, the victim, the block allocator and the token budget, and their plug points, ``use_victim``,
``use_blocks`` and ``use_budget``."""
from __future__ import annotations

import random

from orca_lab.course.bounded import ints, refuse_package_code, run_bounded
from orca_lab.course.forked import grader
from orca_lab.course.harness import (N_CASES, Piece, Stuck, check_by_hand, correct, differ, place_on, read, shown_answer,
                                    request, run_case)
from orca_lab.engine import policies
from orca_lab.engine.blocks import BlockManager
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.policies import PAGED, Victims
from orca_lab.engine.request import RequestState


@grader
def check_block_slots(fn, seed: int = 0):
    """``fn(table, n_tokens, block_size) -> slot ids`` of a request's first ``n_tokens`` tokens
    against ``BlockManager`` (``req.slots`` after it grew, blocks scattered by earlier releases)."""
    refuse_package_code(fn, BlockManager)
    rng = random.Random(seed)
    for case in range(N_CASES):
        bs = rng.choice([1, 2, 4, 8])
        kv = BlockManager(64 * bs, bs)
        others = [request(100 + i, 1, 1) for i in range(rng.randint(1, 6))]
        for o in others:
            kv.grow(o, rng.randint(1, 4) * bs)
        for o in rng.sample(others, rng.randint(0, len(others))):
            kv.release(o)
        req, n = request(0, 1, 60), 0
        for _ in range(rng.randint(1, 5)):      # grows a few times, between others' blocks
            n += rng.randint(1, 3 * bs)
            kv.grow(req, n)
            filler = request(200 + n, 1, 1)
            kv.grow(filler, bs)
        table = kv.block_table(req)
        label = f"case {case} (table {table}, {n} tokens, block_size {bs})"
        got = read("the slot ids", label, run_bounded(fn, list(table), n, bs, case=label, references=(BlockManager,)),
                   ints, f"a list of {n} slot ids")
        expected = [int(s) for s in req.slots[:n]]
        if got != expected:
            differ("the slot ids", label, expected, got, f"one slot per token: {n}" if len(got) != n else
                   "a token's block is the table's entry for the block_size-long stretch it falls in, "
                   "and its slot is its place within that stretch")
    correct(N_CASES, "BlockManager")


@grader
def check_victim(fn, seed: int = 0):
    """``fn(running, req, chosen) -> the request to preempt, or None`` against the paged
    scheduler's choice (``policies.Victims``) on random pools."""
    refuse_package_code(fn, Victims)
    rng = random.Random(seed)
    states = [RequestState.INCREMENT, RequestState.INCREMENT, RequestState.RUNNING, RequestState.INITIATION]
    for case in range(N_CASES):
        running = [request(rid, 1, 1, arrival=rid) for rid in range(rng.randint(1, 8))]
        for r in running:
            r.state = rng.choice(states)
            r.slots = None if r.state is RequestState.INITIATION or rng.random() < 0.2 else [rid for rid in range(4)]
        req = rng.choice(running)
        chosen = {r.rid for r in running if rng.random() < 0.3}
        expected = Victims(list(running), chosen).next(req)
        pool = [(r.rid, r.state.value, r.slots is not None) for r in running]
        label = f"case {case} (request {req.rid} needs a block; pool (rid, state, holds blocks) {pool}; " \
                f"in this batch {sorted(chosen)})"
        got = run_bounded(fn, list(running), req, set(chosen), case=label, references=(Victims,))
        if got is not None and not any(got is r for r in running):
            differ("the victim", label, getattr(expected, "rid", None), shown_answer(got, label),
                   "return a request of running, or None")
        if got is not expected:
            differ("the victim", label, getattr(expected, "rid", None), getattr(got, "rid", None),
                   _victim_hint(got, req, chosen))
    correct(N_CASES, "the paged scheduler's victims")


def _victim_hint(got, req, chosen) -> str:
    if got is None:
        return "a request after it holds blocks, between iterations (INCREMENT) and not in this batch: preempt it"
    if (got.arrival, got.rid) <= (req.arrival, req.rid):
        return "never one that arrived before req (nor req itself): only later arrivals give way"
    if got.slots is None:
        return "a request without blocks frees nothing"
    if got.state is not RequestState.INCREMENT or got.rid in chosen:
        return "only a request between iterations (INCREMENT) and not chosen for this batch can be preempted"
    return "the latest arrival first: walk running from its end"


def allocations(cls, n_blocks: int, steps, label: str) -> list:
    """Replay ``steps`` (``("take", n)`` or ``("free", i)``: the blocks of the i-th take) on
    ``cls(n_blocks)``: the blocks of each take, in order."""
    allocator, taken = cls(n_blocks), []
    for op, arg in steps:
        if op == "take":
            got = allocator.take(arg)
            try:
                taken.append(ints(got) if got is not None else None)
            except TypeError as e:           # compared, it differs from every list of ids
                taken.append(f"no list of block ids: {e}")
        else:
            allocator.free(list(taken[arg]))
    return taken


class _Reference:
    """The grader's allocator in block units over the package's: ``KVSlotManager``'s runs, one slot
    per block (refused as the learner's, as the package's classes are)."""

    def __init__(self, n_blocks: int):
        self.kv = KVSlotManager(n_blocks)

    def take(self, n: int) -> list[int]:
        return [b for a, e in self.kv.take(n) for b in range(a, e)]

    def free(self, blocks):
        for b in blocks:
            self.kv.give(b, b + 1)


_REFERENCES = (_Reference, KVSlotManager, BlockManager)

# the cases every seed runs first, each the smallest that shows one mistake, in the order a hint can
# tell them apart: take must remove what it hands out; free gives it back; once; a run in the middle of
# the free blocks; the last possible run (free blocks [0, 2, 3]: take(2) is [2, 3], a start at i = 1)
FIXED_STEPS = ((2, [("take", 1), ("take", 1)]),
               (2, [("take", 2), ("free", 0), ("take", 2)]),
               (3, [("take", 1), ("free", 0), ("take", 1), ("take", 1)]),
               (6, [("take", 1), ("take", 1), ("take", 2), ("take", 1), ("take", 1), ("free", 0), ("free", 2),
                    ("free", 4), ("take", 2)]),
               (4, [("take", 1), ("take", 1), ("take", 2), ("free", 0), ("free", 2), ("take", 2)]))


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


def _allocator_hint(expected: list[int], got, held: set[int], freed: set[int], free: list[int]) -> str:
    if isinstance(got, str):
        return "take(n) returns the n block ids it took: a list of ints"
    """What take's answer ``got`` shows, against the package's ``expected``: ``held``, the blocks the
    learner's earlier takes hand out; ``freed``, those given back before this take; ``free``, the
    free blocks (the package's), in order."""
    n = len(expected)
    if got is None or len(got) != n:
        if got is not None and len(got) < n and set(expected) & freed:
            return "freed blocks were not handed out again: free(blocks) must give them back"
        return "take(n) returns n block ids"
    twice = {b for b in got if got.count(b) > 1} | set(got) & held
    if twice:
        if twice <= freed:
            return (f"a double free: free(blocks) gave block {min(twice)} back twice, so take handed it out "
                    "twice: free must give each block back once")
        return "a block handed out twice: take must remove the blocks it hands out from the free ones"
    run = expected == list(range(expected[0], expected[0] + n))
    if run and got == free[:n]:              # the n lowest free blocks where a run is
        if expected == free[-n:]:
            return (f"the last possible run ({expected}, the last {n} free blocks) was never tried: the search "
                    f"must try every start, up to the {n}-th free block from the end included")
        return "one run of n consecutive free blocks when there is one, the lowest such run"
    if set(expected) - set(got) & freed:
        return "a freed block was not handed out again: free(blocks) must give them back"
    if sorted(got) == sorted(expected):
        return "the blocks in increasing order"
    if run:
        return "one run of n consecutive free blocks when there is one, the lowest such run"
    return "no run of n consecutive free blocks: the n lowest free blocks"


@grader
def check_block_allocator(cls, seed: int = 0):
    """``cls(n_blocks)`` with ``take(n)`` and ``free(blocks)`` against the package's block manager
    (the runs ``BlockManager`` takes whole blocks from), block for block: the fixed cases of
    ``FIXED_STEPS``, then random takes and frees."""
    refuse_package_code(cls, *_REFERENCES)
    rng = random.Random(seed)
    cases = [(f"fixed case {i}", n, steps) for i, (n, steps) in enumerate(FIXED_STEPS)]
    for case in range(N_CASES):
        n_blocks = rng.randint(4, 24)
        cases.append((f"case {case}", n_blocks, _random_steps(rng, n_blocks)))
    for name, n_blocks, steps in cases:
        label = f"{name} (n_blocks={n_blocks}, steps {steps})"
        expected = allocations(_Reference, n_blocks, steps, label)
        got = run_case(allocations, cls, n_blocks, steps, label, label=label, references=_REFERENCES)
        for i, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                j = [k for k, (op, _) in enumerate(steps) if op == "take"][i]
                gone = {arg for op, arg in steps[:j] if op == "free"}        # takes freed before this one
                held = {x for k, blocks in enumerate(got[:i]) if k not in gone for x in blocks or ()}
                freed = {x for k in gone for x in expected[k]}
                free = sorted(set(range(n_blocks)) - {x for k, blocks in enumerate(expected[:i]) if k not in gone
                                                      for x in blocks})
                differ(f"take number {i} (step {j}: take({steps[j][1]}))", label, a, b,
                       _allocator_hint(a, b, held, freed, free))
    correct(N_CASES, f"BlockManager's blocks, as do its {len(FIXED_STEPS)} fixed cases")


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
        n = n if type(n) is int else repr(n)     # 16.0 is no count of tokens, though it equals 16
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
        if type(n) is not int:
            return f"request {rid} fed {n} tokens: n counts tokens, an int"
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


@grader
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


class LearnerVictims(Victims):
    """The paged scheduler's victims, chosen by the learner's ``victim(running, req, chosen)``."""

    def __init__(self, victim, running, chosen):
        super().__init__(running, chosen)
        self.victim = victim

    def next(self, req):
        return self.victim(self.running, req, self.chosen)


def use_victim(engine, victim):
    """``engine`` (a paged or chunked one) preempting the request the learner's ``victim`` names."""
    if engine.scheduler.name not in PAGED:
        raise ValueError(f"use_victim takes an engine of system {PAGED}, not {engine.scheduler.name!r}")
    engine.scheduler.victims = lambda running, chosen: LearnerVictims(victim, running, chosen)
    return engine


def use_blocks(engine, allocator_class):
    """``engine`` (a paged or chunked one, fresh) whose blocks come from the learner's
    ``allocator_class(n_blocks)``: ``take(n)`` -> n free block ids, ``free(blocks)`` gives them back
    (notebook 11). The block manager's ``take`` and ``give`` are its only source of blocks: both go through here.
    Blocks its LLM's prefix cache kept from an earlier engine are taken from the learner's first."""
    kv = engine.scheduler.kv
    if engine.scheduler.name not in PAGED:
        raise ValueError(f"use_blocks takes an engine of system {PAGED}, not {engine.scheduler.name!r}")
    if kv.n_reserved:
        raise ValueError("use_blocks takes a fresh engine: this one's blocks are already handed out")
    allocator, bs = allocator_class(kv.n_blocks), kv.block_size
    cached = set(getattr(kv, "hash_of", ()))      # blocks an earlier engine of its LLM left cached: not free
    if cached:                                    # (the cache recycles them itself, by eviction)
        every = list(allocator.take(kv.n_blocks))
        allocator.free([b for b in every if b not in cached])
    kv.take = lambda n: [(b * bs, (b + 1) * bs) for b in allocator.take(n // bs)]
    kv.give = lambda a, b: allocator.free(list(range(a // bs, b // bs)))
    return engine


def use_budget(engine, fill_budget):
    """``engine`` (a chunked one) giving each request of an iteration the new tokens the learner's
    ``fill_budget(decodes, prompts, budget, max_bs, run)`` says (notebook 11). Each ``run(request, n)``
    it makes is checked first: a request offered and not run yet, 1 <= n <= its tokens, within the
    budget and max_bs; a wrong call stops the engine naming it, not a broken batch run."""
    if engine.scheduler.name != "chunked":
        raise ValueError(f"use_budget takes an engine of system 'chunked', not {engine.scheduler.name!r}")

    def checked(decodes, prompts, budget, max_bs, run):
        offered, spent = {}, {"tokens": 0, "requests": 0}

        def offer(pairs):
            for req, n in pairs:
                offered[req.rid] = n
                yield req, n

        def run_checked(req, n):
            has = offered.pop(getattr(req, "rid", None), 0)
            if type(n) is not int or not 1 <= n <= has or spent["tokens"] + n > budget or spent["requests"] == max_bs:
                raise AssertionError(f"your fill_budget called run(request {getattr(req, 'rid', req)!r}, {n}): it "
                                     f"must be a request offered and not run yet, an int 1 <= n <= its {has} tokens, within "
                                     f"budget={budget} ({spent['tokens']} taken) and max_bs={max_bs} "
                                     f"({spent['requests']} run)")
            ran = run(req, n)
            if ran:
                spent["tokens"], spent["requests"] = spent["tokens"] + n, spent["requests"] + 1
            return ran

        fill_budget(offer(decodes), offer(prompts), budget, max_bs, run_checked)

    engine.scheduler.fill_budget = checked
    return engine


# the learner's pieces, by the name their exercise gives them: the chapter that writes it, where it goes


_PAGED = place_on(*PAGED)
PIECES = (Piece("BlockAllocator", "11", "paged, chunked", check_block_allocator, use_blocks, place=_PAGED),
          Piece("victim", "11", "paged, chunked", check_victim, use_victim, place=_PAGED),
          Piece("fill_budget", "11", "chunked", check_fill_budget, use_budget, place=place_on("chunked")))


def check_slots_held(orca_slots, paged_slots):
    """Notebook 11's by-hand count, read from the package's accounting: a 60-token prompt declaring
    ``max_gen_tokens=200`` that stops after 30 tokens, on blocks of 16 (not the 40 and 100 the chapter
    works through above it, whose ORCA count it prints). A wrong count is named with its hint, never
    the package's (the exercise's answer)."""
    req = request(0, 60, 200)
    BlockManager(1024, 16).grow(req, 60 + 30)
    check_by_hand("a 60-token prompt, max_gen_tokens=200, 30 generated, block_size 16", {
        "orca_slots": (orca_slots, req.max_tokens,
                       "ORCA reserves, when it first schedules a request, every token the request may ever hold"),
        "paged_slots": (paged_slots, len(req.slots),
                        "paging holds whole blocks, as many as the tokens it has written need")})
    print(f"correct: {orca_slots} reserved by ORCA, {paged_slots} held in blocks")
