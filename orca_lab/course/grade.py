"""Graders for the course's exercises: each runs the learner's function and the package's own on
seeded random cases, side by side, and on the first case where they differ raises an
``AssertionError`` that shows the case, the package's answer and the learner's. A
``NotImplementedError`` from an exercise not written yet goes through unchanged.

One ``check_*`` per exercise; the notebooks call them from the cell after the learner's.
"""
from __future__ import annotations

import random
import statistics

import torch

from orca_lab import kernels
from orca_lab.engine.batch import Batch
from orca_lab.engine.blocks import BlockManager
from orca_lab.engine.engine import Engine, RequestRecord, RunResult
from orca_lab.engine.executor import split_layers
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.policies import _Victims
from orca_lab.engine.prefix_cache import PrefixCachingBlockManager, chain_hashes
from orca_lab.engine.request import Request, RequestState
from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.engine.scheduler import OrcaScheduler, RequestLevelScheduler
from orca_lab.course.plug import PluggedSelect, PluggedSlots
from orca_lab.metrics import per_request
from orca_lab.sim.executor import IterationCost, SimExecutor

N_CASES = 40


class Mismatch(AssertionError):
    """The learner's answer differs from the package's on one case."""


def differ(what: str, case, expected, got, hint: str = ""):
    raise Mismatch(f"{what} differs on {case}:\n  the package's: {expected}\n  yours:         {got}"
                   + (f"\n  hint: {hint}" if hint else ""))


def correct(n: int, against: str):
    print(f"correct: {n} random cases agree with {against}")


def request(rid: int, prompt_len: int, gen: int, arrival: float = 0.0) -> Request:
    return Request(rid, [rid % 256] * prompt_len, SamplingParams(max_gen_tokens=gen), arrival=float(arrival))


# -- 01: attention over the K/V cache ---------------------------------------------------------
def _one_request(n: int, device="cpu") -> torch.Tensor:
    """``cu_seqlens`` of a batch of one request with ``n`` rows."""
    return torch.tensor([0, n], dtype=torch.int32, device=device)


def _requests(groups) -> list[list[Request]]:
    """Fresh requests of ``(rid, prompt_len, gen)`` groups, group ``i`` arriving at time ``i``."""
    return [[request(r, p, g, arrival=i) for r, p, g in grp] for i, grp in enumerate(groups)]


def check_cached_attention(fn, seed: int = 0):
    """``fn(q_new, k_cache, v_cache, k_new, v_new) -> (out, k_cache, v_cache)``: the new tokens'
    attention over the cache and themselves, and the cache grown by their K/V; graded against
    ``kernels.ragged_attention``'s reference for one request."""
    g = torch.Generator().manual_seed(seed)
    for case in range(N_CASES):
        n_cached, n_new, d = case % 7, 1 + case % 3, 4 + 2 * (case % 5)
        q, k_new, v_new = (torch.randn(n_new, d, generator=g) for _ in range(3))
        k_cache, v_cache = (torch.randn(n_cached, d, generator=g) for _ in range(2))
        out, k_all, v_all = fn(q, k_cache, v_cache, k_new, v_new)
        k_ref, v_ref = torch.cat([k_cache, k_new]), torch.cat([v_cache, v_new])
        ref = kernels.ragged_attention(q[:, None], k_ref[:, None], v_ref[:, None], torch.arange(len(k_ref)),
                                       _one_request(n_new), _one_request(len(k_ref)), backend="torch")[:, 0]
        label = f"case {case} ({n_cached} cached tokens, {n_new} new, d={d})"
        if not torch.equal(k_all, k_ref) or not torch.equal(v_all, v_ref):
            differ("the grown cache", label, "k_cache then k_new, rows", f"shape {tuple(k_all.shape)}")
        if out.shape != ref.shape or not torch.allclose(out, ref, atol=1e-5):
            differ("the output", label, ref, out, "each new query sees the cache and the new tokens up to itself")
    correct(N_CASES, "orca_lab.kernels.ragged_attention (reference)")


