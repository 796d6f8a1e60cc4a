"""Graders for the course's exercises: each runs the learner's function and the package's own on
seeded random cases, side by side, and on the first case where they differ raises ``Mismatch``
(an ``AssertionError``) that names the case, labels both answers (expected: the package's; got: the
learner's) and gives a hint chosen from the symptom. Every call of the learner's code is bounded
(``bounded.run_bounded``: a wall-time guard for code that never returns, and the graders' own loops
stop after as many steps as the package's answer took, plus one), and refused if it is, wraps or
calls the package's own answer (``bounded.refuse_package_code``). An exception of the learner's
(``NotImplementedError`` from an exercise not written yet included) goes through as theirs, with a
note naming the case.

One ``check_*`` per exercise; the notebooks call them from the cell after the learner's. The
by-hand exercises' checks (``check_first_select``, ...) compare with the package's answer too.
"""
from __future__ import annotations

import random
import statistics

import torch

from orca_lab import kernels
from orca_lab.course import _references
from orca_lab.course import bounded
from orca_lab.course.bounded import Bounded, refuse_package_code, run_bounded
from orca_lab.course.plug import PluggedSelect, PluggedSlots
from orca_lab.engine.batch import Batch, BatchTensors
from orca_lab.engine.blocks import BlockManager
from orca_lab.engine.engine import RequestRecord, RunResult
from orca_lab.engine.executor import split_layers
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.policies import _Victims
from orca_lab.engine.prefix_cache import PrefixCachingBlockManager, chain_hashes
from orca_lab.engine.request import RequestState
from orca_lab.engine.scheduler import OrcaScheduler, RequestLevelScheduler
from orca_lab.kernels.attention import ragged_attention_ref, ragged_attention_torch
from orca_lab.metrics import per_request

__all__ = ["Mismatch", "check_block_hashes", "check_block_slots", "check_by_hand", "check_cached_attention",
           "check_first_select", "check_ft_iterations",
           "check_flatten", "check_ft_finish", "check_median_norm_latency",
           "check_online_softmax", "check_prefix_lookup", "check_select", "check_slot_manager",
           "check_split_layers", "check_victim"]

N_CASES = 40
request = _references.request


class Mismatch(AssertionError):
    """The learner's answer differs from the package's on one case."""


def mismatch(what: str, case, expected, got, hint: str = "") -> Mismatch:
    return Mismatch(f"{what} differs on {case}:\n  expected (the package's): {expected}\n  got (yours):"
                    f"              {got}" + (f"\n  hint: {hint}" if hint else ""))


def differ(what: str, case, expected, got, hint: str = ""):
    raise mismatch(what, case, expected, got, hint)


def correct(n: int, against: str):
    print(f"correct: {n} random cases agree with {against}")


def _read(what: str, case, got, read, shape: str):
    """``read(got)``: the learner's answer in the form compared; one of another shape is a mismatch
    that says which shape was expected (never a TypeError from inside the grader)."""
    try:
        return read(got)
    except Exception:  # noqa: BLE001  (any failure to read it is the same symptom: the wrong shape)
        differ(what, case, shape, f"{got!r} ({type(got).__name__})", f"return {shape}")


def check_by_hand(case: str, answers: dict):
    """A by-hand exercise's answers, ``{name: (yours, the package's, hint)}``: the first that differs
    is a ``Mismatch`` naming it, both values labelled, with its hint in words."""
    for name, (yours, expected, hint) in answers.items():
        if yours != expected:
            differ(name, case, expected, yours, hint)


def _ints(xs) -> list[int]:
    return [int(x) for x in torch.as_tensor(xs).flatten().tolist()]


# -- 01: attention over the K/V cache ---------------------------------------------------------
def _one_request(n: int, device="cpu") -> torch.Tensor:
    """``cu_seqlens`` of a batch of one request with ``n`` rows."""
    return torch.tensor([0, n], dtype=torch.int32, device=device)


