"""Chapter 02, request-level batching (the FasterTransformer baseline): the graders of its exercises
(a batch's iterations, each request's finish, the batch formation) and its plug point,
``use_form_batch``."""
from __future__ import annotations

import random

from orca_lab.course.bounded import an_int, as_answer, ints, refuse_package_code, run_bounded
from orca_lab.course.forked import grader
from orca_lab.course.harness import N_CASES, Mismatch, Piece, Stuck, correct, differ, place_on, read, request, run_case
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.scheduler import RequestLevelScheduler

MAX_ITERATIONS = 2000  # scheduler steps a case of the batch formation may take (tens when right)


def _ft_finish_iterations(prompt_lens, gens, max_bs) -> list[int]:
    """The grader's answer (private: no learner calls it under a name of the exercise's, and it is
    refused as the learner's): serve the requests on ``RequestLevelScheduler`` (no model) and read
    the iteration after which each returns."""
    sched = RequestLevelScheduler(KVSlotManager(max_bs * 1024), max_bs, max_seq_len=1024)
    reqs = [request(i, p, g, arrival=i) for i, (p, g) in enumerate(zip(prompt_lens, gens))]
    for r in reqs:
        sched.add(r)
    it = 0
    while sched.has_work():
        batch = sched.select(it)
        it += 1
        sched.on_batch_return(batch, [0] * len(batch), float(it))
    return [int(r.t_finish) for r in reqs]


@grader
def check_ft_iterations(fn, seed: int = 0):
    """``fn(prompt_lens, gens) -> iterations of one request-level batch of those requests``, against
    ``RequestLevelScheduler`` serving them in one batch."""
    refs = (_ft_finish_iterations, RequestLevelScheduler)
    refuse_package_code(fn, *refs)
    rng = random.Random(seed)
    for case in range(N_CASES):
        n = rng.randint(1, 6)
        p, g = [rng.randint(1, 30) for _ in range(n)], [rng.randint(1, 8) for _ in range(n)]
        label = f"case {case} (prompt_lens={p}, gens={g})"
        got = read("the iterations", label, run_bounded(fn, list(p), list(g), case=label, references=refs), an_int,
                   "a number of iterations")
        expected = max(_ft_finish_iterations(p, g, n))
        if got != expected:
            differ("the iterations", label, expected, got,
                   "the first iteration runs the shortest prompt's length of every prompt; the longer prompts' "
                   "other tokens then run one an iteration, and the batch ends when its last request is done")
    correct(N_CASES, "RequestLevelScheduler")


@grader
def check_ft_finish(fn, seed: int = 0):
    """``fn(prompt_lens, gens, max_bs) -> [iteration after which each request returns]``."""
    refs = (_ft_finish_iterations, RequestLevelScheduler)
    refuse_package_code(fn, *refs)
    rng = random.Random(seed)
    for case in range(N_CASES):
        n, max_bs = rng.randint(1, 7), rng.randint(1, 4)
        p = [rng.randint(1, 9) for _ in range(n)]
        g = [rng.randint(1, 6) for _ in range(n)]
        label = f"case {case} (prompt_lens={p}, gens={g}, max_bs={max_bs})"
        expected = _ft_finish_iterations(p, g, max_bs)
        got = read("the finish iterations", label, run_bounded(fn, p, g, max_bs, case=label, references=refs),
                   ints, "a list of ints, one per request")
        if got != expected:
            differ("the finish iterations", label, expected, got,
                   "one per request, in arrival order" if len(got) != len(expected) else
                   "batches of max_bs in arrival order: a batch runs until its longest request is done, "
                   "then the next batch forms")
    correct(N_CASES, "RequestLevelScheduler")


def drive(sched, lens, label: str = "", limit: int = MAX_ITERATIONS) -> list[tuple]:
    """Serve requests of ``(prompt, gen)`` lengths on ``sched`` (no model, one batch in flight): per
    iteration ``(rids, first position fed, new tokens, slots reserved)``, then each request's finish."""
    reqs = [request(i, p, g, arrival=i) for i, (p, g) in enumerate(lens)]
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


@grader
def check_form_batch(form_batch, seed: int = 0):
    """``form_batch(waiting, kv, max_bs, max_seq_len) -> (batch, first_q_len)`` in the
    baseline's scheduler (``PluggedFormation``) against ``RequestLevelScheduler``, iteration by
    iteration, on random traces and pools that hold fewer than ``max_bs`` reservations."""
    refs = (RequestLevelScheduler.form_batch,)
    refuse_package_code(form_batch, *refs)
    rng = random.Random(seed)
    for case in range(N_CASES):
        max_bs, max_seq_len = rng.randint(1, 4), 16
        n_slots = max_seq_len * rng.randint(1, max_bs + 1)
        lens = [(rng.randint(1, 9), rng.randint(1, 6)) for _ in range(rng.randint(1, 7))]
        label = f"case {case} (max_bs={max_bs}, n_slots={n_slots}, max_seq_len={max_seq_len}, (prompt, gen) {lens})"
        expected = drive(RequestLevelScheduler(KVSlotManager(n_slots), max_bs, max_seq_len), lens, label)
        got = run_case(drive, PluggedFormation(KVSlotManager(n_slots), max_bs, max_seq_len, None, form_batch), lens,
                       label, label=label, references=refs)
        expected, got = as_answer(expected), as_answer(got)    # compared as values: the learner's ints carry code
        for i, (a, b) in enumerate(zip(expected[:-1], got[:-1])):
            if a != b:
                differ(f"iteration {i} (the batch's request ids, this iteration's, new tokens each, slots reserved)",
                       label, a, b, _formation_hint(a, b, max_bs))
        if expected != got:
            differ("the iterations, then each request's finish", label, expected, got,
                   "a batch runs until its longest request is done, then the next one forms")
    correct(N_CASES, "RequestLevelScheduler")


class PluggedFormation(RequestLevelScheduler):
    """The baseline whose batches are formed by the learner's ``form_batch(waiting, kv, max_bs,
    max_seq_len) -> (batch, first_q_len)`` (notebook 02): the requests it took from ``waiting`` with
    ``max_seq_len`` slots reserved each, and the shortest prompt (its first iteration's new tokens).
    The scheduler feeds the batch until its longest request is done, in micro-batches."""

    def __init__(self, kv, max_bs: int, max_seq_len: int, mbs: int | None, form_batch):
        super().__init__(kv, max_bs, max_seq_len, mbs)
        self.learner_form_batch = form_batch

    def form_batch(self):
        return self.learner_form_batch(self.waiting, self.kv, self.max_bs, self.max_seq_len)


def use_form_batch(engine, form_batch):
    """``engine`` (the baseline's, fresh) forming its batches with the learner's ``form_batch``."""
    old = engine.scheduler
    if old.name != "ft":
        raise ValueError(f"use_form_batch takes an engine of system 'ft', not {old.name!r}")
    engine.scheduler = PluggedFormation(old.kv, old.max_bs, old.max_seq_len, old.mbs, form_batch)
    return engine


PIECES = (Piece("form_batch", "02", "the baseline (ft)", check_form_batch, use_form_batch, place=place_on("ft")),)
