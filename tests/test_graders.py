"""Each grader against a table of wrong answers a learner writes: each is caught with the hint its
symptom calls for, a loop that never ends included (bounded in time: the grader returns); the
package's own answers, and thin wrappers of them, are refused; the course's solutions pass."""
import math
import statistics
import time

import pytest
import torch

from orca_lab.course import _references, bounded, grade, grade_engine, solve
from orca_lab.course.online_softmax import update
from orca_lab.engine.engine import Engine
from orca_lab.engine.executor import split_layers
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.prefix_cache import block_hash, chain_hashes
from orca_lab.engine.request import RequestState
from orca_lab.engine.scheduler import OrcaScheduler

from tests.test_course import LowestFirst, skipping_select


def solution(chapter: str, name: str, **names):
    """The course's solution ``name`` of notebook ``chapter``, run with the names its cells read."""
    path = next(solve.SOLUTIONS.glob(f"{chapter}_*.py"))
    scope = {"torch": torch, "math": math, "RequestState": RequestState, **names}
    for code in solve.solutions(path).values():      # in order, up to the one that defines it
        exec(code, scope)
        if name in scope:
            return scope[name]


def _attention(q, k, v):          # notebook 01's, which its solution reads
    scores = q @ k.T / q.shape[-1] ** 0.5
    mask = torch.ones(len(q), len(k), dtype=torch.bool).tril(len(k) - len(q))
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


# -- 03: Select ------------------------------------------------------------------------------------
def select_with(reserve_increments=False, newest_first=False, ge=False, max_bs_extra=0):
    """Algorithm 1's Select with one of a learner's mistakes."""
    def select(pool, n_rsrv, max_bs, n_slots):
        batch = []
        order = [r for r in pool if r.state is not RequestState.RUNNING]
        for req in reversed(order) if newest_first else order:
            if len(batch) == max_bs + max_bs_extra:
                break
            if req.state is RequestState.INITIATION or reserve_increments:
                if n_rsrv + req.max_tokens >= n_slots + (0 if ge else 1):
                    break
                n_rsrv += req.max_tokens
            batch.append(req)
        return batch, n_rsrv
    return select


def forever(*args):
    while True:
        pass


def raises(*args):
    raise ValueError("mine")


def on_the_package(pool, n_rsrv, max_bs, n_slots):
    """A wrapper: the package's scheduler does the choosing."""
    sched = OrcaScheduler(KVSlotManager(n_slots), max_bs)
    sched.select()
    return [], n_rsrv


SELECTS = {
    "skips": (skipping_select, "breaks \\(does not skip\\)"),
    "reserves INCREMENT": (select_with(reserve_increments=True), "reserved again for a request in INCREMENT"),
    "newest first": (select_with(newest_first=True), "newest first"),
    ">= on the slot check": (select_with(ge=True), "fits exactly"),
    "max_bs off by one": (select_with(max_bs_extra=1), "more than max_bs"),
    "one short of max_bs": (select_with(max_bs_extra=-1), "one request short of max_bs"),
    "empty batch": (lambda pool, n, max_bs, n_slots: ([], n), "an empty batch with requests waiting and nothing in flight"),
    "returns None": (lambda pool, n, max_bs, n_slots: None, "return \\(batch, n_rsrv\\)"),
}


@pytest.mark.parametrize("wrong", SELECTS)
def test_select_grader_names_the_symptom(wrong):
    fn, hint = SELECTS[wrong]
    with pytest.raises(grade.Mismatch, match=hint) as e:
        grade.check_select(fn)
    assert "expected (the package's)" in str(e.value) and "got (yours)" in str(e.value) and "Select call" in str(e.value)


def test_a_learner_exception_is_theirs_with_its_case():
    with pytest.raises(ValueError, match="mine") as e:
        grade.check_select(raises)
    assert any("raised by your raises on case 0" in note for note in e.value.__notes__)


def test_a_select_that_never_returns_is_stopped():
    t = time.monotonic()
    with pytest.raises(bounded.TooSlow, match="did not return within .* on case 0"):
        grade.check_select(forever)
    assert time.monotonic() - t < 3 * bounded.TIMEOUT_S        # bounded; never a verdict on speed


def test_the_by_hand_select_is_checked_against_the_package():
    grade.check_first_select(["W"], 12, ["X", "Y"], 35)
    with pytest.raises(grade.Mismatch, match="(?s)the second batch .* expected .*\\['X', 'Y'\\], 35"):
        grade.check_first_select(["W"], 12, ["X", "Y", "Z"], 43)     # what a skipping select answers


