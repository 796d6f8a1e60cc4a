"""Where a learner's function goes into the package: it runs in place of the package's own piece,
and the package does the rest (the engine's loop, the model, the K/V pool). ``assemble`` plugs every
piece of the learner's package (``mine.py``) at once: the capstone's engine, and
``orca-lab serve --plugins``'s."""
from __future__ import annotations

from types import MappingProxyType

import numpy as np
import torch

from orca_lab.course.guards import guarded
from orca_lab.course.tensor_ranks import LearnerShards, TensorRanks
from orca_lab.engine.batch import Batch, BatchTensors
from orca_lab.engine.policies import PAGED, _Victims
from orca_lab.engine.request import RequestState
from orca_lab.engine.scheduler import OrcaScheduler, RequestLevelScheduler, _MicroBatch, enqueue
from orca_lab.model.executor import LocalExecutor
from orca_lab.model.gpt import GPT, StateDictWeights


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
    slots of its K/V pool. CUDA graphs reserve their padding slots from the package's manager, so this
    engine runs without them."""
    old = engine.scheduler
    if old.name != "orca":
        raise ValueError(f"use_slots takes an engine of system 'orca', not {old.name!r}")
    kv = PluggedSlots(manager_class(old.kv.n_slots), as_tensor=old.kv.k is not None)
    engine.scheduler = OrcaScheduler(kv, old.max_bs)
    if getattr(engine.executor, "graphs", None) is not None:
        engine.executor.graphs = None
    return engine


def tensors_from(flat: dict, device) -> BatchTensors:
    """The learner's flattening (notebook 04: a dict of lists) as the ``BatchTensors`` the model reads."""
    host = {name: np.asarray(values, dtype=np.int64) for name, values in flat.items()}
    cu = torch.from_numpy(np.stack([host["cu_seqlens_q"], host["cu_seqlens_k"]]).astype(np.int32)).to(device)
    on = {name: torch.from_numpy(host[name]).to(device)
          for name in ("input_ids", "positions", "slot_mapping", "kv_slot_ids", "last_idx")}
    return BatchTensors(on["input_ids"], on["positions"], on["slot_mapping"], on["kv_slot_ids"], cu[0], cu[1],
                        on["last_idx"], host["cu_seqlens_q"], host["cu_seqlens_k"],
                        np.concatenate([host["slot_mapping"], host["kv_slot_ids"]]))


def use_flatten(engine, flatten):
    """Every batch ``engine`` (ORCA's, in this process) selects builds its iteration's tensors with the
    learner's ``flatten(requests)`` in place of ``BatchTensors.build``."""
    if engine.scheduler.name != "orca":
        raise ValueError(f"use_flatten takes an engine of system 'orca', not {engine.scheduler.name!r}")
    select = engine.scheduler.select

    def select_flattened(now: float = 0.0):
        batch = select(now)
        if batch is not None:
            batch.tensors = lambda device: tensors_from(flatten(batch.requests), device)
        return batch

    engine.scheduler.select = select_flattened
    return engine


