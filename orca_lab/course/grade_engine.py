"""Graders of the exercises that write a piece of the learner's engine (``mine.py``), bounded: each
case runs the learner's code in a thread with a time limit and the driving loop with an iteration
cap, so code that loops forever or never returns stops the check with the case it was given, not the
notebook. The first case that differs is named, with both answers labelled."""
from __future__ import annotations

import functools
import random

import torch
import torch.nn.functional as F

from orca_lab.config import EngineConfig, ModelConfig
from orca_lab.course.bounded import Bounded, PackageCode, TooSlow, refuse_package_code, run_bounded
from orca_lab.course.grade import Mismatch, correct, differ, mismatch
from orca_lab.course.plug import PluggedFormation, _Recorded
from orca_lab.distributed.data_plane import DataPlane
from orca_lab.engine import policies
from orca_lab.engine.engine import Engine
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.prefix_cache import BlockRefs, FreeCached, PrefixCachingBlockManager
from orca_lab.engine.request import Request
from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.engine.scheduler import RequestLevelScheduler
from orca_lab.llm import LLM
from orca_lab.model.tensor_parallel import even_range, shard_ranges

N_CASES = 40
CASE_S = 10.0          # wall time a case may take (a few ms when right)
MAX_ITERATIONS = 2000  # scheduler steps a case may take (tens when right)


class Stuck(TooSlow):
    """The learner's code did not return within a case's time or iteration bound."""


def bounded(fn, *args, label: str, seconds: float | None = None):
    """``fn(*args)`` (the grader's driver of the learner's code) under ``run_bounded``, bounded by
    ``seconds`` (``CASE_S`` when None); past it, ``Stuck`` naming ``label``."""
    try:
        return run_bounded(fn, *args, timeout_s=CASE_S if seconds is None else seconds, case=label, what="code")
    except TooSlow as e:
        raise Stuck(str(e)) from None


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
    out = []
    for op, b in steps:
        try:
            if op == "evict":
                out.append(("evict", lru.evict()))
            else:
                getattr(lru, op)(b)
            out.append(("len", len(lru)))
        except Exception as e:           # the learner's: shown at the call that raised it
            if isinstance(lru, FreeCached):
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
    cache's ``FreeCached``, on random calls as the cache makes them."""
    refuse_package_code(cls, FreeCached)
    rng = random.Random(seed)
    for case in range(N_CASES):
        steps = _lru_steps(rng)
        label = f"case {case} (calls {[f'{op}({b})' if b is not None else f'{op}()' for op, b in steps]})"
        expected = lru_replay(FreeCached(), steps)
        got = bounded(lambda: lru_replay(run_bounded(cls, case=label, references=(FreeCached,)), steps), label=label)
        for i, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                differ(f"answer {i} ({a[0]})", label, a[1], b[1], _lru_hint(a, b, steps, _step_of(expected, i)))
    correct(N_CASES, "PrefixCachingBlockManager's eviction order")


def _step_of(answers, i: int) -> int:
    """The step that gave answer ``i`` (each step answers its length, an eviction its block first)."""
    return sum(kind == "len" for kind, _ in answers[:i])


# -- 12: the prefix cache's reference counts --------------------------------------------------------
class _Recording(BlockRefs):
    """The package's counts, writing down the calls the prefix cache makes on them (of a release's
    ``cached``, the request's blocks that are)."""

    def __init__(self, lru):
        super().__init__(lru)
        self.calls = []

    def hold(self, block):
        self.calls.append(("hold", block))
        super().hold(block)

    def release(self, blocks, cached):
        self.calls.append(("release", list(blocks), sorted(b for b in blocks if b in cached)))
        return super().release(blocks, cached)

    def evict(self):
        self.calls.append(("evict",))
        return super().evict()


