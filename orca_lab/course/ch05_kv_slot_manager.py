"""Chapter 05, the Attention K/V manager: the grader of the learner's slot manager (alone, then in
``OrcaScheduler``) and its plug point, ``use_slots``."""
from __future__ import annotations

import random

import torch

from orca_lab.course.bounded import Bounded, ints, refuse_package_code, run_bounded
from orca_lab.course.ch03_iteration_level_scheduling import random_arrivals, requests_of, schedule
from orca_lab.course.forked import grader
from orca_lab.course.harness import N_CASES, Piece, correct, differ, place_on, read, request
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.scheduler import OrcaScheduler


@grader
def check_slot_manager(cls, seed: int = 0):
    """``cls(n_slots)`` with ``can_reserve(n)``, ``reserve(req, n)`` (sets ``req.slots``, a list of
    slot ids), ``release(req)`` (sets ``req.slots`` to None; a second release of the same request
    raises) and ``n_reserved``: random reservations and releases against ``KVSlotManager``'s, slot
    for slot; then plugged into ``OrcaScheduler``."""
    refuse_package_code(cls, KVSlotManager)
    rng = random.Random(seed)
    for case in range(N_CASES):
        n_slots = rng.randint(8, 40)
        label = f"case {case} (n_slots={n_slots})"
        mine = Bounded(run_bounded(cls, n_slots, case=label, references=(KVSlotManager,)), label, (KVSlotManager,))
        ref, held, log, freed, released = KVSlotManager(n_slots), [], [], set(), 0
        for step in range(30):
            mine.case = where = f"{label}, after {', '.join(log) or 'nothing'}"
            if held and rng.random() < 0.4:
                a, b = held.pop(rng.randrange(len(held)))
                freed |= set(b.slots)
                mine.release(a)
                ref.release(b)
                log.append(f"release {a.rid}")
                _check_release(mine, ref, a, where, twice=released == 0)
                released += 1
                continue
            n = rng.randint(1, 12)
            if mine.can_reserve(n) != ref.can_reserve(n):
                differ(f"can_reserve({n})", where, ref.can_reserve(n), mine.can_reserve(n),
                       "n fits when n_reserved + n <= n_slots")
            if not ref.can_reserve(n):
                continue
            a, b = request(step, n - 1, 1), request(step, n - 1, 1)
            before = mine.n_reserved
            mine.reserve(a, n)
            ref.reserve(b, n)
            log.append(f"reserve {n} for {step}")
            slots = read(f"req.slots after reserve({n})", where, a.slots, ints, f"req.slots: a list of {n} slot ids")
            if slots != b.slots or mine.n_reserved != ref.n_reserved:
                differ(f"(req.slots, n_reserved) after reserve {n} for {step}", where, (b.slots, ref.n_reserved),
                       (slots, mine.n_reserved), _reserve_hint(slots, b.slots, n, before, mine.n_reserved, freed))
            held.append((a, b))
    _check_slots_in_scheduler(cls, rng)
    correct(N_CASES, "KVSlotManager")


def _reserve_hint(got: list[int], expected: list[int], n: int, before: int, n_reserved: int, freed: set) -> str:
    if len(got) != n:
        return f"req.slots holds exactly n={n} slot ids"
    if got == expected:
        return "n_reserved not raised: reserve adds n" if n_reserved == before else "reserve adds exactly n to n_reserved"
    if freed & set(expected) and not freed & set(got):
        return "slots not freed: release gives every slot of the request back, to be handed out again"
    return "one contiguous run where a free run is long enough (the lowest such), else the lowest free slots"


def _check_release(mine, ref, req, where: str, twice: bool):
    """After ``release(req)``: n_reserved lowered as the package's, ``req.slots`` None; and (the
    first release of a case) a second release of the same request refused."""
    if mine.n_reserved != ref.n_reserved:
        differ(f"n_reserved after release {req.rid}", where, ref.n_reserved, mine.n_reserved,
               "n_reserved not lowered: release takes the request's slots off n_reserved"
               if mine.n_reserved > ref.n_reserved else "release lowers n_reserved by the request's slots only")
    if req.slots is not None:
        differ(f"req.slots after release {req.rid}", where, None, req.slots,
               "req.slots left set after release: set it to None (the request holds no slot any more)")
    if twice:
        n_reserved = mine.n_reserved
        if run_bounded(_accepted, mine.obj.release, req, case=where, references=mine.references):
            differ(f"a second release of request {req.rid}", where, "an exception (it holds no slot)",
                   f"accepted (n_reserved {n_reserved} -> {mine.n_reserved})",
                   "a second release of the same request accepted: it would free its slots twice; raise")


def _accepted(call, *args) -> bool:
    """Whether ``call(*args)`` returned (rather than raised)."""
    try:
        call(*args)
    except Exception:  # noqa: BLE001  (any exception refuses it)
        return False
    return True


def _check_slots_in_scheduler(cls, rng):
    for case in range(10):
        n_slots = rng.randint(24, 60)
        groups = random_arrivals(rng, n_slots)
        expected = schedule(OrcaScheduler(KVSlotManager(n_slots), 3), requests_of(groups), 2, 10_000)
        label = f"case {case} of the schedule (n_slots={n_slots}, max_bs=3, 2 batches in flight)"
        mine = Bounded(run_bounded(cls, n_slots, case=label), label, (KVSlotManager,))
        got = schedule(OrcaScheduler(PluggedSlots(mine), 3), requests_of(groups), 2, 2 * len(expected) + 1)
        if expected != got:
            differ("the schedule with your manager in OrcaScheduler (each Select's rids, n_rsrv)", label,
                   expected, got, "release must give back every slot and lower n_reserved")


class PluggedSlots:
    """The learner's slot manager (``reserve``, ``release``, ``can_reserve``, ``n_reserved``, notebook
    05) where the scheduler expects a ``KVSlotManager``; what it does not keep (``cache``, the slots
    holding K/V) is kept here. ``as_tensor``: hand its slot ids to the model as the host tensor a
    real pool is read with."""

    def __init__(self, manager, as_tensor: bool = False):
        self.manager, self.as_tensor, self.n_used = manager, as_tensor, 0

    def __getattr__(self, name):
        return getattr(self.manager, name)

    def reserve(self, req, n: int):
        self.manager.reserve(req, n)
        if self.as_tensor:
            req.slots = torch.as_tensor(req.slots, dtype=torch.int64)
        self.n_used += min(req.n_cached, n)

    def release(self, req):
        self.n_used -= min(req.n_cached, len(req.slots))
        if self.as_tensor:
            req.slots = req.slots.tolist()
        self.manager.release(req)

    def cache(self, req, n_cached: int):
        self.n_used += min(n_cached, len(req.slots)) - min(req.n_cached, len(req.slots))
        req.n_cached = n_cached


def use_slots(engine, manager_class):
    """``engine`` (ORCA's, fresh) with a ``manager_class(n_slots)`` of the learner's handing out the
    slots of its K/V pool, in whichever scheduler it has (a learner's Select too). CUDA graphs reserve
    their padding slots from the package's manager, so this engine runs without them."""
    sched = engine.scheduler
    if sched.name != "orca":
        raise ValueError(f"use_slots takes an engine of system 'orca', not {sched.name!r}")
    sched.kv = PluggedSlots(manager_class(sched.kv.n_slots), as_tensor=sched.kv.k is not None)
    if getattr(engine.executor, "graphs", None) is not None:
        engine.executor.graphs = None
    return engine


PIECES = (Piece("SlotManager", "05", "orca", check_slot_manager, use_slots, place=place_on("orca")),)