def _requests(groups) -> list[list]:
    """Fresh requests of ``(rid, prompt_len, gen)`` groups, group ``i`` arriving at time ``i``."""
    return [[request(r, p, g, arrival=i) for r, p, g in grp] for i, grp in enumerate(groups)]


def _three_tensors(got):
    out, k, v = got
    return torch.as_tensor(out), torch.as_tensor(k), torch.as_tensor(v)


def check_cached_attention(fn, seed: int = 0):
    """``fn(q_new, k_cache, v_cache, k_new, v_new) -> (out, k_cache, v_cache)``: the new tokens'
    attention over the cache and themselves, and the cache grown by their K/V; graded against
    ``kernels.ragged_attention``'s reference for one request."""
    refs = (kernels.ragged_attention, ragged_attention_ref, ragged_attention_torch)
    refuse_package_code(fn, *refs)
    g = torch.Generator().manual_seed(seed)
    for case in range(N_CASES):
        n_cached, n_new, d = case % 7, 1 + case % 3, 4 + 2 * (case % 5)
        q, k_new, v_new = (torch.randn(n_new, d, generator=g) for _ in range(3))
        k_cache, v_cache = (torch.randn(n_cached, d, generator=g) for _ in range(2))
        label = f"case {case} ({n_cached} cached tokens, {n_new} new, d={d})"
        got = run_bounded(fn, q, k_cache, v_cache, k_new, v_new, case=label, references=refs)
        out, k_all, v_all = _read("the answer", label, got, _three_tensors, "(out, k_cache, v_cache): three tensors")
        k_ref, v_ref = torch.cat([k_cache, k_new]), torch.cat([v_cache, v_new])
        ref = kernels.ragged_attention(q[:, None], k_ref[:, None], v_ref[:, None], torch.arange(len(k_ref)),
                                       _one_request(n_new), _one_request(len(k_ref)), backend="torch")[:, 0]
        if not torch.equal(k_all, k_ref) or not torch.equal(v_all, v_ref):
            differ("the grown cache", label, f"k_cache then k_new: shape {tuple(k_ref.shape)}",
                   f"shape {tuple(k_all.shape)}", "torch.cat([k_cache, k_new]): the old rows first")
        if out.shape != ref.shape or not torch.allclose(out, ref, atol=1e-5):
            differ("the output", label, ref, out, "each new query sees the cache and the new tokens up to itself")
    correct(N_CASES, "orca_lab.kernels.ragged_attention (reference)")


# -- 02: the request-level baseline's batch end -------------------------------------------------
def check_ft_iterations(fn, seed: int = 0):
    """``fn(prompt_lens, gens) -> iterations of one request-level batch of those requests``, against
    ``RequestLevelScheduler`` serving them in one batch."""
    refs = (_references.ft_finish_iterations, RequestLevelScheduler)
    refuse_package_code(fn, *refs)
    rng = random.Random(seed)
    for case in range(N_CASES):
        n = rng.randint(1, 6)
        p, g = [rng.randint(1, 30) for _ in range(n)], [rng.randint(1, 8) for _ in range(n)]
        label = f"case {case} (prompt_lens={p}, gens={g})"
        got = _read("the iterations", label, run_bounded(fn, list(p), list(g), case=label, references=refs), int,
                    "a number of iterations")
        expected = max(_references.ft_finish_iterations(p, g, n))
        if got != expected:
            differ("the iterations", label, expected, got,
                   "the first iteration runs the shortest prompt's length of every prompt; the longer prompts' "
                   "other tokens then run one an iteration, and the batch ends when its last request is done")
    correct(N_CASES, "RequestLevelScheduler")