# -- 05: the slot manager --------------------------------------------------------------------------
SlotManager = solution("05", "SlotManager")


class Keeps(SlotManager):
    """The course's solution but for one mistake, chosen by ``mistake``."""
    mistake = ""

    def reserve(self, req, n):
        super().reserve(req, n)
        self.n_reserved -= n * (self.mistake == "not raised")

    def release(self, req):
        slots = req.slots
        if self.mistake == "twice":              # keeps its own record: a second release finds none
            slots = self.held.pop(req.rid, [])
        if self.mistake != "not freed":
            self.free = sorted(self.free + slots)
        self.n_reserved -= len(slots) * (self.mistake != "not lowered")
        req.slots = slots if self.mistake == "slots set" else None


class Twice(Keeps):
    """Keeps each request's slots by rid: a second release finds none and passes silently."""
    mistake = "twice"

    def __init__(self, n_slots):
        super().__init__(n_slots)
        self.held = {}

    def reserve(self, req, n):
        super().reserve(req, n)
        self.held[req.rid] = req.slots


def keeps(mistake):
    return type(f"Keeps_{mistake.replace(' ', '_')}", (Keeps,), {"mistake": mistake})


class Wraps:
    """A thin wrapper of the package's manager."""

    def __init__(self, n_slots):
        self.kv = KVSlotManager(n_slots)

    def __getattr__(self, name):
        return getattr(self.kv, name)


SLOT_MANAGERS = {
    "lowest first": (LowestFirst, "one contiguous run"),
    "n_reserved not lowered": (keeps("not lowered"), "n_reserved not lowered"),
    "n_reserved not raised": (keeps("not raised"), "n_reserved not raised"),
    "slots not freed": (keeps("not freed"), "slots not freed"),
    "req.slots left set": (keeps("slots set"), "req.slots left set after release"),
    "second release accepted": (Twice, "a second release of the same request accepted"),
}


@pytest.mark.parametrize("wrong", SLOT_MANAGERS)
def test_slot_grader_names_the_symptom(wrong):
    cls, hint = SLOT_MANAGERS[wrong]
    with pytest.raises(grade.Mismatch, match=hint):
        grade.check_slot_manager(cls)


# -- the other graders -----------------------------------------------------------------------------
def seconds_median(records):
    return statistics.median((r.t_finish - r.arrival) / r.n_generated for r in records)


def earliest_victim(running, req, chosen):
    for r in running:
        if r.rid != req.rid and r.slots is not None and r.state is RequestState.INCREMENT and r.rid not in chosen:
            return r
    return None


OTHERS = {
    "attention returns None": (grade.check_cached_attention, lambda *a: None, "return \\(out, k_cache, v_cache\\)"),
    "the longest generation only": (grade.check_ft_iterations, lambda p, g: max(g), "shortest prompt's length"),
    "one finish per batch": (grade.check_ft_finish, lambda p, g, bs: [max(g)], "one per request"),
    "stages as a dict": (grade.check_split_layers, lambda n, s: {0: n}, "a list of \\(first, end\\) pairs"),
    "median in seconds": (grade.check_median_norm_latency, seconds_median, "in milliseconds"),
    "mean, not median": (grade.check_median_norm_latency,
                         lambda recs: statistics.mean((r.t_finish - r.arrival) / r.n_generated * 1e3 for r in recs),
                         "not the mean"),
    "the earliest victim": (grade.check_victim, earliest_victim, "never one that arrived before req"),
    "block slots from the table's order": (grade.check_block_slots, lambda t, n, bs: list(range(n)),
                                           "block table\\[t // block_size\\]"),
}


@pytest.mark.parametrize("wrong", OTHERS)
def test_every_grader_names_the_symptom(wrong):
    check, fn, hint = OTHERS[wrong]
    with pytest.raises(AssertionError, match=hint):
        check(fn)


# -- the package's own code refused ----------------------------------------------------------------
class Sub(KVSlotManager):
    pass