# -- 02: the request-level baseline's batch end -------------------------------------------------
def ft_finish_iterations(prompt_lens, gens, max_bs) -> list[int]:
    """The package's answer: serve the requests on ``RequestLevelScheduler`` (no model) and read the
    iteration after which each returns."""
    n = len(gens)
    sched = RequestLevelScheduler(KVSlotManager(max_bs * 1024), max_bs, max_seq_len=1024)
    reqs = [request(i, p, g, arrival=i) for i, (p, g) in enumerate(zip(prompt_lens, gens))]
    for r in reqs:
        sched.add(r)
    it = 0
    while sched.has_work():
        batch = sched.select(it)
        it += 1
        sched.on_batch_return(batch, [0] * len(batch), float(it))
    assert len(reqs) == n
    return [int(r.t_finish) for r in reqs]


def check_ft_finish(fn, seed: int = 0):
    """``fn(prompt_lens, gens, max_bs) -> [iteration after which each request returns]``."""
    rng = random.Random(seed)
    for case in range(N_CASES):
        n, max_bs = rng.randint(1, 7), rng.randint(1, 4)
        p = [rng.randint(1, 9) for _ in range(n)]
        g = [rng.randint(1, 6) for _ in range(n)]
        expected, got = ft_finish_iterations(p, g, max_bs), fn(p, g, max_bs)
        if list(got) != expected:
            differ("the finish iterations", f"case {case} (prompt_lens={p}, gens={g}, max_bs={max_bs})",
                   expected, got, "a batch runs until its longest request is done, then the next batch forms")
    correct(N_CASES, "RequestLevelScheduler")


# -- 03: Algorithm 1's Select --------------------------------------------------------------------
def _schedule(sched, arrivals, n_workers: int, limit: int = 500) -> list[tuple[list[int], int]]:
    """Drive ``sched`` without a model: ``arrivals[i]`` requests join before iteration ``i``; up to
    ``n_workers`` batches in flight, the oldest returns first. Returns (rids, n_rsrv) per batch."""
    log, in_flight, it = [], [], 0
    while (sched.has_work() or in_flight or it < len(arrivals)) and len(log) < limit:
        for req in arrivals[it] if it < len(arrivals) else ():
            sched.add(req)
        it += 1
        batch = sched.select(float(it)) if len(in_flight) < n_workers else None
        if batch is not None:
            log.append(([r.rid for r in batch.requests], sched.n_rsrv))
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


def check_select(select, seed: int = 0):
    """The learner's ``select(pool, n_rsrv, max_bs, n_slots) -> (batch, n_rsrv)`` plugged into the
    scheduler (``plug.PluggedSelect``), against ``OrcaScheduler`` on random traces: requests joining
    mid-run, a pool too small for all of them, one or two batches in flight."""
    rng = random.Random(seed)
    for case in range(N_CASES):
        max_bs, n_slots, n_workers = rng.randint(1, 4), rng.randint(24, 60), rng.randint(1, 2)
        groups = _random_arrivals(rng, n_slots)
        expected = _schedule(OrcaScheduler(KVSlotManager(n_slots), max_bs), _requests(groups), n_workers)
        got = _schedule(PluggedSelect(KVSlotManager(n_slots), max_bs, select), _requests(groups), n_workers)
        sizes = {r: p + g for grp in groups for r, p, g in grp}
        label = f"case {case} (max_bs={max_bs}, n_slots={n_slots}, n_workers={n_workers}, max_tokens by rid {sizes})"
        for i, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                differ(f"batch {i} (request ids, n_rsrv after Select)", label, a, b, _select_hint(a[0], b[0]))
        if len(expected) != len(got):
            differ("the number of batches", label, len(expected), len(got))
    correct(N_CASES, "OrcaScheduler.select")


def _select_hint(expected: list[int], got: list[int]) -> str:
    if set(got) - set(expected) and max(got) > max(expected, default=-1):
        return "Select breaks (does not skip) at the first request that does not fit: no later one overtakes it"
    if len(got) < len(expected):
        return "a request in INCREMENT is already reserved; only one in INITIATION reserves max_tokens"
    return "pool order is arrival order; a RUNNING request is in flight and cannot be batched again"


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