def check_ft_finish(fn, seed: int = 0):
    """``fn(prompt_lens, gens, max_bs) -> [iteration after which each request returns]``."""
    refs = (_references.ft_finish_iterations, RequestLevelScheduler)
    refuse_package_code(fn, *refs)
    rng = random.Random(seed)
    for case in range(N_CASES):
        n, max_bs = rng.randint(1, 7), rng.randint(1, 4)
        p = [rng.randint(1, 9) for _ in range(n)]
        g = [rng.randint(1, 6) for _ in range(n)]
        label = f"case {case} (prompt_lens={p}, gens={g}, max_bs={max_bs})"
        expected = _references.ft_finish_iterations(p, g, max_bs)
        got = _read("the finish iterations", label, run_bounded(fn, p, g, max_bs, case=label, references=refs),
                    lambda got: [int(x) for x in got], "a list of ints, one per request")
        if got != expected:
            differ("the finish iterations", label, expected, got,
                   "one per request, in arrival order" if len(got) != len(expected) else
                   "batches of max_bs in arrival order: a batch runs until its longest request is done, "
                   "then the next batch forms")
    correct(N_CASES, "RequestLevelScheduler")


# -- 03: Algorithm 1's Select --------------------------------------------------------------------
def _schedule(sched, arrivals, n_workers: int, limit: int) -> list[tuple[list[int], int]]:
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


def _random_arrivals(rng, n_slots: int):
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


def _batch_and_n(got):
    batch, n = got
    return list(batch), int(n)


def _graded_select(select, expected: list, label: str):
    """The learner's ``select``, bounded, and its ``k``-th answer compared with the package's
    ``k``-th (both schedules are the same up to the first answer that differs)."""
    def graded(pool, n_rsrv, max_bs, n_slots):
        k = len(graded.calls)
        where = f"{label}, Select call {k} (pool (rid, state, max_tokens) " \
                f"{[(r.rid, r.state.value, r.max_tokens) for r in pool]}, n_rsrv={n_rsrv})"
        got = run_bounded(select, list(pool), n_rsrv, max_bs, n_slots, case=where,
                          references=(OrcaScheduler.select,))
        batch, n = _read("the answer", where, got, _batch_and_n, "(batch, n_rsrv): a list of requests and an int")
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


def check_select(select, seed: int = 0):
    """The learner's ``select(pool, n_rsrv, max_bs, n_slots) -> (batch, n_rsrv)`` plugged into the
    scheduler (``plug.PluggedSelect``), against ``OrcaScheduler`` on random traces: requests joining
    mid-run, a pool too small for all of them, one or two batches in flight. Each call is compared
    with the package's Select at the same point."""
    refuse_package_code(select, OrcaScheduler.select)
    rng = random.Random(seed)
    for case in range(N_CASES):
        max_bs, n_slots, n_workers = rng.randint(1, 4), rng.randint(24, 60), rng.randint(1, 2)
        groups = _random_arrivals(rng, n_slots)
        expected = _schedule(OrcaScheduler(KVSlotManager(n_slots), max_bs), _requests(groups), n_workers, 10_000)
        sizes = {r: p + g for grp in groups for r, p, g in grp}
        label = f"case {case} (max_bs={max_bs}, n_slots={n_slots}, n_workers={n_workers}, max_tokens by rid {sizes})"
        graded = _graded_select(select, expected, label)
        _schedule(PluggedSelect(KVSlotManager(n_slots), max_bs, graded), _requests(groups), n_workers,
                  len(expected) * n_workers + 1)
        if len(graded.calls) != len(expected):
            differ("the number of Select calls", label, len(expected), len(graded.calls))
    correct(N_CASES, "OrcaScheduler.select")


def check_first_select(first_batch, first_n_rsrv, second_batch, second_n_rsrv):
    """Notebook 03's by-hand Select: W, X, Y, Z (max_tokens 12, 30, 5, 8) arrive in that order,
    max_bs=3, n_slots=40; the first batch, then the next once W finished, from ``OrcaScheduler``."""
    names = "WXYZ"
    sched = OrcaScheduler(KVSlotManager(40), 3)
    for rid, m in enumerate((12, 30, 5, 8)):
        sched.add(request(rid, m - 1, 1, arrival=rid))        # max_tokens = prompt + 1 generated
    answers = []
    for _ in range(2):
        batch = sched.select()
        answers.append(([names[r.rid] for r in batch.requests], sched.n_rsrv))
        sched.on_batch_return(batch, [0] * len(batch), 0.0)   # W generates its one token and leaves
    hint = "in arrival order, reserve max_tokens while it fits in 40; at the first request that does not fit, " \
           "stop (later ones wait too)"
    check_by_hand("W, X, Y, Z with max_tokens 12, 30, 5, 8, max_bs=3, n_slots=40", {
        "the first batch and n_rsrv": ((list(first_batch), first_n_rsrv), answers[0], hint),
        "the second batch and n_rsrv (W finished and released its 12 slots)":
            ((list(second_batch), second_n_rsrv), answers[1], hint)})
    print(f"correct: {answers[0][0]} (n_rsrv {answers[0][1]}), then {answers[1][0]} (n_rsrv {answers[1][1]})")


