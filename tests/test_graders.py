"""Each grader against a table of wrong answers a learner writes: each is caught with the hint its
symptom calls for, a loop that never ends included (bounded in time: the grader returns); the
package's own answers, and thin wrappers of them, are refused; the course's solutions pass."""
import ctypes
import inspect
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from orca_lab import LLM, EngineConfig, SamplingParams
from orca_lab.config import model_config
from orca_lab.course import bounded, forked, harness, plug, solve
from orca_lab.course import ch01_generation_and_kv_cache as ch01
from orca_lab.course import ch02_request_level_batching as ch02
from orca_lab.course import ch03_iteration_level_scheduling as ch03
from orca_lab.course import ch04_selective_batching as ch04
from orca_lab.course import ch05_kv_slot_manager as ch05
from orca_lab.course import ch06_triton_kernels as ch06
from orca_lab.course import ch07_distributed_workers as ch07
from orca_lab.course import ch08_pipelined_schedules as ch08
from orca_lab.course import ch09_end_to_end as ch09
from orca_lab.course import ch11_after_orca as ch11
from orca_lab.course import ch12_prefix_caching as ch12
from orca_lab.engine import policies
from orca_lab.engine.engine import Engine
from orca_lab.engine.executor import split_layers
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.policies import new_kv, new_scheduler
from orca_lab.engine.prefix_cache import BlockRefs, FreeCached, block_hash, chain_hashes
from orca_lab.engine.request import RequestState
from orca_lab.engine.scheduler import OrcaScheduler
from orca_lab.model.tensor_parallel import even_range
from orca_lab.sim.cost import AnalyticalCost
from orca_lab.sim.executor import SimExecutor

from tests.test_course import LowestFirst, skipping_select


@pytest.fixture(autouse=True)
def short_bounds(monkeypatch):
    """The graders' time bounds at a few seconds here: a right answer's case takes milliseconds, and
    the tests of code that never returns then wait 3 s, not the 10-20 s a learner is given."""
    monkeypatch.setattr(bounded, "TIMEOUT_S", 3.0)
    monkeypatch.setattr(harness, "CASE_S", 3.0)


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
    with pytest.raises(harness.Mismatch, match=hint) as e:
        ch03.check_select(fn)
    assert "expected (the package's)" in str(e.value) and "got (yours)" in str(e.value) and "Select call" in str(e.value)


def test_a_learner_exception_is_theirs_with_its_case():
    with pytest.raises(ValueError, match="mine") as e:
        ch03.check_select(raises)
    assert any("raised by your raises on case 0" in note for note in e.value.__notes__)


def test_a_select_that_never_returns_is_stopped():
    t = time.monotonic()
    with pytest.raises(bounded.TooSlow, match="did not return within .* on case 0"):
        ch03.check_select(forever)
    assert time.monotonic() - t < 3 * bounded.TIMEOUT_S        # bounded; never a verdict on speed


def _allocates(pool, n_rsrv, max_bs, n_slots):
    held = []
    while True:
        held.append(bytearray(1 << 28))


class Mine(Exception):
    """An exception type of the learner's own."""


@pytest.mark.parametrize("select, error, match", [
    (lambda *a: os._exit(3), forked.Ended, r"ended before its verdict: it exited with code 3 \(os._exit"),
    (lambda *a: ctypes.string_at(0), forked.Ended, "killed by SIGSEGV \\(a crash in C"),
    (_allocates, MemoryError, None),
    (lambda *a: sum(range(10 ** 15)), harness.Stuck, "ran past 4 s and was killed: your code is stuck"),
    (lambda *a: (_ for _ in ()).throw(Mine("of my own")), forked.Raised, "Mine: of my own"),
], ids=["os._exit", "segfault", "memory", "C loop holding the interpreter", "its own exception type"])
def test_a_grader_runs_apart_and_names_how_its_process_ended(select, error, match, monkeypatch):
    """A check cell grades in a fork of its kernel: an exit, a crash in C, memory without end or a C
    call no thread's bound can stop ends the fork, never the caller, which names how it ended."""
    monkeypatch.setattr(forked, "BOUND_S", 4.0)
    monkeypatch.setattr(forked, "MEMORY", 1 << 30)
    before = os.getpid()
    t = time.monotonic()
    with pytest.raises(error, match=match) as e:
        ch03.check_select(select)
    assert os.getpid() == before and time.monotonic() - t < 30
    if error is MemoryError:
        assert any("may allocate 1 GiB" in note for note in e.value.__notes__)
    if error is forked.Raised:
        assert any("raised by your <lambda> on case 0" in n for n in e.value.__notes__)
        assert any(n.startswith("in the grader's process:") for n in e.value.__notes__)


def test_a_process_the_learner_starts_neither_holds_the_verdict_nor_outlives_it(tmp_path):
    """A process started by the learner's code keeps the verdict's pipe open after the grader's ends:
    the verdict still comes at once, and that process goes with the grader's (its process group)."""
    pid_file = tmp_path / "pid"

    def select(pool, n_rsrv, max_bs, n_slots):
        if not pid_file.exists():
            pid = os.fork()
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            pid_file.write_text(str(pid))
        return [], 0
    t = time.monotonic()
    with pytest.raises(harness.Mismatch):
        ch03.check_select(select)
    assert time.monotonic() - t < 10
    stat = Path(f"/proc/{pid_file.read_text()}/stat")
    gone = lambda: not stat.exists() or stat.read_text().split(") ")[1].startswith("Z")   # noqa: E731  (or init's zombie)
    deadline = time.monotonic() + 5                 # SIGKILL lands in a moment, not at once
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()