def check_flatten(flatten, seed: int = 0):
    """``flatten(requests) -> {field: list}`` for the fields of ``BatchTensors``; graded against
    ``Batch.selective(requests).tensors("cpu")`` on random batches of prompts and decodes."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for case in range(N_CASES):
        reqs = random_requests(rng, g, rng.randint(1, 5))
        bt = Batch.selective(reqs).tensors("cpu")
        got = flatten(reqs)
        label = (f"case {case} (new tokens {[len(r.pending_tokens()) for r in reqs]}, "
                 f"cached {[r.n_cached for r in reqs]}, slots {[r.slots[:6].tolist() for r in reqs]}...)")
        for name in FLAT_FIELDS:
            mine = [int(x) for x in torch.as_tensor(got[name]).flatten().tolist()] if name in got else None
            if mine != getattr(bt, name).tolist():
                differ(name, label, getattr(bt, name).tolist(), mine)
    correct(N_CASES, "BatchTensors.build")


# -- 05: slot reservation and release ---------------------------------------------------------
def check_slot_manager(cls, seed: int = 0):
    """``cls(n_slots)`` with ``can_reserve(n)``, ``reserve(req, n)`` (sets ``req.slots``, a list of
    slot ids), ``release(req)`` and ``n_reserved``: random reservations and releases against
    ``KVSlotManager``'s, slot for slot; then plugged into ``OrcaScheduler``."""
    rng = random.Random(seed)
    for case in range(N_CASES):
        n_slots = rng.randint(8, 40)
        mine, ref, held, log = cls(n_slots), KVSlotManager(n_slots), [], []
        for step in range(30):
            if held and rng.random() < 0.4:
                a, b = held.pop(rng.randrange(len(held)))
                mine.release(a)
                ref.release(b)
                log.append(f"release {a.rid}")
            else:
                n = rng.randint(1, 12)
                if mine.can_reserve(n) != ref.can_reserve(n):
                    differ(f"can_reserve({n}) after {log}", f"case {case} (n_slots={n_slots})",
                           ref.can_reserve(n), mine.can_reserve(n))
                if not ref.can_reserve(n):
                    continue
                a, b = request(step, n - 1, 1), request(step, n - 1, 1)
                mine.reserve(a, n)
                ref.reserve(b, n)
                held.append((a, b))
                log.append(f"reserve {n} for {step}")
                if list(map(int, a.slots)) != b.slots or mine.n_reserved != ref.n_reserved:
                    differ(f"the slots after {log}", f"case {case} (n_slots={n_slots})",
                           (b.slots, ref.n_reserved), (a.slots, mine.n_reserved),
                           "one contiguous run where a free run is long enough (the lowest such), "
                           "else the lowest free slots")
    _check_slots_in_scheduler(cls, rng)
    correct(N_CASES, "KVSlotManager")


def _check_slots_in_scheduler(cls, rng):
    for case in range(10):
        n_slots = rng.randint(24, 60)
        groups = _random_arrivals(rng, n_slots)
        expected = _schedule(OrcaScheduler(KVSlotManager(n_slots), 3), _requests(groups), 2)
        got = _schedule(OrcaScheduler(PluggedSlots(cls(n_slots)), 3), _requests(groups), 2)
        if expected != got:
            differ("the schedule with your manager in OrcaScheduler", f"case {case} (n_slots={n_slots})",
                   expected, got, "release must give back every slot and lower n_reserved")