def _refs_calls(rng) -> tuple[int, list]:
    """A pool of a few blocks, and the calls its prefix cache makes on its counts while random
    requests sharing two prefixes come, several at a time, and leave in random order."""
    bs, n_blocks = 2, rng.randint(4, 9)
    kv = PrefixCachingBlockManager(n_blocks * bs, bs)
    kv.refs = _Recording(kv.lru)
    stems = [[rng.randrange(3) for _ in range(4 * bs)] for _ in range(2)]
    live = []
    for rid in range(rng.randint(3, 9)):
        while live and (len(live) > 2 or rng.random() < 0.3):
            kv.release(live.pop(rng.randrange(len(live))))
        prompt = rng.choice(stems)[:rng.randint(0, 4 * bs)] + [rng.randrange(3) for _ in range(rng.randint(1, 3))]
        req = Request(rid, prompt, SamplingParams(max_gen_tokens=1))
        hit = kv.lookup(req)
        if kv.can_admit(len(prompt) - len(hit) * bs, hit):
            kv.share(req, hit)
            kv.grow(req, len(prompt))
            kv.cache(req, len(prompt))
            live.append(req)
    while live:
        kv.release(live.pop(rng.randrange(len(live))))
    return n_blocks, kv.refs.calls


def _call(call) -> str:
    return {"hold": lambda: f"hold({call[1]})", "evict": lambda: "evict()",
            "release": lambda: f"release({call[1]}, cached={set(call[2]) or '{}'})"}[call[0]]()


def refs_replay(refs, lru, calls, n_blocks: int) -> list:
    """What ``refs`` answers along ``calls``: after each, what it returned, the counts above 0 and
    the free cached blocks in ``lru``, least recently freed first; a learner's exception ends it."""
    out = []
    for call in calls:
        try:
            if call[0] == "hold":
                got = None
                refs.hold(call[1])
            elif call[0] == "release":
                got = refs.release(list(call[1]), set(call[2]))
                got = list(got) if isinstance(got, (list, tuple)) else got
            else:
                got = refs.evict()
            counts = {b: n for b in range(n_blocks) if (n := refs.count(b))}
        except (TooSlow, PackageCode):
            raise
        except Exception as e:            # the learner's: shown at the call that raised it
            if isinstance(refs, BlockRefs):
                raise
            return out + [("raised", f"{type(e).__name__}: {e}")]
        out.append((got, counts, list(lru)))
    return out


def _answer(x) -> str:
    if x[0] == "raised":
        return f"raised {x[1]}"
    return f"returned {x[0]}, counts {x[1]}, free cached (least recently freed first) {x[2]}"


def _refs_hint(call, expected, got, before) -> str:
    op, (e_ret, e_counts, e_lru) = call[0], expected
    if got[0] == "raised":
        if op == "hold" and call[1] not in before[2]:
            return (f"block {call[1]} comes from the pool (never used, or evicted), not from the LRU: a block "
                    "no request holds and the LRU does not hold has no count (release forgets an uncached "
                    "one, evict() the one it evicts), so hold leaves the LRU alone")
        return f"your {op}() raised {got[1]} where the package's answers {e_ret}"
    ret, counts, lru = got
    if any(n < 0 for n in counts.values()):
        return "a count went below 0: each hold adds one, each release takes one (a block released twice?)"
    if op == "hold":
        if call[1] in lru:
            return ("a held block left in the LRU (it would be evicted while held): hold(b) of a free cached "
                    "block (count 0) takes it out, lru.used(b)")
        return "hold(b) adds one to b's count: a block found cached may be held by other requests already"
    if op == "evict":
        if ret != e_ret:
            return "evict(): the LRU's least recently freed block (lru.evict())"
        return "evict() forgets the block's count: it goes back to the pool"
    freed = ret if isinstance(ret, list) else []
    held = [b for b in freed + lru if e_counts.get(b)]
    if held:
        return (f"block {held[0]} was freed while another request still holds it (count {e_counts[held[0]]} "
                "after this release): a block is free only when its count reaches 0")
    if set(lru) - set(call[2]):
        return "only a cached block (b in cached) waits in the LRU: the others go back to the pool"
    if (sorted(freed), sorted(lru)) == (sorted(e_ret), sorted(e_lru)):
        return "free a request's blocks from its last to its first (reversed): its tail is evicted before its head"
    if set(e_lru) - set(lru):
        return "a freed cached block goes into the LRU, as the most recently freed: lru.freed(b)"
    if counts != e_counts:
        return "release takes one off the count of each of the request's blocks"
    return "release returns the blocks whose count reached 0, in the order they were freed"