def test_ctrl_c_in_the_kernel_while_it_waits_stops_the_grader_too(tmp_path):
    pid_file = tmp_path / "pid"

    def select(pool, n_rsrv, max_bs, n_slots):
        pid_file.write_text(str(os.getpid()))
        time.sleep(30)

    def interrupt(sig, frame):
        raise KeyboardInterrupt
    before = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            ch03.check_select(select)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    pid = int(pid_file.read_text())
    assert pid != os.getpid() and not Path(f"/proc/{pid}").exists()      # killed and reaped


def test_a_signal_to_its_process_group_reaches_the_grader_not_its_caller():
    with pytest.raises(forked.Ended, match="killed by SIGTERM"):
        ch03.check_select(lambda *a: os.killpg(os.getpgrp(), signal.SIGTERM))


def test_a_caller_that_ignores_sigchld_still_gets_the_verdict():
    before = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        with pytest.raises(harness.Mismatch):
            ch03.check_select(lambda *a: ([], 0))
        with pytest.raises(forked.Ended, match="how is lost: this process ignores SIGCHLD"):
            ch03.check_select(lambda *a: os._exit(3))
    finally:
        signal.signal(signal.SIGCHLD, before)


def test_what_a_grader_prints_comes_back_cut(capsys):
    def chatty(pool, n_rsrv, max_bs, n_slots):
        print("x" * (forked.MAX_PRINTED + 5000))
        return [], 0
    with pytest.raises(harness.Mismatch):
        ch03.check_select(chatty)
    out = capsys.readouterr().out
    assert out.count("x") == forked.MAX_PRINTED and "and 5,001 characters more, not shown" in out


class Forever:
    """A learner's answer whose own code never returns once the grader reads it."""

    def __int__(self):
        while True:
            pass

    __iter__ = __int__


class EqualsAny(torch.Tensor):
    """A tensor whose every torch function (torch.equal, allclose) answers True."""
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return True


class AnyInt(int):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = int.__hash__


class LyingRid:
    def __init__(self, rid):
        self.rid = rid

    def __eq__(self, other):          # says it is any request: the grader must not ask it
        return True

    __hash__ = object.__hash__


@pytest.mark.parametrize("answer, error, match", [
    (lambda pool, n: ([], Forever()), harness.Mismatch, "a list of requests and an int"),   # no int: never read
    (lambda pool, n: (Forever(), n), harness.Stuck, "did not return within"),        # its __iter__
    (lambda pool, n: ([LyingRid(r.rid) for r in pool], n), harness.Mismatch, "None"),  # not the pool's requests
    (lambda pool, n: sys.exit(3), bounded.Exited, r"select raised SystemExit\(3\) on case 0"),
    (lambda pool, n: (_ for _ in ()).throw(KeyboardInterrupt), bounded.Exited, "raised KeyboardInterrupt"),
], ids=["int loops", "iter loops", "lying requests", "sys.exit", "KeyboardInterrupt"])
def test_reading_a_select_answer_is_bounded_and_its_exits_named(answer, error, match):
    """What the learner returns runs code of its own when the grader reads it; and an exit or an
    interrupt of theirs is named as theirs, never taken for the notebook's own."""
    def select(pool, n_rsrv, max_bs, n_slots):
        return answer(pool, n_rsrv)
    t = time.monotonic()
    with pytest.raises(error, match=match):
        ch03.check_select(select)
    assert time.monotonic() - t < 3 * harness.CASE_S


def test_the_by_hand_select_is_checked_against_the_package():
    ch03.check_first_select(["W"], 12, ["X", "Y"], 35)
    for wrong in ((["W"], 12, ["X", "Y", "Z"], 43), (["W"], 12, ["X", "Y"], 47), (["W", "X"], 42, ["Y", "Z"], 13)):
        with pytest.raises(harness.Mismatch, match="(?s)differs.*got \\(yours\\).*hint") as e:
            ch03.check_first_select(*wrong)                          # the first: what a skipping select answers
        assert "expected" not in str(e.value) and "35" not in str(e.value) and "['X', 'Y']" not in str(e.value)


BY_HAND = {  # notebook by-hand exercises: (checker, its arguments around the answers, the right answers)
    "01": (ch01.check_rows, lambda a: (*a, LLM("tiny", engine=EngineConfig(max_bs=4, n_slots=1024)), [7] * 6, 5),
           (40, 10)),
    "04": (ch04.check_offsets, lambda a: ([4, 1, 1, 6], [0, 9, 3, 0], *a), ([0, 4, 5, 6, 12], [0, 4, 14, 18, 24], 24)),
    "11": (ch11.check_slots_held, tuple, (260, 96)),
    "12": (ch12.check_hit_tokens, tuple, (24, 13))}


@pytest.mark.parametrize("chapter", BY_HAND)
def test_a_by_hand_answer_is_checked_against_the_package_and_never_shown(chapter, capsys):
    check, args, right = BY_HAND[chapter]
    check(*args(right))
    assert "correct" in capsys.readouterr().out
    for i, answer in enumerate(right):      # each answer wrong alone: named, with its hint, not the answer
        wrong = list(right)
        wrong[i] = answer + [1] if isinstance(answer, list) else answer + 1
        with pytest.raises(harness.Mismatch, match="(?s)differs.*got \\(yours\\).*hint") as e:
            check(*args(wrong))
        assert str(answer) not in str(e.value).replace(str(wrong[i]), "")