class LearnerVictims(_Victims):
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
    (notebook 11). The block manager's spans are its only source of blocks: both go through here."""
    kv = engine.scheduler.kv
    if engine.scheduler.name not in PAGED:
        raise ValueError(f"use_blocks takes an engine of system {PAGED}, not {engine.scheduler.name!r}")
    if kv.n_reserved:
        raise ValueError("use_blocks takes a fresh engine: this one's blocks are already handed out")
    allocator, bs = allocator_class(kv.n_blocks), kv.block_size
    kv._take = lambda n: [(b * bs, (b + 1) * bs) for b in allocator.take(n // bs)]
    kv._give = lambda a, b: allocator.free(list(range(a // bs, b // bs)))
    return engine


class PluggedLookup:
    """A prefix cache (``PrefixCachingBlockManager``) whose lookup is the learner's: ``cached_prefix(
    cache, prompt, block_size)`` tokens found, the blocks named by ``block_hashes(tokens, block_size)``
    (notebook 12). The rest (sharing, registering, eviction) is the package's."""

    def __init__(self, kv, block_hashes, cached_prefix):
        self.kv, self.block_hashes, self.cached_prefix = kv, block_hashes, cached_prefix

    def __getattr__(self, name):
        return getattr(self.kv, name)

    def lookup(self, req) -> list[int]:
        kv, tokens = self.kv, req.prompt + req.output
        n = self.cached_prefix(MappingProxyType(kv.block_of), tokens, kv.block_size) // kv.block_size
        return [kv.block_of[h] for h in self.block_hashes(tokens, kv.block_size)[:n]]


def _recount(engine, use: str, refs_class=None, lru_class=None):
    """``engine``'s prefix cache counting its blocks' holders with ``refs_class(lru_class())`` (either
    None: the class it has); the blocks already free and cached (an earlier engine of its LLM left
    them) handed over, oldest first."""
    kv = engine.scheduler.kv
    if not hasattr(kv, "refs"):
        raise ValueError(f"{use} takes an engine with prefix caching (EngineConfig(prefix_caching=True))")
    if kv.n_holders:
        raise ValueError(f"{use} takes a fresh engine: {kv.n_holders} requests of this one hold blocks")
    old, n_cached = kv.refs, len(kv.lru)
    kv.lru = (lru_class or type(kv.lru))()
    kv.refs = (refs_class or type(old))(kv.lru)
    for _ in range(n_cached):
        block = old.evict()
        kv.refs.hold(block)
        kv.refs.release([block], kv.hash_of)
    return engine


def use_lru(engine, lru_class):
    """``engine`` (of an LLM with ``prefix_caching=True``) evicting with the learner's ``lru_class()``
    (notebook 12's ``BlockLRU``: ``freed``, ``used``, ``evict``, ``len``)."""
    return _recount(engine, "use_lru", lru_class=lru_class)


def use_refs(engine, refs_class):
    """``engine`` (of an LLM with ``prefix_caching=True``) counting who holds each block with the
    learner's ``refs_class(lru)`` (notebook 12's ``BlockRefs``: ``count``, ``hold``, ``release``,
    ``evict``), over the eviction order it has (the learner's too, after ``use_lru``)."""
    return _recount(engine, "use_refs", refs_class=refs_class)


def use_lookup(engine, block_hashes, cached_prefix):
    """``engine`` (fresh, of an LLM with ``prefix_caching=True``) finding each new request's cached
    prefix with the learner's functions. Only its scheduler sees them: the LLM keeps the package's
    cache for its later engines."""
    if not hasattr(engine.scheduler.kv, "block_of"):
        raise ValueError("use_lookup takes an engine with prefix caching (EngineConfig(prefix_caching=True))")
    engine.scheduler.kv = PluggedLookup(engine.scheduler.kv, block_hashes, cached_prefix)
    return engine


class PluggedFormation(RequestLevelScheduler):
    """The baseline whose batches are formed by the learner's ``form_batch(waiting, kv, max_bs,
    max_seq_len) -> (batch, first_q_len)`` (notebook 02): the requests it took from ``waiting`` with
    ``max_seq_len`` slots reserved each, and the shortest prompt (its first iteration's new tokens).
    The scheduler feeds the batch until its longest request is done, in micro-batches."""

    def __init__(self, kv, max_bs: int, max_seq_len: int, mbs: int | None, form_batch):
        super().__init__(kv, max_bs, max_seq_len, mbs)
        self.learner_form_batch = form_batch

    def _form_batch(self, now: float):
        batch, q_len = self.learner_form_batch(self.waiting, self.kv, self.max_bs, self.max_seq_len)
        self.active = list(batch)
        self.n_positions = max((r.max_tokens for r in self.active), default=1) - 1    # FT's fixed step count
        for req in self.active:
            req.t_scheduled = now
        self.micro = [_MicroBatch(self.active[i:i + self.mbs], 0, q_len) for i in range(0, len(self.active), self.mbs)]


def use_form_batch(engine, form_batch):
    """``engine`` (the baseline's, fresh) forming its batches with the learner's ``form_batch``."""
    old = engine.scheduler
    if old.name != "ft":
        raise ValueError(f"use_form_batch takes an engine of system 'ft', not {old.name!r}")
    engine.scheduler = PluggedFormation(old.kv, old.max_bs, old.max_seq_len, old.mbs, form_batch)
    return engine


class _Recorded:
    """``engine``'s executor as the learner's loop sees it (``submit``, ``wait``, ``clock``), keeping
    the engine's records: each batch numbered and timed as ``Engine.step`` does."""

    def __init__(self, engine):
        self.engine, self.clock = engine, engine.clock

    def submit(self, batch):
        e = self.engine
        batch.iteration, e._iteration = e._iteration, e._iteration + 1
        e.executor.submit(batch)
        e.n_scheduled += 1
        batch.at_submit = e._kv_snapshot()

    def wait(self, timeout=None):
        e = self.engine
        done = e.executor.wait()
        e.n_scheduled -= 1
        e._record(done)
        return done


def run_loop(engine, loop, trace):
    """Serve ``trace`` offline (every request there at the start) with the learner's ``loop(scheduler,
    executor, n_workers)`` (notebook 03, extended to ``n_workers`` batches in flight in 08) in place
    of ``Engine.run``'s: the engine's ``RunResult``."""
    start = engine.clock.now()
    for it in trace:
        engine.add_request(list(it.prompt), it.sampling_params(), arrival=start)
    guarded({"loop": loop})["loop"](engine.scheduler, _Recorded(engine), engine.n_workers)
    if engine.has_work():
        raise AssertionError(f"your loop returned with work left: {engine.scheduler.n_waiting} requests "
                             f"waiting, {engine.n_scheduled} batches in flight")
    return engine.result(start)


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
            if not 1 <= n <= has or spent["tokens"] + n > budget or spent["requests"] == max_bs:
                raise AssertionError(f"your fill_budget called run(request {getattr(req, 'rid', req)!r}, {n}): it "
                                     f"must be a request offered and not run yet, 1 <= n <= its {has} tokens, within "
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
PIECES = {"form_batch": ("02", "the baseline (ft)"), "select": ("03", "orca"), "flatten": ("04", "orca"),
          "SlotManager": ("05", "orca"), "split_linear": ("07", "tensor_ranks > 1, in this process"),
          "all_reduce": ("07", "tensor_ranks > 1, in this process"), "loop": ("03, 08", "run_loop: every system, offline"),
          "BlockAllocator": ("11", "paged, chunked"), "victim": ("11", "paged, chunked"),
          "fill_budget": ("11", "chunked"),
          "block_hashes": ("12", "prefix caching"), "cached_prefix": ("12", "prefix caching"),
          "BlockLRU": ("12", "prefix caching"), "BlockRefs": ("12", "prefix caching")}


def assemble(engine, pieces: dict, tensor_ranks: int = 1, bound_s: float | None = None) -> list[str]:
    """Plug every piece of ``pieces`` (``mine.load()``) that ``engine`` (fresh) has a place for; the
    names plugged, in order. The slot manager goes in first: the learner's ``select`` reserves from it.
    ``tensor_ranks`` above 1 runs the model on that many tensor-parallel ranks cut by the learner's split
    (refused, a ``ValueError``, without their ``split_linear`` and ``all_reduce``). Each piece runs
    bounded by ``bound_s`` a call and checked (``guards.py``): a fault stops the engine naming it."""
    pieces, system, plugged = guarded(pieces, bound_s), engine.scheduler.name, []
    model = getattr(engine.scheduler.kv, "k", None) is not None     # a model reads the batch's tensors

    def plug(names, use):
        if all(n in pieces for n in names):
            use(engine, *(pieces[n] for n in names))
            plugged.extend(names)

    if system == "orca":
        plug(["SlotManager"], use_slots)
        plug(["select"], use_select)
        if model:                                    # (the simulator reads no tensors)
            plug(["flatten"], use_flatten)
    if system == "ft":
        plug(["form_batch"], use_form_batch)
    if tensor_ranks > 1:
        if not {"split_linear", "all_reduce"} <= pieces.keys():
            raise ValueError(f"tensor_ranks={tensor_ranks}: the package has no split_linear and all_reduce "
                             "(notebook 07's exercises) to cut the model with")
        plug(["split_linear", "all_reduce"], lambda e, split, reduce: use_split_linear(e, split, reduce, tensor_ranks))
    if system in PAGED:
        plug(["BlockAllocator"], use_blocks)
        plug(["victim"], use_victim)
        if hasattr(engine.scheduler.kv, "refs"):
            plug(["BlockLRU"], use_lru)
            plug(["BlockRefs"], use_refs)
            plug(["block_hashes", "cached_prefix"], use_lookup)
    if system == "chunked":
        plug(["fill_budget"], use_budget)
    return plugged


def use_split_linear(engine, split_linear, all_reduce, T: int):
    """``engine`` (in this process, fresh) running its model on ``T`` tensor-parallel ranks, threads
    of this process (``tensor_ranks.py``): each rank's linear layers cut by the learner's
    ``split_linear(weight, bias, t, T, parallel)``, its partial outputs added by the learner's
    ``all_reduce(partials)`` (notebook 07)."""
    executor = engine.executor
    if not isinstance(executor, LocalExecutor) or not isinstance(executor.model, GPT):
        raise ValueError("use_split_linear takes an engine whose model runs in this process "
                         "(EngineConfig(executor='local'), tensor_parallel=1)")
    model = executor.model
    model.cfg.check_tensor_parallel(T)
    if model.cfg.kv_heads_on(T) * T != model.cfg.n_kv_heads:
        raise ValueError(f"T={T} exceeds n_kv_heads={model.cfg.n_kv_heads}: the ranks would share K/V heads, "
                         f"which a split of rows does not give: allowed T dividing {model.cfg.n_kv_heads}")
    weights = StateDictWeights(model.state_dict(), model.wte.weight.device, model.wte.weight.dtype)
    executor.model = TensorRanks(model.cfg, T, lambda t: LearnerShards(weights, model.cfg, split_linear, t, T),
                                 all_reduce, attention_backend=model.attention_backend,
                                 fused_ops_backend=model.fused_ops_backend, tf32=model.tf32)
    executor.graphs = None              # captured over the whole model
    return engine