# -- 06: one block of the online softmax, in Triton ---------------------------------------------
def check_online_softmax(step, seed: int = 0, device=None):
    """The learner's ``@triton.jit step(m, l, acc, s, v)`` in the package's one-query kernel
    (``online_softmax.py``), against ``kernels.ragged_attention``'s reference, on random sizes."""
    from orca_lab.course.online_softmax import attend_one_query
    g = torch.Generator().manual_seed(seed)
    device = device or torch.get_default_device()
    cases = [(n, d, block) for n in (1, 5, 16, 37) for d in (4, 16) for block in (4, 16)]
    for case, (n, d, block) in enumerate(cases):
        # drawn on the CPU (notebook 06 may make CUDA the default device), then moved
        q, k, v = (torch.randn(*shape, generator=g, device="cpu") for shape in ((d,), (n, d), (n, d)))
        k[n // 2] += 4 * q          # a score much larger than the rest, past the first block: m must grow
        q, k, v = q.to(device), k.to(device), v.to(device)
        got = attend_one_query(q, k, v, block, step)
        ref = kernels.ragged_attention(q[None, None], k[:, None], v[:, None], torch.arange(n, device=device),
                                       _one_request(1, device), _one_request(n, device), backend="torch")[0, 0]
        if not torch.allclose(got, ref, atol=1e-4, rtol=1e-4):
            differ("the attention output", f"case {case} (n={n} keys, d={d}, block={block})", ref.tolist(),
                   got.tolist(), "when m grows, rescale l and acc by exp(m_old - m_new)")
    correct(len(cases), "orca_lab.kernels.ragged_attention (reference)")


# -- 07: pipeline stages ------------------------------------------------------------------------
def check_split_layers(fn, seed: int = 0):
    """``fn(n_layers, n_stages) -> [(first, end), ...]`` against ``executor.split_layers``."""
    rng = random.Random(seed)
    for case in range(N_CASES):
        n_layers = rng.randint(1, 96)
        n_stages = rng.randint(1, min(n_layers, 16))
        expected, got = split_layers(n_layers, n_stages), fn(n_layers, n_stages)
        if [tuple(s) for s in got] != expected:
            differ("the stages", f"case {case} (n_layers={n_layers}, n_stages={n_stages})", expected, got,
                   "contiguous, in order, sizes differing by at most one: stage i starts at round(i * n_layers / n_stages)")
    correct(N_CASES, "orca_lab.engine.executor.split_layers")


# -- 08: batches in flight ---------------------------------------------------------------------
class OneUnitPerStage:
    """Figure 8's cost model: each stage of any iteration takes one time unit."""

    def __init__(self, n_stages: int):
        self.n_stages = n_stages

    def iteration(self, batch):
        return IterationCost(stages=(1.0,) * self.n_stages)


class _Recording(SimExecutor):
    def __init__(self, cost):
        super().__init__(cost)
        self.submitted = []

    def submit(self, batch):
        self.submitted.append((self.clock.now(), [r.rid for r in batch.requests]))
        super().submit(batch)


def _pipeline_case(rng):
    system = rng.choice(["orca", "ft"])
    n_workers, max_bs = rng.randint(1, 4), rng.randint(1, 4)
    lens = [(rng.randint(1, 6), rng.randint(1, 5)) for _ in range(rng.randint(1, 8))]
    return system, n_workers, max_bs, lens


def _parts(system, n_workers, max_bs, lens):
    n_slots = 1024 * max(max_bs, len(lens))
    kv = KVSlotManager(n_slots)
    sched = OrcaScheduler(kv, max_bs) if system == "orca" else \
        RequestLevelScheduler(kv, max_bs, 1024, mbs=max(1, max_bs // 2))
    return sched, _Recording(OneUnitPerStage(n_workers))


def check_in_flight(loop, seed: int = 0):
    """The learner's ``loop(scheduler, executor, n_workers)`` (Algorithm 1's loop: up to
    ``n_workers`` batches in flight) against ``Engine.run``, both on the simulator's executor with
    one time unit per stage; ORCA's scheduler and the baseline's micro-batches alike."""
    rng = random.Random(seed)
    for case in range(N_CASES):
        system, n_workers, max_bs, lens = spec = _pipeline_case(rng)
        sched, ex = _parts(*spec)
        engine = Engine(sched, ex, vocab_size=256, max_seq_len=1024)
        for p, g in lens:
            engine.add_request([1] * p, SamplingParams(max_gen_tokens=g), arrival=0.0)
        engine.run()
        expected = (ex.submitted, [r.t_finish for r in engine.requests])
        sched, ex = _parts(*spec)
        reqs = [request(i, p, g) for i, (p, g) in enumerate(lens)]
        for r in reqs:
            sched.add(r)
        loop(sched, ex, n_workers)
        got = (ex.submitted, [r.t_finish for r in reqs])
        if got != expected:
            differ("(submit time, batch) in order, and each request's finish time",
                   f"case {case} ({system}, n_workers={n_workers}, max_bs={max_bs}, (prompt, gen) {lens})",
                   expected, got, "select while fewer than n_workers batches are in flight; "
                   "then wait for the oldest and give its tokens to on_batch_return")
    correct(N_CASES, "Engine.run")


# -- 09: the paper's metric ----------------------------------------------------------------------
def check_median_norm_latency(fn, seed: int = 0):
    """``fn(records) -> ms``: the median over requests of (finish - arrival) / tokens generated,
    against ``metrics.per_request`` on random records."""
    rng = random.Random(seed)
    for case in range(N_CASES):
        recs = []
        for rid in range(rng.randint(1, 9)):
            arrival = rng.uniform(0, 5)
            n = rng.randint(1, 40)
            recs.append(RequestRecord(rid, arrival, 4, n, arrival, arrival + 0.1, arrival + rng.uniform(0.1, 9),
                                      n, (0,) * n))
        expected = statistics.median(per_request(RunResult("orca", recs, [])).norm_latency) * 1e3
        got = fn(recs)
        if abs(got - expected) > 1e-6 * max(1.0, expected):
            differ("the median normalized latency (ms)", f"case {case} ({len(recs)} requests)", expected, got)
    correct(N_CASES, "orca_lab.metrics.per_request")


# -- 11: block tables and preemption --------------------------------------------------------------
def check_block_slots(fn, seed: int = 0):
    """``fn(table, n_tokens, block_size) -> slot ids`` of a request's first ``n_tokens`` tokens
    against ``BlockManager`` (``req.slots`` after it grew, blocks scattered by earlier releases)."""
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
        got, expected = [int(s) for s in fn(table, n, bs)], [int(s) for s in req.slots[:n]]
        if got != expected:
            differ("the slot ids", f"case {case} (table {table}, {n} tokens, block_size {bs})", expected, got, "token t is in block table[t // block_size], at t % block_size")
    correct(N_CASES, "BlockManager")


def check_victim(fn, seed: int = 0):
    """``fn(running, req, chosen) -> the request to preempt, or None`` against the paged
    scheduler's choice (``policies._Victims``) on random pools."""
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
        got = fn(list(running), req, set(chosen))
        if got is not expected:
            pool = [(r.rid, r.state.value, r.slots is not None) for r in running]
            differ("the victim", f"case {case} (request {req.rid} needs a block; pool (rid, state, holds "
                   f"blocks) {pool}; in this batch {sorted(chosen)})", getattr(expected, "rid", None),
                   getattr(got, "rid", None),
                   "the latest arrival after it that holds blocks, is between iterations and not in this batch")
    correct(N_CASES, "the paged scheduler's victims")


# -- 12: prefix caching ---------------------------------------------------------------------------
def check_block_hashes(fn, seed: int = 0):
    """``fn(tokens, block_size) -> [name of each full block]``, each ``block_hash(parent's name,
    its tokens)``, against ``prefix_cache.chain_hashes`` on random token lists."""
    rng = random.Random(seed)
    for case in range(N_CASES):
        bs = rng.randint(1, 8)
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 5 * bs + 3))]
        expected, got = chain_hashes(tokens, bs, len(tokens) // bs), list(fn(tokens, bs))
        if got != expected:
            hint = "full blocks only: len(tokens) // block_size names" if len(got) != len(expected) else \
                "the first block's parent is None: block_hash(None, tokens[:block_size])" if got[:1] != expected[:1] \
                else "block i's parent is block i-1's name: block_hash(hashes[i - 1], tokens of block i)"
            differ("the block names", f"case {case} (tokens {tokens}, block_size {bs})", expected, got, hint)
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
        got = fn(dict(kv.block_of), list(prompt), bs)
        if got != expected:
            differ("the cached prefix (tokens)", f"case {case} (block_size {bs}, {n_blocks} blocks; prompts served "
                   f"before {past}, in order; prompt {prompt}{hole})", expected, got, _lookup_hint(expected, got, prompt, bs))
    correct(N_CASES, "PrefixCachingBlockManager.lookup")