# -- 04: flattening a selective batch ---------------------------------------------------------
FLAT_FIELDS = ("input_ids", "positions", "slot_mapping", "kv_slot_ids", "cu_seqlens_q", "cu_seqlens_k", "last_idx")


def random_requests(rng, g, b: int) -> list[Request]:
    """``b`` requests part way through (some cached tokens, some new), slots scattered in a pool."""
    reqs, pool = [], torch.randperm(400, generator=g)
    for rid in range(b):
        prompt, cached, generated = rng.randint(1, 9), None, rng.randint(0, 4)
        req = request(rid, prompt, generated + 2)
        req.output = [rng.randrange(256) for _ in range(generated)]
        req.prompt = [rng.randrange(256) for _ in range(prompt)]
        cached = rng.randint(0, prompt - 1) if generated == 0 else prompt + generated - 1
        req.n_cached = cached
        req.slots, pool = pool[:req.max_tokens], pool[req.max_tokens:]
        reqs.append(req)
    return reqs


_FLAT_HINTS = {
    "input_ids": "each request's new tokens (pending_tokens()), requests one after another",
    "positions": "a new token's position counts the request's cached tokens before it: n_cached + i",
    "slot_mapping": "where each new token's K/V is written: req.slots[n_cached:n_cached + new]",
    "kv_slot_ids": "the whole context attention reads: req.slots[:n_cached + new], request after request",
    "cu_seqlens_q": "0, then the running sum of each request's new tokens",
    "cu_seqlens_k": "0, then the running sum of each request's context (cached + new tokens)",
    "last_idx": "the row of each request's last new token: cu_seqlens_q[i + 1] - 1"}


def check_flatten(flatten, seed: int = 0):
    """``flatten(requests) -> {field: list}`` for the fields of ``BatchTensors``; graded against
    ``Batch.selective(requests).tensors("cpu")`` on random batches of prompts and decodes."""
    refs = (BatchTensors, Batch.tensors)
    refuse_package_code(flatten, *refs)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for case in range(N_CASES):
        reqs = random_requests(rng, g, rng.randint(1, 5))
        bt = Batch.selective(reqs).tensors("cpu")
        label = (f"case {case} (new tokens {[len(r.pending_tokens()) for r in reqs]}, "
                 f"cached {[r.n_cached for r in reqs]}, slots {[r.slots[:6].tolist() for r in reqs]}...)")
        got = _read("the flat metadata", label, run_bounded(flatten, reqs, case=label, references=refs),
                    lambda got: {name: _ints(got[name]) if name in got else None for name in FLAT_FIELDS},
                    f"a dict of lists of ints, keys {list(FLAT_FIELDS)}")
        for name in FLAT_FIELDS:
            if got[name] != getattr(bt, name).tolist():
                differ(name, label, getattr(bt, name).tolist(), got[name], _FLAT_HINTS[name])
    correct(N_CASES, "BatchTensors.build")