PACKAGE = {
    "KVSlotManager itself": (grade.check_slot_manager, KVSlotManager),
    "a subclass of KVSlotManager": (grade.check_slot_manager, Sub),
    "a wrapper of KVSlotManager": (grade.check_slot_manager, Wraps),
    "split_layers itself": (grade.check_split_layers, split_layers),
    "a wrapper of split_layers": (grade.check_split_layers, lambda n, s: split_layers(n, s)),
    "the grader's ft reference": (grade.check_ft_finish, _references.ft_finish_iterations),
    "a wrapper of the ft reference": (grade.check_ft_finish, lambda p, g, bs: _references.ft_finish_iterations(p, g, bs)),
    "ft_iterations on the baseline's scheduler": (
        grade.check_ft_iterations, lambda p, g: max(_references.ft_finish_iterations(p, g, len(p)))),
    "a wrapper of chain_hashes": (grade.check_block_hashes, lambda t, bs: chain_hashes(t, bs, len(t) // bs)),
    "OrcaScheduler.select": (grade.check_select, OrcaScheduler.select),
    "a select on OrcaScheduler": (grade.check_select, on_the_package),
    "the package's online softmax step": (grade.check_online_softmax, update),
}


@pytest.mark.parametrize("name", PACKAGE)
def test_the_package_code_is_refused(name):
    check, fn = PACKAGE[name]
    with pytest.raises(bounded.PackageCode, match="the package's own"):
        check(fn)


def test_graders_do_not_export_their_references():
    assert not hasattr(grade, "ft_finish_iterations")
    assert all(name.startswith("check_") or name == "Mismatch" for name in grade.__all__)
    for name in grade.__all__:        # none is the package's answer to an exercise under another name
        assert getattr(grade, name).__module__ == grade.__name__


# -- the course's solutions pass -------------------------------------------------------------------
SOLVED = {
    "select": (grade.check_select, "03", "select", {}),
    "slot_manager": (grade.check_slot_manager, "05", "SlotManager", {}),
    "ft_iterations": (grade.check_ft_iterations, "02", "ft_iterations", {}),
    "ft_finish_iterations": (grade.check_ft_finish, "02", "ft_finish_iterations", {}),
    "stages": (grade.check_split_layers, "07", "stages", {}),
    "median": (grade.check_median_norm_latency, "09", "norm_latency_median_ms", {}),
    "block_slots": (grade.check_block_slots, "11", "block_slots", {}),
    "victim": (grade.check_victim, "11", "victim", {}),
    "block_hashes": (grade.check_block_hashes, "12", "block_hashes", {}),
    "cached_prefix": (grade.check_prefix_lookup, "12", "cached_prefix", {}),
    "flatten": (grade.check_flatten, "04", "flatten", {}),
    "cached_attention": (grade.check_cached_attention, "01", "cached_attention", {"attention": _attention}),
}


@pytest.mark.parametrize("name", SOLVED)
def test_the_solutions_pass(name, capsys):
    check, chapter, fn, names = SOLVED[name]
    if chapter in ("06",):
        pytest.skip("Triton")
    check(solution(chapter, fn, **names))
    assert capsys.readouterr().out.startswith("correct:")


def test_the_by_hand_block_hash_is_allowed():
    """The exercise builds on the package's block_hash: calling it is not calling the answer."""
    grade.check_block_hashes(lambda tokens, bs: [h for h in _chain(tokens, bs)])


def _chain(tokens, bs):
    names = []
    for i in range(len(tokens) // bs):
        names.append(block_hash(names[-1] if names else None, tokens[i * bs:(i + 1) * bs]))
    return names


# -- 03 and 08: Algorithm 1's loop ----------------------------------------------------------------
def loop_with(hand_back=True, turns=None, wait_again=False, submit_twice=False, zero_tokens=False, no_exit=False):
    """Algorithm 1's loop with one batch in flight (chapter 03's), with one of a learner's mistakes."""
    def loop(scheduler, executor, n_workers):
        turn = 0
        while scheduler.has_work() or no_exit:
            if turn == turns:
                return
            batch = scheduler.select(executor.clock.now())
            if batch is None:
                continue
            executor.submit(batch)
            if submit_twice:
                executor.submit(batch)
            done = executor.wait()
            if hand_back:
                tokens = [0] * len(done.tokens) if zero_tokens else done.tokens
                scheduler.on_batch_return(done.batch, tokens, executor.clock.now())
            if wait_again:
                executor.wait()
            turn += 1
    return loop


def hands_back_late(scheduler, executor, n_workers):
    """Selects the next batch before handing the returned one back."""
    batch = scheduler.select(0.0)
    while batch is not None:
        executor.submit(batch)
        done = executor.wait()
        batch = scheduler.select(executor.clock.now())
        scheduler.on_batch_return(done.batch, done.tokens, executor.clock.now())


def in_flight_with(limit=lambda n: n, stop_on_none=False):
    """Chapter 08's loop, ``limit(n_workers)`` batches in flight, or returning when select finds none."""
    def loop(scheduler, executor, n_workers):
        n_scheduled = 0
        while scheduler.has_work():
            batch = scheduler.select(executor.clock.now()) if n_scheduled < limit(n_workers) else None
            if batch is None and stop_on_none:
                return
            if batch is not None:
                executor.submit(batch)
                n_scheduled += 1
            if n_scheduled and (n_scheduled == limit(n_workers) or batch is None):
                done = executor.wait()
                n_scheduled -= 1
                scheduler.on_batch_return(done.batch, done.tokens, executor.clock.now())
    return loop


def catches_the_refusal(scheduler, executor, n_workers):
    try:
        executor.wait()
    except AssertionError:
        pass
    solution("03", "loop")(scheduler, executor, n_workers)


def engine_loop(scheduler, executor, n_workers):
    Engine(scheduler, executor, vocab_size=257, max_seq_len=1024).run()


def engine_steps(scheduler, executor, n_workers):
    engine = Engine(scheduler, executor, vocab_size=257, max_seq_len=1024)
    while engine.has_work():
        engine.step()


LOOPS = {
    "never returns": (grade_engine.check_loop, forever, "(?s)did not return within.*hint: your loop never asked"),
    "returns with work left": (grade_engine.check_loop, loop_with(turns=1), "returned with work left"),
    "never hands tokens back": (grade_engine.check_loop, loop_with(hand_back=False),
                                "on_batch_return\\(done.batch, done.tokens, now\\) after its wait"),
    "hands back after the next select": (grade_engine.check_loop, hands_back_late, "before the next select"),
    "waits with nothing in flight": (grade_engine.check_loop, loop_with(wait_again=True), "with no batch in flight"),
    "submits twice without waiting": (grade_engine.check_loop, loop_with(submit_twice=True),
                                      "more than n_workers=\\d batches in flight"),
    "hands back other tokens": (grade_engine.check_loop, loop_with(zero_tokens=True), "the tokens the batch returned"),
    "goes on after the work is done": (grade_engine.check_loop, loop_with(no_exit=True), "every request has finished"),
    "catches the refusal": (grade_engine.check_loop, catches_the_refusal, "with no batch in flight"),
    "one in flight with n_workers > 1": (grade_engine.check_in_flight, solution("03", "loop"),
                                         "n_workers=2: the pipeline bubble"),
    "more than n_workers": (grade_engine.check_in_flight, in_flight_with(limit=lambda n: n + 1),
                            "more than n_workers=\\d batches in flight"),
    "at most two in flight": (grade_engine.check_in_flight, in_flight_with(limit=lambda n: min(n, 2)),
                              "fewer batches in flight than the package's"),
    "returns when select finds none": (grade_engine.check_in_flight, in_flight_with(stop_on_none=True),
                                       "returned with work left"),
}


@pytest.mark.parametrize("wrong", LOOPS)
def test_the_loop_graders_name_the_symptom(wrong, monkeypatch):
    check, loop, hint = LOOPS[wrong]
    monkeypatch.setattr(grade_engine, "LOOP_S", 2.0)
    t = time.monotonic()
    with pytest.raises(AssertionError, match=hint) as e:
        check(loop)
    assert "expected (the package's)" in str(e.value) or "did not return" in str(e.value)
    assert time.monotonic() - t < 90        # bounded whatever the loop does; never a verdict on speed


def test_a_loop_exception_is_the_learners_with_its_case():
    with pytest.raises(ValueError, match="mine") as e:
        grade_engine.check_loop(raises)
    assert any("raised by your raises on case 0" in note for note in e.value.__notes__)


@pytest.mark.parametrize("check", [grade_engine.check_loop, grade_engine.check_in_flight])
@pytest.mark.parametrize("loop", [Engine.run, engine_loop, engine_steps],
                         ids=["Engine.run", "a wrapper", "Engine.step"])
def test_the_packages_loop_is_refused(check, loop):
    with pytest.raises(bounded.PackageCode, match="the package's own"):
        check(loop)


@pytest.mark.parametrize("check, chapter", [(grade_engine.check_loop, "03"), (grade_engine.check_loop, "08"),
                                            (grade_engine.check_in_flight, "08")])
def test_the_loop_solutions_pass(check, chapter, capsys):
    check(solution(chapter, "loop"))
    assert capsys.readouterr().out.startswith("correct:")