class Spy:
    """An answer that says it equals anything, and keeps what it was compared with to show it."""
    seen = []

    def __eq__(self, other):
        Spy.seen.append(other)
        return True

    __ne__ = lambda self, other: not self.__eq__(other)          # noqa: E731
    __repr__ = lambda self: f"<compared with {Spy.seen}>"       # noqa: E731


@pytest.mark.parametrize("chapter", ["04", "11", "12"])
def test_a_by_hand_answer_that_equals_anything_is_refused_without_seeing_the_answer(chapter):
    check, args, right = BY_HAND[chapter]
    with pytest.raises(harness.Mismatch, match="not a plain value") as e:
        check(*args((Spy(), *right[1:])))
    assert Spy.seen == [] and str(right[0]) not in str(e.value)
    check(*args((*map(np.array, right[:1]), *right[1:])))     # a numpy array (or int) of the answer is the answer

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
    with pytest.raises(harness.Mismatch, match=hint):
        ch05.check_slot_manager(cls)


@pytest.mark.parametrize("does, error, match", [
    ("loops", bounded.TooSlow, "your property n_reserved did not return within"),
    ("exits", bounded.Exited, r"your property n_reserved raised SystemExit\(3\)"),
])
def test_a_slot_managers_property_is_its_code_bounded_and_named(does, error, match):
    """``n_reserved`` as a property: reading it runs the learner's code, under the bound as a call."""
    class Property(SlotManager):
        """The solution, its count kept apart (``_n``) and shown through a property of its own."""
        def can_reserve(self, n):
            return self._n + n <= self.n_slots

        @property
        def n_reserved(self):
            if does == "loops":
                while True:
                    pass
            sys.exit(3)

        @n_reserved.setter
        def n_reserved(self, value):
            self._n = value

        def reserve(self, req, n):
            self._n, slots = self._n + n, self.free
            req.slots, self.free = slots[:n], slots[n:]

        def release(self, req):
            self._n -= len(req.slots)
            self.free, req.slots = sorted(self.free + req.slots), None
    with pytest.raises(error, match=match):
        ch05.check_slot_manager(Property)


# -- the other graders -----------------------------------------------------------------------------
def seconds_median(records):
    return statistics.median((r.t_finish - r.arrival) / r.n_generated for r in records)


def earliest_victim(running, req, chosen):
    for r in running:
        if r.rid != req.rid and r.slots is not None and r.state is RequestState.INCREMENT and r.rid not in chosen:
            return r
    return None


def _in_float64(q, k_cache, v_cache, k_new, v_new):
    k, v = torch.cat([k_cache, k_new]), torch.cat([v_cache, v_new])
    return _attention(q, k, v).double(), k, v


def _split_in_float64(*args):
    w, b = solution("07", "split_linear")(*args)
    return w.double(), b