def check_block_refs(cls, seed: int = 0):
    """``cls(lru)`` with ``count(b)``, ``hold(b)``, ``release(blocks, cached) -> freed`` and ``evict()
    -> b`` against the prefix cache's ``BlockRefs``, call by call, on the calls the cache makes while
    random requests sharing prefixes come and go on a pool small enough to evict."""
    refuse_package_code(cls, BlockRefs)
    rng = random.Random(seed)
    for case in range(N_CASES):
        n_blocks, calls = _refs_calls(rng)
        expected = refs_replay(BlockRefs(lru := FreeCached()), lru, calls, n_blocks)
        label, lru = f"case {case} ({n_blocks} blocks)", FreeCached()
        refs = Bounded(run_bounded(cls, lru, case=label, references=(BlockRefs,), timeout_s=CASE_S),
                       case=label, references=(BlockRefs,), timeout_s=CASE_S)
        got = refs_replay(refs, lru, calls, n_blocks)
        for i, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                differ(f"call {i}, {_call(calls[i])}", f"{label}, after the calls {[_call(c) for c in calls[:i]]}",
                       _answer(a), _answer(b), _refs_hint(calls[i], a, b, expected[i - 1] if i else (None, {}, [])))
        if len(got) != len(expected):
            raise AssertionError(f"{label}: your BlockRefs stopped answering after call {len(got)}")
    correct(N_CASES, "PrefixCachingBlockManager's reference counts")


# -- 07: a tensor-parallel split of a linear layer, and its all-reduce -------------------------------
def _package_shard(weight, bias, t: int, T: int, parallel: str):
    """Rank ``t``'s ``(weight, bias)`` as ``shard_ranges`` cuts the model's linears (``even_range``):
    column-parallel, rows (outputs) of the weight and the same entries of the bias; row-parallel,
    columns (inputs) and no bias (the layer adds it once, after the all-reduce)."""
    dim = 0 if parallel == "column" else 1
    lo, hi = even_range(weight.shape[dim], t, T)
    return weight.narrow(dim, lo, hi - lo), bias[lo:hi] if dim == 0 and bias is not None else None


