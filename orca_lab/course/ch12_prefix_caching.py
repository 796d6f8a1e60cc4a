"""Chapter 12, prefix caching: the graders of the block names, the cached-prefix lookup, the
eviction order and the reference counts, and their plug points, ``use_lookup``, ``use_lru`` and
``use_refs``."""
from __future__ import annotations

import random
from types import MappingProxyType

from orca_lab.course import harness
from orca_lab.course.bounded import (Bounded, PackageCode, TooSlow, an_int, as_answer, ints, refuse_package_code,
                                     run_bounded)
from orca_lab.course.forked import grader
from orca_lab.course.guards import answer_of, fault_of
from orca_lab.course.harness import N_CASES, Piece, check_by_hand, correct, differ, place_on, read, request, run_case
from orca_lab.engine.policies import PAGED
from orca_lab.engine.prefix_cache import BlockRefs, FreeCached, PrefixCachingBlockManager, chain_hashes
from orca_lab.engine.request import Request
from orca_lab.engine.sampling_params import SamplingParams


def _names(got) -> list[bytes]:
    """Block names as bytes themselves: an object of the learner's that says it equals any name is none."""
    names = list(got)
    if not all(type(n) is bytes for n in names):
        raise TypeError("block names are bytes")
    return names


@grader
def check_block_hashes(fn, seed: int = 0):
    """``fn(tokens, block_size) -> [name of each full block]``, each ``block_hash(parent's name,
    its tokens)``, against ``prefix_cache.chain_hashes`` on random token lists."""
    refuse_package_code(fn, chain_hashes)
    rng = random.Random(seed)
    for case in range(N_CASES):
        bs = rng.randint(1, 8)
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 5 * bs + 3))]
        label = f"case {case} (tokens {tokens}, block_size {bs})"
        got = read("the block names", label, run_bounded(fn, list(tokens), bs, case=label, references=(chain_hashes,)),
                   _names, "a list of block names (bytes, as block_hash gives them), one per full block")
        expected = chain_hashes(tokens, bs, len(tokens) // bs)
        if got != expected:
            hint = "one name per full block, none for a partial one at the end" if len(got) != len(expected) \
                else "the first block has no parent block" if got[:1] != expected[:1] \
                else "each later block's parent is the block before it: its name, not its tokens"
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


@grader
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
        got = read("the cached prefix (tokens)", label,
                   run_bounded(fn, dict(kv.block_of), list(prompt), bs, case=label, references=refs), an_int,
                   "a number of tokens")
        if got != expected:
            differ("the cached prefix (tokens)", label, expected, got, _lookup_hint(expected, got, prompt, bs))
    correct(N_CASES, "PrefixCachingBlockManager.lookup")


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
                out.append(("evict", as_answer(lru.evict())))
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


@grader
def check_block_lru(cls, seed: int = 0):
    """``cls()`` with ``freed(b)``, ``used(b)``, ``evict() -> b`` and ``len()`` against the prefix
    cache's ``FreeCached``, on random calls as the cache makes them."""
    refuse_package_code(cls, FreeCached)
    rng = random.Random(seed)
    for case in range(N_CASES):
        steps = _lru_steps(rng)
        label = f"case {case} (calls {[f'{op}({b})' if b is not None else f'{op}()' for op, b in steps]})"
        expected = lru_replay(FreeCached(), steps)
        got = run_case(lambda: lru_replay(run_bounded(cls, case=label, references=(FreeCached,)), steps), label=label)
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


@grader
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
        refs = Bounded(run_bounded(cls, lru, case=label, references=(BlockRefs,), timeout_s=harness.CASE_S),
                       case=label, references=(BlockRefs,), timeout_s=harness.CASE_S)
        got = refs_replay(refs, lru, calls, n_blocks)
        for i, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                differ(f"call {i}, {_call(calls[i])}", f"{label}, after the calls {[_call(c) for c in calls[:i]]}",
                       _answer(a), _answer(b), _refs_hint(calls[i], a, b, expected[i - 1] if i else (None, {}, [])))
        if len(got) != len(expected):
            raise AssertionError(f"{label}: your BlockRefs stopped answering after call {len(got)}")
    correct(N_CASES, "PrefixCachingBlockManager's reference counts")


class PluggedLookup:
    """A prefix cache (``PrefixCachingBlockManager``) whose lookup is the learner's: ``cached_prefix(
    cache, prompt, block_size)`` tokens found, the blocks named by ``block_hashes(tokens, block_size)``
    (notebook 12). The rest (sharing, registering, eviction) is the package's."""

    def __init__(self, kv, block_hashes, cached_prefix):
        self.kv, self.block_hashes, self.cached_prefix = kv, block_hashes, cached_prefix

    def __getattr__(self, name):
        return getattr(self.kv, name)

    def lookup(self, req) -> list[int]:
        """The blocks the learner's functions find, checked against the package's lookup on the same
        cache before the engine shares them: names or a count that differ (a prompt the graders never
        met) stop the engine naming the function, never hand a request blocks of another prefix."""
        kv, bs = self.kv, self.kv.block_size
        if req.params.prompt_logprobs is not None:     # every prompt position is scored: none cached
            return []
        tokens = req.prompt + req.output
        names = answer_of(self.block_hashes, "block_hashes", self.block_hashes(tokens, bs), _names)
        n = answer_of(self.cached_prefix, "cached_prefix",
                      self.cached_prefix(MappingProxyType(kv.block_of), tokens, bs), an_int)
        found, m = kv.lookup(req), (len(tokens) - 1) // bs      # (the package's names: req.block_hashes)
        if names[:m] != req.block_hashes[:m]:
            raise fault_of(self.block_hashes, "block_hashes", f"named the blocks of request {req.rid} "
                           f"({len(tokens)} tokens, block_size {bs}) other than the package's chain of hashes")
        if n != len(found) * bs:
            raise fault_of(self.cached_prefix, "cached_prefix", f"found {n} tokens of request {req.rid} cached "
                           f"where its first {len(found)} blocks are ({len(found) * bs} tokens, block_size {bs})")
        return found


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
    counts = (refs_class or type(getattr(old, "counts_of", old)))(kv.lru)
    for _ in range(n_cached):
        block = old.evict()
        counts.hold(block)
        counts.release([block], kv.hash_of)
    kv.refs = CheckedRefs(counts, kv, lru_class or getattr(old, "lru_piece", None),
                          refs_class or getattr(old, "refs_piece", None))
    return engine


class CheckedRefs:
    """The cache's reference counts as the engine calls them, the learner's (or over their LRU), each
    eviction and release checked against the block tables before the cache reuses a block: a block
    some request holds, handed to another, would have its K/V overwritten under it (wrong text)."""

    def __init__(self, counts, kv, lru_piece, refs_piece):
        self.counts_of, self.kv, self.lru_piece, self.refs_piece = counts, kv, lru_piece, refs_piece

    def __getattr__(self, name):
        return getattr(self.counts_of, name)

    def evict(self) -> int:
        obj, name = (self.refs_piece, "BlockRefs") if self.refs_piece is not None else (self.lru_piece, "BlockLRU")
        b = answer_of(obj, name, self.counts_of.evict(), an_int)
        held = b in self.kv.held_blocks()
        if held or b not in self.kv.hash_of:
            raise fault_of(obj, name, f"evicted block {b}, which " + ("a request holds: its K/V would be overwritten "
                           "under it" if held else "is not a cached block"))
        return b

    def release(self, blocks: list[int], cached) -> list[int]:
        freed = self.counts_of.release(blocks, cached)
        if self.refs_piece is None:
            return freed
        freed = answer_of(self.refs_piece, "BlockRefs", freed, ints)
        held = self.kv.held_blocks()                 # (the releasing request's table is already gone)
        wrong = set(freed) - set(blocks) or set(freed) & held
        if wrong or len(set(freed)) != len(freed):
            raise fault_of(self.refs_piece, "BlockRefs", f"released {sorted(wrong) or freed} for a request holding "
                           f"{list(blocks)}: a block another request holds (or none of this one's, or one twice) "
                           "would go back to the pool")
        kept = set(blocks) - held - set(freed)
        if kept:
            raise fault_of(self.refs_piece, "BlockRefs", f"kept {sorted(kept)} counted for a request holding "
                           f"{list(blocks)}, though no request holds them any more: they would never be cached "
                           "or reused (the pool leaks them)")
        return freed


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


_CACHED = place_on(*PAGED, when=lambda engine: hasattr(engine.scheduler.kv, "refs"))
_LOOKUP = dict(plugged=("block_hashes", "cached_prefix"), place=_CACHED)
# in the order they plug: the counts take over the eviction order they are given, the lookup wraps the cache
PIECES = (Piece("BlockLRU", "12", "prefix caching", check_block_lru, use_lru, place=_CACHED),
          Piece("BlockRefs", "12", "prefix caching", check_block_refs, use_refs, place=_CACHED),
          Piece("block_hashes", "12", "prefix caching", check_block_hashes, use_lookup, **_LOOKUP),
          Piece("cached_prefix", "12", "prefix caching", check_prefix_lookup, use_lookup, **_LOOKUP))


def check_hit_tokens(hit_tokens, prefill_tokens):
    """Notebook 12's by-hand lookup, read from ``PrefixCachingBlockManager``'s accounting: a 30-token
    prompt computed and freed, then a 37-token one starting with the same 30, on blocks of 8. A wrong
    count is named with its hint, never the package's (the exercise's answer)."""
    kv = PrefixCachingBlockManager(64 * 8, 8)
    _serve_and_free(kv, 0, list(range(30)))
    second = Request(1, list(range(30)) + [99] * 7, SamplingParams(max_gen_tokens=1))
    kv.share(second, kv.lookup(second))
    check_by_hand("a 37-token prompt after a 30-token one it starts with, block_size 8", {
        "hit_tokens": (hit_tokens, kv.hit_tokens,
                       "a block is found cached only if it was full: a partly written block has no name"),
        "prefill_tokens": (prefill_tokens, len(second.prompt) - second.n_cached,
                           "what the prompt has beyond its cached blocks, computed from the first block not found")})
    print(f"correct: {hit_tokens} tokens found cached, {prefill_tokens} prefilled")