OTHERS = {
    "attention returns None": (ch01.check_cached_attention, lambda *a: None, "return \\(out, k_cache, v_cache\\)"),
    "attention in float64": (ch01.check_cached_attention, _in_float64, "the output's dtype differs(?s:.*)float64"),
    "a split in float64": (lambda fn: ch07.check_split_linear(fn, solution("07", "all_reduce")), _split_in_float64,
                           "rank 0's weight's dtype differs"),
    "block names that equal any": (ch12.check_block_hashes, lambda tokens, bs: [LyingRid(0)] * (len(tokens) // bs),
                                   "a list of block names \\(bytes"),
    "the longest generation only": (ch02.check_ft_iterations, lambda p, g: max(g), "shortest prompt's length"),
    "one finish per batch": (ch02.check_ft_finish, lambda p, g, bs: [max(g)], "one per request"),
    "stages as a dict": (ch07.check_split_layers, lambda n, s: {0: n}, "a list of \\(first, end\\) pairs"),
    "median in seconds": (ch09.check_median_norm_latency, seconds_median, "in milliseconds"),
    "a NaN median": (ch09.check_median_norm_latency, lambda recs: float("nan"), "got \\(yours\\): *nan"),
    "the median as text": (ch09.check_median_norm_latency,
                           lambda recs: str(solution("09", "norm_latency_median_ms")(recs)), "a number of milliseconds"),
    "iterations as a float": (ch02.check_ft_iterations, lambda p, g: solution("02", "ft_iterations")(p, g) + 0.9,
                              "a number of iterations"),
    "n_rsrv as a float": (ch03.check_select, lambda pool, n, max_bs, n_slots: (
        lambda batch, m: (batch, m + 0.5))(*solution("03", "select")(pool, n, max_bs, n_slots)),
        "a list of requests and an int"),
    "block ids as floats": (ch11.check_block_allocator, type("Halves", (solution("11", "BlockAllocator"),), {
        "take": lambda self, n: [b + 0.5 for b in super(type(self), self).take(n)]}), "no list of block ids"),
    "an output tensor that equals any": (ch01.check_cached_attention, lambda q, kc, vc, kn, vn: (
        torch.zeros_like(q).as_subclass(EqualsAny), torch.cat([kc, kn]), torch.cat([vc, vn])), "the output differs"),
    "n_reserved that equals any": (ch05.check_slot_manager, type("Claims", (SlotManager,), {
        "n_reserved": property(lambda self: AnyInt(0), lambda self, v: None)}), "n_reserved not raised"),
    "an eviction that equals any": (ch12.check_block_lru, type("Evicts", (solution("12", "BlockLRU"),), {
        "evict": lambda self: super(type(self), self).evict() and LyingRid(0)}), "got \\(yours\\): *<a LyingRid>"),
    "a budget's count of 2.0 tokens": (ch11.check_fill_budget, lambda d, p, b, m, run: solution("11", "fill_budget")(
        d, p, b, m, lambda req, n: run(req, float(n))), "n counts tokens, an int"),
    "mean, not median": (ch09.check_median_norm_latency,
                         lambda recs: statistics.mean((r.t_finish - r.arrival) / r.n_generated * 1e3 for r in recs),
                         "not the mean"),
    "the earliest victim": (ch11.check_victim, earliest_victim, "never one that arrived before req"),
    "block slots from the table's order": (ch11.check_block_slots, lambda t, n, bs: list(range(n)),
                                           "the table's entry for the block_size-long stretch"),
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
    "KVSlotManager itself": (ch05.check_slot_manager, KVSlotManager),
    "a subclass of KVSlotManager": (ch05.check_slot_manager, Sub),
    "a wrapper of KVSlotManager": (ch05.check_slot_manager, Wraps),
    "split_layers itself": (ch07.check_split_layers, split_layers),
    "a wrapper of split_layers": (ch07.check_split_layers, lambda n, s: split_layers(n, s)),
    "the grader's ft reference": (ch02.check_ft_finish, ch02._ft_finish_iterations),
    "a wrapper of the ft reference": (ch02.check_ft_finish, lambda p, g, bs: ch02._ft_finish_iterations(p, g, bs)),
    "ft_iterations on the baseline's scheduler": (
        ch02.check_ft_iterations, lambda p, g: max(ch02._ft_finish_iterations(p, g, len(p)))),
    "a wrapper of chain_hashes": (ch12.check_block_hashes, lambda t, bs: chain_hashes(t, bs, len(t) // bs)),
    "OrcaScheduler.select": (ch03.check_select, OrcaScheduler.select),
    "a select on OrcaScheduler": (ch03.check_select, on_the_package),
    "the package's online softmax step": (ch06.check_online_softmax, ch06._update),
}


@pytest.mark.parametrize("name", PACKAGE)
def test_the_package_code_is_refused(name):
    check, fn = PACKAGE[name]
    with pytest.raises(bounded.PackageCode, match="the package's own"):
        check(fn)


def test_graders_do_not_export_their_references():
    """No chapter module holds a public name a learner would call for an exercise's answer: the
    graders' own answers are private (and refused, as the package's are)."""
    exercises = {ex for path in solve.SOLUTIONS.glob("*.py") for ex in solve.solutions(path)} | set(plug.PIECES)
    exercises |= {"ft_finish_iterations", "ft_iterations"}          # the grader's own answer, private
    for module in plug.chapter_modules():
        own = {n for n, v in vars(module).items()          # the package's own classes keep their names
               if not n.startswith("_") and getattr(v, "__module__", "orca_lab.course").startswith("orca_lab.course")}
        assert not own & exercises, module.__name__


# -- the course's solutions pass -------------------------------------------------------------------
SOLVED = {
    "select": (ch03.check_select, "03", "select", {}),
    "slot_manager": (ch05.check_slot_manager, "05", "SlotManager", {}),
    "ft_iterations": (ch02.check_ft_iterations, "02", "ft_iterations", {}),
    "ft_finish_iterations": (ch02.check_ft_finish, "02", "ft_finish_iterations", {}),
    "stages": (ch07.check_split_layers, "07", "stages", {}),
    "median": (ch09.check_median_norm_latency, "09", "norm_latency_median_ms", {}),
    "block_slots": (ch11.check_block_slots, "11", "block_slots", {}),
    "victim": (ch11.check_victim, "11", "victim", {}),
    "block_hashes": (ch12.check_block_hashes, "12", "block_hashes", {}),
    "cached_prefix": (ch12.check_prefix_lookup, "12", "cached_prefix", {}),
    "flatten": (ch04.check_flatten, "04", "flatten", {}),
    "cached_attention": (ch01.check_cached_attention, "01", "cached_attention", {"attention": _attention}),
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
    ch12.check_block_hashes(lambda tokens, bs: [h for h in _chain(tokens, bs)])


def _chain(tokens, bs):
    names = []
    for i in range(len(tokens) // bs):
        names.append(block_hash(names[-1] if names else None, tokens[i * bs:(i + 1) * bs]))
    return names


# -- 12: the prefix cache's reference counts (ch12.check_block_refs) -------------------------
class Refs:
    """A learner's BlockRefs, right; each wrong one below changes one thing."""

    def __init__(self, lru):
        self.lru, self.n = lru, {}

    def count(self, block):
        return self.n.get(block, 0)

    def hold(self, block):
        if self.n.get(block) == 0:
            self.lru.used(block)
        self.n[block] = self.count(block) + 1

    def order(self, blocks):
        return reversed(blocks)

    def release(self, blocks, cached):
        freed = []
        for b in self.order(blocks):
            self.n[b] -= 1
            if self.n[b] and not self.frees_held():
                continue
            freed.append(b)
            if b in cached:
                self.lru.freed(b)
            elif self.forgets():
                del self.n[b]
        return freed

    def frees_held(self):
        return False

    def forgets(self):
        return True

    def evict(self):
        b = self.lru.evict()
        del self.n[b]
        return b


class HoldSetsOne(Refs):
    def hold(self, block):
        if self.n.get(block) == 0:
            self.lru.used(block)
        self.n[block] = 1


class HeldStaysInTheLRU(Refs):
    def hold(self, block):
        self.n[block] = self.count(block) + 1


class FreesWhileHeld(Refs):
    def frees_held(self):
        return True


class FirstToLast(Refs):
    def order(self, blocks):
        return blocks


class ReleasesTwice(Refs):
    def release(self, blocks, cached):
        for b in blocks:
            self.n[b] -= 1
        return super().release(blocks, cached)


class UncachedKeepsItsCount(Refs):
    def forgets(self):
        return False


class EvictedKeepsItsCount(Refs):
    def evict(self):
        return self.lru.evict()


class UncachedIntoTheLRU(Refs):
    def release(self, blocks, cached):
        return super().release(blocks, set(blocks))


class ReturnsNothing(Refs):
    def release(self, blocks, cached):
        super().release(blocks, cached)


class HoldsForever(Refs):
    def hold(self, block):
        while True:
            pass


WRONG_REFS = {
    "hold sets the count to 1": (HoldSetsOne, "hold\\(b\\) adds one to b's count"),
    "a held block stays in the LRU": (HeldStaysInTheLRU, "a held block left in the LRU"),
    "freed while another request holds it": (FreesWhileHeld, "freed while another request still holds it"),
    "freed first to last": (FirstToLast, "from its last to its first"),
    "a release counted twice": (ReleasesTwice, "a count went below 0"),
    "an uncached block keeps its count": (UncachedKeepsItsCount, "comes from the pool .* has no count"),
    "an evicted block keeps its count": (EvictedKeepsItsCount, "comes from the pool .* has no count"),
    "an uncached block into the LRU": (UncachedIntoTheLRU, "only a cached block \\(b in cached\\) waits in the LRU"),
    "release returns nothing": (ReturnsNothing, "release returns the blocks whose count reached 0"),
    "a hold that never returns": (HoldsForever, "did not return within"),
}


@pytest.mark.parametrize("wrong", WRONG_REFS)
def test_the_refs_grader_names_the_symptom(wrong):
    cls, hint = WRONG_REFS[wrong]
    start = time.monotonic()
    with pytest.raises(AssertionError, match=hint):
        ch12.check_block_refs(cls)
    assert time.monotonic() - start < 2 * harness.CASE_S + 30       # bounded, on a loaded machine


class PackageRefs(BlockRefs):
    pass


class WrapsPackageRefs:
    def __init__(self, lru):
        self.refs = BlockRefs(lru)

    def __getattr__(self, name):
        return getattr(self.refs, name)


class PackageLRU(FreeCached):
    pass


class WrapsPackageLRU:
    def __init__(self):
        self.lru = FreeCached()

    def __getattr__(self, name):
        return getattr(self.lru, name)


@pytest.mark.parametrize("check, cls", [(ch12.check_block_refs, BlockRefs),
                                        (ch12.check_block_refs, PackageRefs),
                                        (ch12.check_block_refs, WrapsPackageRefs),
                                        (ch12.check_block_lru, FreeCached),
                                        (ch12.check_block_lru, PackageLRU),
                                        (ch12.check_block_lru, WrapsPackageLRU)],
                         ids=lambda x: getattr(x, "__name__", ""))
def test_the_refs_and_lru_graders_refuse_the_package_code(check, cls):
    with pytest.raises(bounded.PackageCode, match="the package's own"):
        check(cls)


def test_the_refs_grader_passes_a_right_one_and_the_solution(capsys):
    ch12.check_block_refs(Refs)
    ch12.check_block_refs(solution("12", "BlockRefs"))
    assert capsys.readouterr().out.count("correct:") == 2


def test_plugged_counts_take_over_the_blocks_an_earlier_engine_left_cached():
    """An LLM keeps its cache from one engine to the next: ``use_refs`` hands the cached blocks to the
    learner's counts, oldest first, and the second run finds what the package's second run finds."""
    from orca_lab import LLM, EngineConfig
    from orca_lab.course.ch12_prefix_caching import use_refs
    from orca_lab.workload import few_shot_trace
    cfg = EngineConfig(max_bs=2, n_slots=24 * 4, block_size=4, prefix_caching=True)
    trace = few_shot_trace(4, prefix_len=16, question_len=(2, 9), gen_len=(3, 6), vocab_size=257, seed=0)
    hits, model = {}, LLM("tiny", seed=0, engine=cfg).model
    for who in ("package", "yours"):
        llm = LLM(gpt=model, engine=cfg)                        # a cache of its own
        llm.new_engine("paged").run(trace)
        engine = llm.new_engine("paged")
        cached = list(engine.scheduler.kv.lru)
        if who == "yours":
            use_refs(engine, Refs)
            kv = engine.scheduler.kv
            assert list(kv.lru) == cached and cached and not any(kv.refs.count(b) for b in cached)
        hits[who] = list(engine.run(trace).requests_df().prefix_hit_tokens)
    assert hits["yours"] == hits["package"] and sum(hits["package"]) > 0


# -- 07: a tensor-parallel split of a linear layer, and its all-reduce -------------------------------
def _split(mistake=""):
    """Chapter 07's split_linear with one of a learner's mistakes."""
    def split_linear(weight, bias, t, T, parallel):
        dim = (0 if parallel == "column" else 1) ^ (mistake == "wrong dimension")
        n = weight.shape[dim]
        size = -(-n // T) if mistake == "overlapping" else n // T
        extra = 0 if mistake in ("floor", "overlapping", "last rank the rest") else n % T
        lo = min(t * size, n - size) if mistake == "overlapping" else t * size + min(t, extra)
        hi = n if mistake == "last rank the rest" and t == T - 1 else lo + size + (t < extra)
        w = weight.narrow(dim, lo, hi - lo)
        if parallel == "row":
            return w, bias if mistake == "bias on every rank" else None
        return w, bias if mistake == "whole bias" or bias is None else bias[lo:hi]
    return split_linear


def _sum(partials):
    return torch.stack(partials).sum(0)


SPLITS = {
    "split along the wrong dimension": (_split("wrong dimension"), _sum, "split along the wrong dimension"),
    "bias on every rank before the sum": (_split("bias on every rank"), _sum, "T x bias"),
    "the whole bias on a column rank": (_split("whole bias"), _sum, "bias entries of its own outputs"),
    "n // T rows each": (_split("floor"), _sum, "missing rows when T does not divide"),
    "ceil(n / T) rows each": (_split("overlapping"), _sum, "overlapping shards"),
    "the last rank takes the rest": (_split("last rank the rest"), _sum, "uneven shards"),
    "an all-reduce that averages": (_split(), lambda ps: torch.stack(ps).mean(0), "averages instead of sums"),
    "an all-reduce that concatenates": (_split(), lambda ps: torch.cat(ps, -1), "concatenates the partials"),
    "an all-reduce of rank 0 alone": (_split(), lambda ps: ps[0], "one rank's partial"),
    "a split that returns the weight only": (lambda w, b, t, T, p: w, _sum, "return the pair"),
    "a split that never returns": (forever, _sum, "did not return within"),
}


@pytest.mark.parametrize("wrong", SPLITS)
def test_split_linear_grader_names_the_symptom(wrong):
    split_linear, all_reduce, hint = SPLITS[wrong]
    start = time.monotonic()
    with pytest.raises(AssertionError, match=hint):
        ch07.check_split_linear(split_linear, all_reduce)
    assert time.monotonic() - start < bounded.TIMEOUT_S + 10


def on_even_range(weight, bias, t, T, parallel):
    lo, hi = even_range(weight.shape[parallel == "row"], t, T)
    return (weight[:, lo:hi], None) if parallel == "row" else (weight[lo:hi], None if bias is None else bias[lo:hi])


@pytest.mark.parametrize("split_linear", [ch07._package_shard,
                                          lambda w, b, t, T, p: ch07._package_shard(w, b, t, T, p),
                                          on_even_range],
                         ids=["the grader's reference", "a wrapper of it", "a split on the package's even_range"])
def test_the_package_split_is_refused(split_linear):
    with pytest.raises(bounded.PackageCode, match="the package's own"):
        ch07.check_split_linear(split_linear, _sum)


def test_the_split_linear_solution_passes_and_gives_the_package_tokens(capsys):
    split_linear = solution("07", "split_linear")
    all_reduce = solution("07", "all_reduce")
    ch07.check_split_linear(split_linear, all_reduce)
    assert capsys.readouterr().out.startswith("correct:")
    llm = LLM("tiny", seed=0, engine=EngineConfig(max_bs=4, n_slots=512))
    prompts = [[(7 * i + j) % 256 for j in range(3 + i)] for i in range(4)]
    alone = llm.generate(prompts, max_gen_tokens=4)
    pieces = {"split_linear": split_linear, "all_reduce": all_reduce}
    assert plug.assemble(llm.new_engine(), pieces) == []           # one rank: nothing to split
    for T in (2, 4):
        engine = llm.new_engine()
        assert plug.assemble(engine, pieces, tensor_ranks=T) == ["split_linear", "all_reduce"]
        for p in prompts:
            engine.add_request(p, SamplingParams(max_gen_tokens=4))
        assert [list(r.output) for r in engine.run().requests] == alone


def test_a_rank_whose_all_reduce_raises_stops_the_engine_with_its_error():
    llm = LLM("tiny", seed=0, engine=EngineConfig(max_bs=4, n_slots=512))

    def broken(partials):
        raise ValueError("not yet")

    engine = ch07.use_split_linear(llm.new_engine(), _split(), broken, 2)
    engine.add_request([1, 2, 3], SamplingParams(max_gen_tokens=2))
    with pytest.raises(ValueError, match="not yet"):
        engine.run()


# -- 11: the chunked-prefill token budget ----------------------------------------------------------
def budget_with(prompts_first=False, decode_left=False, whole=False, skip=False, shortest_first=False, zero=False,
                one_prompt=False, count_refused=False, max_bs_extra=0, plan=False, twice=False, calls_forever=False):
    """The token budget with one of a learner's mistakes."""
    def fill_budget(decodes, prompts, budget, max_bs, run):
        decodes, prompts = list(decodes), sorted(prompts, key=lambda p: p[1]) if shortest_first else list(prompts)
        left, n_run = budget, 0
        for req, n in (prompts + decodes if prompts_first else decodes + prompts) * (2 if twice else 1):
            if n_run == max_bs + max_bs_extra or (left == 0 and not zero):
                break
            if skip and n > left:
                continue
            q = left if decode_left and (req, n) in decodes else n if whole else min(n, left)
            if plan:
                continue
            while calls_forever:
                run(req, q)
            if run(req, q) or count_refused:
                left, n_run = left - q, n_run + 1
                if one_prompt and (req, n) in prompts:
                    break
    return fill_budget


BUDGETS = {
    "a prompt fed whole": (budget_with(whole=True), "budget exceeded"),
    "a decode fed what is left": (budget_with(decode_left=True), "a decode given .* tokens"),
    "prompts before decodes": (budget_with(prompts_first=True), "decodes go first|before any prompt"),
    "a prompt that does not fit skipped": (budget_with(skip=True), "not cut to the remainder"),
    "shortest prompt first": (budget_with(shortest_first=True), "a later prompt fed before an earlier one"),
    "no stop at a spent budget": (budget_with(zero=True), "fed 0 tokens"),
    "one prompt an iteration": (budget_with(one_prompt=True), "budget left unused while prompt"),
    "a refused run counted": (budget_with(count_refused=True), "a run that returns False took nothing"),
    "max_bs off by one": (budget_with(max_bs_extra=1), "more than max_bs"),
    "one short of max_bs": (budget_with(max_bs_extra=-1), "one request short of max_bs"),
    "a plan, never run": (budget_with(plan=True), "no request ran"),
    "every request twice": (budget_with(twice=True), "run twice"),
    "run called without end": (budget_with(calls_forever=True), "run was called .* times"),
    "returns without a word": (lambda decodes, prompts, budget, max_bs, run: None, "no request ran"),
}


@pytest.mark.parametrize("wrong", BUDGETS)
def test_budget_grader_names_the_symptom(wrong):
    fn, hint = BUDGETS[wrong]
    t = time.monotonic()
    with pytest.raises(AssertionError, match=hint) as e:
        ch11.check_fill_budget(fn)
    assert time.monotonic() - t < bounded.TIMEOUT_S                   # bounded in calls, not by the clock
    if isinstance(e.value, harness.Mismatch):
        assert "expected (the package's)" in str(e.value) and "got (yours)" in str(e.value)


def test_a_budget_that_never_returns_is_stopped():
    def forever(decodes, prompts, budget, max_bs, run):
        while True:
            pass
    t = time.monotonic()
    with pytest.raises(bounded.TooSlow, match="did not return within .* on case 0"):
        ch11.check_fill_budget(forever)
    assert time.monotonic() - t < 3 * bounded.TIMEOUT_S


@pytest.mark.parametrize("fn", [policies.fill_budget, policies.ChunkedScheduler.fill_budget,
                                lambda d, p, b, m, run: policies.fill_budget(d, p, b, m, run)],
                         ids=["fill_budget itself", "the scheduler's", "a wrapper"])
def test_the_packages_budget_is_refused(fn):
    with pytest.raises(bounded.PackageCode, match="the package's own"):
        ch11.check_fill_budget(fn)


def test_the_budget_solution_passes_and_runs_the_chunked_engine(capsys):
    """The course's solution passes; plugged (``use_budget``), the chunked engine (simulated) makes the
    package's iterations, prompts in chunks; a different budget makes others, and a call the package
    never makes (a prompt fed whole past the budget) stops the engine naming it."""
    fill = solution("11", "fill_budget")
    ch11.check_fill_budget(fill)
    assert capsys.readouterr().out.startswith("correct:")

    def engine(system="chunked"):
        cfg = model_config("tiny")
        return Engine(new_scheduler(system, new_kv(system, 1024, 8), 4, cfg.max_seq_len, None, 16),
                      SimExecutor(AnalyticalCost(cfg)), cfg.vocab_size, cfg.max_seq_len)

    def iterations(budget_fn=None):
        e = engine() if budget_fn is None else ch11.use_budget(engine(), budget_fn)
        e.add_requests([([1 + i] * p, SamplingParams(max_gen_tokens=g), 0.0)
                        for i, (p, g) in enumerate([(40, 5), (3, 9), (21, 4), (9, 6), (33, 3)])])
        return [(it.rids, it.q_lens) for it in e.run().iterations]

    package = iterations()
    assert iterations(fill) == package
    assert iterations(budget_with()) == package      # reads every prompt before it runs one: the walk ends
    assert any(q < 16 and rid in (0, 2, 4) for rids, q_lens in package for rid, q in zip(rids, q_lens))
    assert iterations(budget_with(prompts_first=True)) != package
    with pytest.raises(AssertionError, match="your fill_budget called run"):
        iterations(budget_with(whole=True))
    with pytest.raises(ValueError, match="use_budget takes an engine of system 'chunked'"):
        ch11.use_budget(engine("paged"), fill)


# -- 03 and 08: Algorithm 1's loop ----------------------------------------------------------------
class OffByOne(int):
    """A token one past the real one, whose ``__int__`` and ``__eq__`` say it is the real one."""
    def __int__(self):
        return int.__index__(self) - 1

    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def loop_with(hand_back=True, turns=None, wait_again=False, submit_twice=False, zero_tokens=False, no_exit=False,
              off_by_one=False, in_place=False):
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
            if in_place:            # the completion's own list changed: it is no longer the batch's tokens
                done.tokens[:] = [None if t is None else t + 1 for t in done.tokens]
            if hand_back:
                tokens = [0] * len(done.tokens) if zero_tokens else done.tokens
                tokens = [None if t is None else OffByOne(t + 1) for t in tokens] if off_by_one else tokens
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
    "never returns": (ch03.check_loop, forever, "(?s)did not return within.*hint: your loop never asked"),
    "returns with work left": (ch03.check_loop, loop_with(turns=1), "returned with work left"),
    "never hands tokens back": (ch03.check_loop, loop_with(hand_back=False),
                                "on_batch_return\\(done.batch, done.tokens, now\\) after its wait"),
    "hands back after the next select": (ch03.check_loop, hands_back_late, "before the next select"),
    "waits with nothing in flight": (ch03.check_loop, loop_with(wait_again=True), "with no batch in flight"),
    "submits twice without waiting": (ch03.check_loop, loop_with(submit_twice=True),
                                      "more than n_workers=\\d batches in flight"),
    "hands back other tokens": (ch03.check_loop, loop_with(zero_tokens=True), "the tokens the batch returned"),
    "hands back tokens that say they are others": (ch03.check_loop, loop_with(off_by_one=True),
                                                   "the tokens the batch returned"),
    "changes the tokens in place": (ch03.check_loop, loop_with(in_place=True), "the tokens the batch returned"),
    "goes on after the work is done": (ch03.check_loop, loop_with(no_exit=True), "every request has finished"),
    "catches the refusal": (ch03.check_loop, catches_the_refusal, "with no batch in flight"),
    "one in flight with n_workers > 1": (ch08.check_in_flight, solution("03", "loop"),
                                         "n_workers=2: the pipeline bubble"),
    "more than n_workers": (ch08.check_in_flight, in_flight_with(limit=lambda n: n + 1),
                            "more than n_workers=\\d batches in flight"),
    "at most two in flight": (ch08.check_in_flight, in_flight_with(limit=lambda n: min(n, 2)),
                              "fewer batches in flight than the package's"),
    "returns when select finds none": (ch08.check_in_flight, in_flight_with(stop_on_none=True),
                                       "returned with work left"),
}


@pytest.mark.parametrize("wrong", LOOPS)
def test_the_loop_graders_name_the_symptom(wrong, monkeypatch):
    check, loop, hint = LOOPS[wrong]
    monkeypatch.setattr(ch03, "LOOP_S", 2.0)
    t = time.monotonic()
    with pytest.raises(AssertionError, match=hint) as e:
        check(loop)
    assert "expected (the package's)" in str(e.value) or "did not return" in str(e.value)
    assert time.monotonic() - t < 90        # bounded whatever the loop does; never a verdict on speed


def test_a_loop_exception_is_the_learners_with_its_case():
    with pytest.raises(ValueError, match="mine") as e:
        ch03.check_loop(raises)
    assert any("raised by your raises on case 0" in note for note in e.value.__notes__)


@pytest.mark.parametrize("check", [ch03.check_loop, ch08.check_in_flight])
@pytest.mark.parametrize("loop", [Engine.run, engine_loop, engine_steps],
                         ids=["Engine.run", "a wrapper", "Engine.step"])
def test_the_packages_loop_is_refused(check, loop):
    with pytest.raises(bounded.PackageCode, match="the package's own"):
        check(loop)


@pytest.mark.parametrize("check, chapter", [(ch03.check_loop, "03"), (ch03.check_loop, "08"),
                                            (ch08.check_in_flight, "08")])
def test_the_loop_solutions_pass(check, chapter, capsys):
    check(solution(chapter, "loop"))
    assert capsys.readouterr().out.startswith("correct:")


# -- 06: the online softmax step (ch06.check_online_softmax, in the kernel under the interpreter) ------
@triton.jit
def step_without_rescaling(m, l, acc, s, v):
    """A step that forgets what the old maximum summed: right until a later block raises m."""
    m_new = tl.maximum(m, tl.max(s, 0))
    p = tl.exp(s - m_new)
    return m_new, l + tl.sum(p, 0), acc + tl.sum(p[:, None] * v, 0)


def test_a_step_that_does_not_rescale_is_caught_with_its_hint():
    t = time.monotonic()
    with pytest.raises(harness.Mismatch, match="rescale l and acc by exp\\(m_old - m_new\\)") as e:
        ch06.check_online_softmax(step_without_rescaling)
    assert "expected (the package's)" in str(e.value) and "got (yours)" in str(e.value)
    assert time.monotonic() - t < 10 * bounded.TIMEOUT_S


@triton.jit
def step_calling_the_packages(m, l, acc, s, v):
    return ch06._update(m, l, acc, s, v)


def test_a_step_that_calls_the_packages_own_is_refused_and_the_notebooks_module_holds_none():
    """A @jit body's calls run where no profile hook sees them: what it names is refused instead. The
    module notebook 06 sends the learner to holds the kernel only, not the answer."""
    from orca_lab.course import online_softmax
    with pytest.raises(bounded.PackageCode, match="calls the package's own orca_lab.course.ch06_triton_kernels._update"):
        ch06.check_online_softmax(step_calling_the_packages)
    assert "tl.exp(m_i - m_new)" not in inspect.getsource(online_softmax)


class NoText:
    """An answer whose text never comes."""

    def __str__(self):
        while True:
            pass


def test_a_message_shows_an_answer_bounded_in_time_and_length():
    """The learner's answer is read as text under the case's bound, and a long one is cut: a grader's
    message stays readable whatever the answer is."""
    t = time.monotonic()
    message = str(harness.mismatch("the answer", "case 0", [1, 2], NoText()))
    assert "got (yours):              a NoText" in message and time.monotonic() - t < 2 * harness.CASE_S
    message = str(harness.mismatch("the answer", "case 0", [1, 2], list(range(3_000_000))))
    assert len(message) < 2 * harness.MAX_SHOWN and "characters)" in message