def _span(weight, w, dim: int):
    """``(lo, hi)`` when ``w`` is ``weight``'s slice ``[lo, hi)`` along ``dim``, else None."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1 - dim] != weight.shape[1 - dim]:
        return None
    n = w.shape[dim]
    return next(((lo, lo + n) for lo in range(weight.shape[dim] - n + 1)
                 if torch.equal(weight.narrow(dim, lo, n), w)), None)


def _slice_of(weight, w) -> str:
    for dim in (0, 1):
        where = _span(weight, w, dim)
        if where is not None:
            return f"{('rows', 'columns')[dim]} [{where[0]}, {where[1]}) of weight"
    return f"a tensor of shape {tuple(w.shape)}, not weight's rows or columns"


def _values(t) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return f"shape {tuple(t.shape)}, first values {[round(v, 4) for v in t.flatten()[:4].tolist()]}"


def _split_hint(weight, ws, dim: int, T: int) -> str:
    n, what = weight.shape[dim], ("rows (its outputs)", "columns (its inputs)")[dim]
    spans = [_span(weight, w, dim) for w in ws]
    if T > 1 and None in spans and all(_span(weight, w, 1 - dim) for w in ws):
        return (f"split along the wrong dimension: a {('column', 'row')[dim]}-parallel rank keeps weight's {what} "
                "(nn.Linear stores weight as [out_features, in_features])")
    if None in spans:
        return f"each rank's weight is one contiguous slice of weight's {what}, [lo, hi)"
    rows = [i for lo, hi in spans for i in range(lo, hi)]
    if len(set(rows)) < len(rows):
        return "overlapping shards: rank t starts where rank t-1 ends, every row on exactly one rank"
    if len(rows) < n:
        return (f"missing rows when T does not divide {n}: {n} // {T} per rank leaves {n % T} to no rank; the first "
                f"{n} % {T} ranks take one more" if n % T else "missing rows: every row on exactly one rank")
    if spans != sorted(spans):
        return "the shards in rank order: rank 0 the first rows"
    return "uneven shards: sizes differ by at most one, the first n % T ranks one more (as torch.tensor_split)"


def _bias_hint(parallel: str) -> str:
    if parallel == "row":
        return ("bias added on every rank before the sum: the T partials would carry T x bias. A row-parallel "
                "rank's linear has no bias (None); the layer adds it once, after the all-reduce")
    return "a column-parallel rank keeps the bias entries of its own outputs, bias[lo:hi] (None when bias is None)"


def _reduce_hint(got, partials) -> str:
    whole = torch.stack(partials).sum(0)
    if not isinstance(got, torch.Tensor) or got.shape != whole.shape:
        if isinstance(got, torch.Tensor) and got.shape[-1] == whole.shape[-1] * len(partials):
            return "concatenates the partials: an all-reduce adds them elementwise, each the whole output's shape"
        return f"return one tensor of the partials' shape {tuple(whole.shape)}"
    if len(partials) > 1 and torch.allclose(got, whole / len(partials), atol=1e-5):
        return "averages instead of sums: each rank's partial is a share of the output, not an estimate of it"
    if any(torch.allclose(got, p, atol=1e-5) for p in partials):
        return "one rank's partial: the output is the sum of all T"
    return "the elementwise sum of the T partial outputs"


def _pair(got, label: str, rank: int):
    ok = (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor)
          and (got[1] is None or isinstance(got[1], torch.Tensor)))
    if not ok:
        differ(f"rank {rank}'s shard", label, "(weight_t, bias_t): a tensor, and a tensor or None", repr(got),
               "return the pair (weight_t, bias_t)")
    return got


def check_split_linear(split_linear, all_reduce, seed: int = 0):
    """``split_linear(weight, bias, t, T, parallel) -> (weight_t, bias_t)`` against the package's cut
    of the model's linears (``shard_ranges``, ``even_range``), rank by rank, for T in 1..4 on random
    shapes (T dividing them or not); then the T ranks' outputs of a row-parallel layer, added by
    ``all_reduce(partials)`` and the bias once, against the unsplit ``F.linear(x, weight, bias)``."""
    refs = (_package_shard, even_range, shard_ranges, DataPlane.all_reduce)
    refuse_package_code(split_linear, *refs)
    refuse_package_code(all_reduce, *refs)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for case in range(N_CASES):
        T = (2, 3, 4, 1)[case % 4]
        d_out, d_in, n = rng.randint(T, 3 * T + 3), rng.randint(T, 3 * T + 3), rng.randint(1, 4)
        weight, x = torch.randn(d_out, d_in, generator=g), torch.randn(n, d_in, generator=g)
        bias = torch.randn(d_out, generator=g) if rng.random() < 0.75 else None
        for dim, parallel in enumerate(("column", "row")):
            label = (f"case {case} (weight [{d_out}, {d_in}], bias {'None' if bias is None else [d_out]}, T={T}, "
                     f"parallel={parallel!r})")
            got = [_pair(run_bounded(split_linear, weight.clone(), None if bias is None else bias.clone(), t, T,
                                     parallel, case=f"{label}, rank {t}", references=refs), label, t)
                   for t in range(T)]
            for t, ((w, b), (w_ref, b_ref)) in enumerate(zip(got, (_package_shard(weight, bias, t, T, parallel)
                                                                  for t in range(T)))):
                if not (w.shape == w_ref.shape and torch.equal(w, w_ref)):
                    differ(f"rank {t}'s weight", label, _slice_of(weight, w_ref), _slice_of(weight, w),
                           _split_hint(weight, [s[0] for s in got], dim, T))
                if (b is None) != (b_ref is None) or b is not None and not torch.equal(b, b_ref):
                    show = lambda v: "None" if v is None else f"bias of shape {tuple(v.shape)}"  # noqa: E731
                    differ(f"rank {t}'s bias", label, show(b_ref), show(b), _bias_hint(parallel))
        partials = [F.linear(x[:, slice(*even_range(d_in, t, T))], w) for t, (w, _) in enumerate(got)]
        label = f"case {case} (x [{n}, {d_in}], weight [{d_out}, {d_in}], T={T} row-parallel partials)"
        whole = run_bounded(all_reduce, [p.clone() for p in partials], case=label, references=refs)
        expected = F.linear(x, weight, bias)
        out = whole + bias if isinstance(whole, torch.Tensor) and bias is not None and whole.shape == expected.shape \
            else whole
        if not (isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.allclose(out, expected, atol=1e-5)):
            differ("the layer's output (your all_reduce of the ranks' partials, then the bias once)", label,
                   f"F.linear(x, weight, bias): {_values(expected)}", _values(out), _reduce_hint(whole, partials))
    correct(N_CASES, "the package's split (shard_ranges) and the unsplit F.linear")


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