# -- 05: slot reservation and release ---------------------------------------------------------
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
            slots = _read(f"req.slots after reserve({n})", where, a.slots, _ints, f"req.slots: a list of {n} slot ids")
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
        groups = _random_arrivals(rng, n_slots)
        expected = _schedule(OrcaScheduler(KVSlotManager(n_slots), 3), _requests(groups), 2, 10_000)
        label = f"case {case} of the schedule (n_slots={n_slots}, max_bs=3, 2 batches in flight)"
        mine = Bounded(run_bounded(cls, n_slots, case=label), label, (KVSlotManager,))
        got = _schedule(OrcaScheduler(PluggedSlots(mine), 3), _requests(groups), 2, 2 * len(expected) + 1)
        if expected != got:
            differ("the schedule with your manager in OrcaScheduler (each Select's rids, n_rsrv)", label,
                   expected, got, "release must give back every slot and lower n_reserved")


# -- 06: one block of the online softmax, in Triton ---------------------------------------------
def check_online_softmax(step, seed: int = 0, device=None):
    """The learner's ``@triton.jit step(m, l, acc, s, v)`` in the package's one-query kernel
    (``online_softmax.py``), against ``kernels.ragged_attention``'s reference, on random sizes."""
    from orca_lab.course.online_softmax import attend_one_query, update
    refuse_package_code(step, update)
    g = torch.Generator().manual_seed(seed)
    device = device or torch.get_default_device()
    cases = [(n, d, block) for n in (1, 5, 16, 37) for d in (4, 16) for block in (4, 16)]
    for case, (n, d, block) in enumerate(cases):
        # drawn on the CPU (notebook 06 may make CUDA the default device), then moved
        q, k, v = (torch.randn(*shape, generator=g, device="cpu") for shape in ((d,), (n, d), (n, d)))
        k[n // 2] += 4 * q          # a score much larger than the rest, past the first block: m must grow
        q, k, v = q.to(device), k.to(device), v.to(device)
        label = f"case {case} (n={n} keys, d={d}, block={block})"
        got = run_bounded(attend_one_query, q, k, v, block, step, case=label, timeout_s=10 * bounded.TIMEOUT_S,
                          references=(update,))
        ref = kernels.ragged_attention(q[None, None], k[:, None], v[:, None], torch.arange(n, device=device),
                                       _one_request(1, device), _one_request(n, device), backend="torch")[0, 0]
        if not torch.allclose(got, ref, atol=1e-4, rtol=1e-4):
            differ("the attention output", label, ref.tolist(),
                   got.tolist(), "when m grows, rescale l and acc by exp(m_old - m_new)")
    correct(len(cases), "orca_lab.kernels.ragged_attention (reference)")


# -- 07: pipeline stages ------------------------------------------------------------------------
def check_split_layers(fn, seed: int = 0):
    """``fn(n_layers, n_stages) -> [(first, end), ...]`` against ``executor.split_layers``."""
    refuse_package_code(fn, split_layers)
    rng = random.Random(seed)
    for case in range(N_CASES):
        n_layers = rng.randint(1, 96)
        n_stages = rng.randint(1, min(n_layers, 16))
        label = f"case {case} (n_layers={n_layers}, n_stages={n_stages})"
        got = _read("the stages", label, run_bounded(fn, n_layers, n_stages, case=label, references=(split_layers,)),
                    lambda got: [(int(a), int(b)) for a, b in got], "a list of (first, end) pairs, one per stage")
        expected = split_layers(n_layers, n_stages)
        if got != expected:
            differ("the stages", label, expected, got, f"n_stages={n_stages} pairs" if len(got) != n_stages else
                   "contiguous, in order, sizes differing by at most one: stage i starts at round(i * n_layers / n_stages)")
    correct(N_CASES, "orca_lab.engine.executor.split_layers")


# -- 09: the paper's metric ----------------------------------------------------------------------
def check_median_norm_latency(fn, seed: int = 0):
    """``fn(records) -> ms``: the median over requests of (finish - arrival) / tokens generated,
    against ``metrics.per_request`` on random records."""
    refuse_package_code(fn, per_request)
    rng = random.Random(seed)
    for case in range(N_CASES):
        recs = []
        for rid in range(rng.randint(1, 9)):
            arrival = rng.uniform(0, 5)
            n = rng.randint(1, 40)
            recs.append(RequestRecord(rid, arrival, 4, n, arrival, arrival + 0.1, arrival + rng.uniform(0.1, 9),
                                      n, (0,) * n))
        expected = statistics.median(per_request(RunResult("orca", recs, [])).norm_latency) * 1e3
        label = f"case {case} ({len(recs)} requests)"
        got = _read("the median normalized latency (ms)", label,
                    run_bounded(fn, recs, case=label, references=(per_request,)), float, "a number of milliseconds")
        if abs(got - expected) > 1e-6 * max(1.0, expected):
            differ("the median normalized latency (ms)", label, expected, got, _median_hint(expected, got))
    correct(N_CASES, "orca_lab.metrics.per_request")


def _median_hint(expected: float, got: float) -> str:
    if abs(got - expected / 1e3) <= 1e-6 * max(1.0, expected):
        return "in milliseconds: seconds * 1e3"
    return "per request (t_finish - arrival) / n_generated, then the median over requests (not the mean)"


# -- 11: block tables and preemption --------------------------------------------------------------
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
        got = _read("the slot ids", label, run_bounded(fn, list(table), n, bs, case=label, references=(BlockManager,)),
                    _ints, f"a list of {n} slot ids")
        expected = [int(s) for s in req.slots[:n]]
        if got != expected:
            differ("the slot ids", label, expected, got, f"one slot per token: {n}" if len(got) != n else
                   "token t is in block table[t // block_size], at t % block_size")
    correct(N_CASES, "BlockManager")


def check_victim(fn, seed: int = 0):
    """``fn(running, req, chosen) -> the request to preempt, or None`` against the paged
    scheduler's choice (``policies._Victims``) on random pools."""
    refuse_package_code(fn, _Victims)
    rng = random.Random(seed)
    states = [RequestState.INCREMENT, RequestState.INCREMENT, RequestState.RUNNING, RequestState.INITIATION]
    for case in range(N_CASES):
        running = [request(rid, 1, 1, arrival=rid) for rid in range(rng.randint(1, 8))]
        for r in running:
            r.state = rng.choice(states)
            r.slots = None if r.state is RequestState.INITIATION or rng.random() < 0.2 else [rid for rid in range(4)]
        req = rng.choice(running)
        chosen = {r.rid for r in running if rng.random() < 0.3}
        expected = _Victims(list(running), chosen).next(req)
        pool = [(r.rid, r.state.value, r.slots is not None) for r in running]
        label = f"case {case} (request {req.rid} needs a block; pool (rid, state, holds blocks) {pool}; " \
                f"in this batch {sorted(chosen)})"
        got = run_bounded(fn, list(running), req, set(chosen), case=label, references=(_Victims,))
        if got is not None and not any(got is r for r in running):
            differ("the victim", label, getattr(expected, "rid", None), repr(got), "return a request of running, or None")
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


# -- 12: prefix caching ---------------------------------------------------------------------------
def check_block_hashes(fn, seed: int = 0):
    """``fn(tokens, block_size) -> [name of each full block]``, each ``block_hash(parent's name,
    its tokens)``, against ``prefix_cache.chain_hashes`` on random token lists."""
    refuse_package_code(fn, chain_hashes)
    rng = random.Random(seed)
    for case in range(N_CASES):
        bs = rng.randint(1, 8)
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 5 * bs + 3))]
        label = f"case {case} (tokens {tokens}, block_size {bs})"
        got = _read("the block names", label, run_bounded(fn, list(tokens), bs, case=label, references=(chain_hashes,)),
                    list, "a list of block names (ints), one per full block")
        expected = chain_hashes(tokens, bs, len(tokens) // bs)
        if got != expected:
            hint = "full blocks only: len(tokens) // block_size names" if len(got) != len(expected) else \
                "the first block's parent is None: block_hash(None, tokens[:block_size])" if got[:1] != expected[:1] \
                else "block i's parent is block i-1's name: block_hash(hashes[i - 1], tokens of block i)"
            differ("the block names", label, expected, got, hint)
    correct(N_CASES, "orca_lab.engine.prefix_cache.chain_hashes")


def _serve_and_free(kv, rid: int, prompt: list[int]):
    """``prompt`` computed and finished on ``kv``: its full blocks stay cached (some may evict others)."""
    req = request(rid, len(prompt), 1)
    req.prompt = list(prompt)
    hit = kv.lookup(req)
    if not kv.can_admit(len(prompt) - len(hit) * kv.block_size, hit):
        return
    kv.share(req, hit)
    kv.grow(req, len(prompt))
    kv.cache(req, len(prompt))
    kv.release(req)


def _prefix_case(rng):
    """A block size, a small pool, earlier prompts sharing roots, and a new prompt: a cut of an
    earlier one and a random tail, or (a quarter of the cases) an earlier one cut to whole blocks."""
    bs = rng.randint(1, 8)
    roots = [[rng.randrange(4) for _ in range(rng.randint(0, 4 * bs))] for _ in range(2)]
    past = [rng.choice(roots) + [rng.randrange(4) for _ in range(rng.randint(0, 3 * bs))]
            for _ in range(rng.randint(1, 6))]
    base = rng.choice(past)
    if rng.random() < 0.25 and len(base) >= bs:
        prompt = base[:len(base) // bs * bs]                       # re-sent whole, all of it cached
    else:
        prompt = base[:rng.randint(0, len(base))] + [rng.randrange(4) for _ in range(rng.randint(0, 2 * bs))]
    return bs, rng.randint(3, 10), past, prompt or [rng.randrange(4)]


def _forget_one(kv, prompt: list[int], rng):
    """Forget one cached block of ``prompt``'s chain that a later cached one follows (an eviction out
    of the package's tail-first order, which never leaves such a hole): the lookup stops there."""
    names = chain_hashes(prompt, kv.block_size, (len(prompt) - 1) // kv.block_size)
    held = [i for i, h in enumerate(names) if h in kv.block_of][:-1]
    if not held:
        return ""
    i = rng.choice(held)
    del kv.hash_of[kv.block_of.pop(names[i])]
    return f"; then its block {i} forgotten"


def _lookup_hint(expected: int, got: int, prompt: list[int], bs: int) -> str:
    if got >= len(prompt):
        return "at most len(prompt) - 1 tokens: the last prompt token is always computed (its logits give the first output)"
    if got % bs:
        return "full blocks only: a multiple of block_size (a partial block is never cached)"
    if got > expected:
        return "stop at the first block whose name is not cached: a later one does not count"
    return "every full block of prompt[:-1], in order, while its chained name is in the cache"


def check_prefix_lookup(fn, seed: int = 0):
    """``fn(cache, prompt, block_size) -> tokens of prompt found cached`` (``cache``: the names of
    the cached blocks) against ``PrefixCachingBlockManager.lookup``, after earlier prompts were
    served and freed on a pool small enough to evict."""
    refs = (PrefixCachingBlockManager.lookup,)
    refuse_package_code(fn, *refs)
    rng = random.Random(seed)
    for case in range(N_CASES):
        bs, n_blocks, past, prompt = _prefix_case(rng)
        kv = PrefixCachingBlockManager(n_blocks * bs, bs)
        for rid, p in enumerate(past):
            _serve_and_free(kv, rid, p)
        hole = _forget_one(kv, prompt, rng) if case % 4 == 1 else ""
        query = request(len(past), len(prompt), 1)
        query.prompt = list(prompt)
        expected = len(kv.lookup(query)) * bs
        label = f"case {case} (block_size {bs}, {n_blocks} blocks; prompts served before {past}, in order; " \
                f"prompt {prompt}{hole})"
        got = _read("the cached prefix (tokens)", label,
                    run_bounded(fn, dict(kv.block_of), list(prompt), bs, case=label, references=refs), int,
                    "a number of tokens")
        if got != expected:
            differ("the cached prefix (tokens)", label, expected, got, _lookup_hint(expected, got, prompt, bs))
    correct(N_CASES, "PrefixCachingBlockManager.lookup")
