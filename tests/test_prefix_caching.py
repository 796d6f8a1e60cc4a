"""Prefix caching (engine/prefix_cache.py): the same tokens with it as without, for every request,
greedy and seeded sampled, in process (paged, chunked), on a 1x2 gloo pipeline and over HTTP; the cache
is its K/V memory's (two LLMs on one worker pool, pools closed and replaced: each request's own tokens); under a
pool smaller than the shared prefixes, cached blocks are evicted, held ones never, and nothing leaks;
the block hashes, reference counts and LRU against a plain reference on random operations; the
refusals; the cache-aware order's starvation; the simulator's batches against the engine's."""
import asyncio
import hashlib
import json
import os
import random
import signal
import struct
from collections import OrderedDict

import httpx
import pytest
import torch
from hypothesis import given, settings, strategies as st

from orca_lab import LLM, EngineConfig, SamplingParams
from orca_lab.cli import main
from orca_lab.distributed.pool import WorkerPool
from orca_lab.engine import prefix_cache
from orca_lab.engine.engine import Engine
from orca_lab.engine.kv_manager import KVPool
from orca_lab.engine.policies import new_kv, new_scheduler
from orca_lab.engine.prefix_cache import PrefixCachingBlockManager, chain_hashes
from orca_lab.engine.request import Request
from orca_lab.model.executor import LocalExecutor
from orca_lab.serving.launch import ServerProcess
from orca_lab.sim.cost import AnalyticalCost
from orca_lab.sim.sweep import Curve
from orca_lab.sim.backends import SimBackend
from orca_lab.workload import TraceItem, few_shot_trace, mooncake_reuse, mooncake_trace, multi_turn_trace, prefix_reuse


from server_helpers import metrics

BS = 8
SETTINGS = dict(max_bs=4, n_slots=1024, block_size=BS, max_num_batched_tokens=24)


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def make_waves(vocab=256, seed=0):
    """Two waves of requests: the second re-sends prefixes of the first (a shared system prompt, a
    conversation's next turn, a prompt exactly a whole number of blocks long); two seeded sampled."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(vocab) for _ in range(n)]
    system, turn = tok(27), tok(13)
    first = [system + tok(5), system + turn, tok(32), tok(9)]
    second = [system + tok(11), system + turn + tok(7) + tok(4), list(first[2]), system + tok(3),
              first[2] + tok(20), system[:16]]
    params = lambda i: SamplingParams(max_gen_tokens=3 + i % 5, temperature=0.8 if i % 4 == 3 else 0.0,
                                      top_k=20 if i % 4 == 3 else 0, seed=50 + i if i % 4 == 3 else None)
    return [[(p, params(i)) for i, p in enumerate(first)], [(p, params(i + 4)) for i, p in enumerate(second)]]


WAVES = make_waves()


def run_waves(engine, waves=WAVES, check=None):
    """Each wave served to its end before the next is added (the second finds the first's blocks)."""
    reqs = []
    for wave in waves:
        reqs += [engine.add_request(p, sp) for p, sp in wave]
        while engine.has_work():
            engine.step()
            if check is not None:
                check(engine.scheduler.kv)
    return reqs


@pytest.fixture(scope="module")
def want(tiny_llm):
    """Without prefix caching, paged (the same batches as with it: the waves run apart)."""
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(**SETTINGS))
    return [list(r.output) for r in run_waves(llm.new_engine("paged"))]


def assert_clean(kv):
    """Every block free or cached with reference count 0: nothing held, nothing lost."""
    assert (kv.n_reserved, kv.n_used, kv.n_holders) == (0, 0, 0)
    assert all(kv.refs.counts[b] == 0 for b in kv.lru) and set(kv.refs.counts) == set(kv.lru)
    free = sum(b - a for a, b in kv._spans) // kv.block_size
    assert free + len(kv.lru) == kv.n_blocks
    assert set(kv.lru) == set(kv.hash_of)


def check_invariants(kv):
    """Held blocks are counted by their holders and never cached-free; counters match the tables."""
    held = {}
    for rid in kv._holders:
        for b in kv._blocks[rid]:
            held[b] = held.get(b, 0) + 1
    assert {b: n for b, n in kv.refs.counts.items() if n} == held
    assert not set(held) & set(kv.lru)
    assert kv.n_reserved == len(held) * kv.block_size
    assert kv.n_used == kv.stats().used


@pytest.mark.parametrize("system", ["paged", "chunked"])
def test_greedy_and_seeded_outputs_equal_without_caching_in_process(tiny_llm, want, system):
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(prefix_caching=True, **SETTINGS))
    engine = llm.new_engine(system)
    reqs = run_waves(engine, check=check_invariants)
    assert [list(r.output) for r in reqs] == want
    df = engine.result().requests_df()
    hits = list(df["prefix_hit_tokens"])
    assert hits[4:] == [24, 40, 24, 24, 32, 8], hits      # full blocks short of each prompt's last token
    kv = engine.scheduler.kv
    assert kv.hit_tokens == sum(hits) and kv.query_tokens == df["prompt_len"].sum()
    assert_clean(kv)


def test_an_llm_keeps_its_cache_from_one_engine_to_the_next_until_reset(tiny_llm):
    """As vLLM's LLM: the next engine (the next ``generate``) finds the blocks of the one before,
    paged or chunked alike, until ``reset_prefix_cache``; the counters are per engine."""
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(prefix_caching=True, **SETTINGS))
    prompt = [p for p, _ in WAVES[0]][1]                              # 40 tokens: 4 blocks findable
    hits = []
    for system in ("paged", "chunked", "paged", "reset", "chunked"):
        if system == "reset":
            llm.reset_prefix_cache()
            continue
        engine = llm.new_engine(system)
        req = engine.add_request(prompt, SamplingParams(max_gen_tokens=2))
        while engine.has_work():
            engine.step()
        assert engine.stats().prefix_hit_tokens == req.n_prefix_hit
        hits.append(req.n_prefix_hit)
    assert hits == [0, 32, 32, 0]
    assert llm.generate([prompt], max_gen_tokens=2, system="paged") == [list(req.output)]


def test_a_pipeline_of_worker_processes_gives_the_same_tokens(tiny_llm, want):
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(prefix_caching=True, pipeline_parallel=2, **SETTINGS))
    with WorkerPool(llm):
        for system in ("paged", "chunked"):
            engine = llm.new_engine(system)
            assert [list(r.output) for r in run_waves(engine)] == want, system
            assert engine.scheduler.kv.hit_tokens > 0
            engine.close()


# prefix caching x every executor: in process, tensor-parallel workers, pipeline-parallel workers
EXECUTORS = {"in process": {}, "workers tp=2": dict(tensor_parallel=2), "workers pp=2": dict(pipeline_parallel=2)}
PROMPTS = [[p for p, _ in WAVES[0]][1], [5, 6, 7]]       # 40 tokens (4 blocks findable) and 3


def ask(llm, system: str, want, prompts=PROMPTS) -> int:
    """What one ``generate`` does (``LLM._run``: a new engine, its requests, closed): the greedy
    tokens must be each prompt's alone; returns the tokens found cached."""
    return ask_engine(llm.new_engine(system), want, prompts)


def ask_engine(engine, want, prompts=PROMPTS) -> int:
    try:
        reqs = [engine.add_request(p, SamplingParams(max_gen_tokens=4, ignore_eos=True)) for p in prompts]
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
    assert [list(r.output) for r in reqs] == want, engine.scheduler.name
    return sum(r.n_prefix_hit for r in reqs)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_kept_cache_never_outlives_the_kv_memory_it_indexes(tiny_llm, executor):
    """Two consecutive engines (paged, then chunked) at each stage of a worker pool's life: none
    attached (each engine starts and stops workers of its own), a pool opened, closed, then another
    opened, broken and replaced. The cache is kept only while the memory it names lives: its hits
    come from the same pool, and every token equals the prompt's run alone."""
    want = tiny_llm.generate(PROMPTS, 4, ignore_eos=True)
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(prefix_caching=True, **EXECUTORS[executor], **SETTINGS))
    twice = lambda: [ask(llm, system, want) for system in ("paged", "chunked")]
    if executor == "in process":          # one pool for the LLM's life
        assert twice() + twice() == [0, 32, 32, 32]
        assert llm.generate(PROMPTS, 4, "paged", ignore_eos=True) == want
        return
    assert twice() == [0, 0]              # no pool: the workers, and their K/V, end with each engine
    assert llm.generate(PROMPTS, 4, "chunked", ignore_eos=True) == want
    with WorkerPool(llm):
        assert twice() == [0, 32]
    assert twice() == [0, 0]              # closed: engines start their own again
    broken = WorkerPool(llm)
    assert twice() == [0, 32]
    os.kill(broken.pids[-1], signal.SIGKILL)
    with pytest.raises(RuntimeError, match="worker rank"):      # the dead one, or a peer that lost it
        ask(llm, "paged", want)
    assert broken.broken
    with WorkerPool(llm):                 # its replacement: empty K/V, so an empty cache
        assert twice() == [0, 32]


# -- the cache is the K/V memory's: whoever writes into it, whichever LLM or engine, goes through it --
SHARED = dict(max_bs=4, n_slots=256, block_size=BS, max_num_batched_tokens=24)   # 32 blocks: B writes A's
OTHERS = [PROMPTS[0][:24] + [7] * 16, list(range(100, 140))]     # B's: one shares A's first 3 blocks
WRITERS = {"orca": ("orca", False), "paged uncached": ("paged", False), "paged": ("paged", True),
           "chunked": ("chunked", True)}


@pytest.fixture(scope="module")
def shared_pool():
    """One worker process lent to every LLM of the tests below: the tiny preset at seed 1 (tiny_llm's
    weights, which the worker builds itself), prefix caching on."""
    llm = LLM("tiny", seed=1, engine=EngineConfig(prefix_caching=True, executor="workers", **SHARED))
    with WorkerPool(llm) as pool:
        yield llm, pool


def alone(tiny_llm, prompts):
    """Each prompt's greedy tokens run alone, without a cache."""
    return [tiny_llm.generate([p], 4, ignore_eos=True)[0] for p in prompts]


def engine_over(memory, model, system: str, caching: bool):
    """An engine built from the registry's parts over one ``KVPool`` in this process (as
    ``LLM.new_engine`` builds its own): a writer of that memory that is no LLM's."""
    kv = new_kv(system, memory.n_slots, BS, prefix_caching=caching, pool=memory)
    sched = new_scheduler(system, kv, SHARED["max_bs"], model.cfg.max_seq_len, None, SHARED["max_num_batched_tokens"])
    return Engine(sched, LocalExecutor(model, kv), model.cfg.vocab_size, model.cfg.max_seq_len)


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("executor", ["in process", "workers"])
def test_two_writers_of_one_kv_memory_go_through_its_one_cache(tiny_llm, shared_pool, executor, writer):
    """A's prompts, then B's (another LLM on A's worker pool; in this process, another engine over
    A's K/V pool), then A's again: every request's tokens are its own alone. B overwrites blocks A's
    cache named unless it writes through that cache: a writer that does not cache drops it (A finds
    nothing again), one that caches shares it (B finds A's blocks: one pool, one set of weights)."""
    system, caching = WRITERS[writer]
    want, want_b = alone(tiny_llm, PROMPTS), alone(tiny_llm, OTHERS)
    if executor == "workers":
        a, pool = shared_pool
        a.reset_prefix_cache()
        b = LLM(gpt=a.model, seed=1, engine=a.engine_config.replace(prefix_caching=caching))
        pool.attach(b)
        first, then, again = ask(a, "paged", want), ask(b, system, want_b, OTHERS), ask(a, "chunked", want)
    else:
        memory = KVPool(SHARED["n_slots"], tiny_llm.cfg.n_layers, tiny_llm.cfg.n_kv_heads, tiny_llm.cfg.head_dim)
        a = lambda s: engine_over(memory, tiny_llm.model, s, True)
        first = ask_engine(a("paged"), want)
        then = ask_engine(engine_over(memory, tiny_llm.model, system, caching), want_b, OTHERS)
        again = ask_engine(a("chunked"), want)
    assert (first, then, again) == ((0, 24, 32) if caching else (0, 0, 0))


def test_a_pool_closed_or_replaced_takes_its_cache_and_reset_empties_the_one_in_use(tiny_llm, shared_pool):
    """A's cache stays with the pool it indexes when A moves to another pool (B, on the first, finds
    A's blocks there), the other pool starts empty and takes its cache when closed; back on the
    first, A finds its blocks; ``reset_prefix_cache`` empties the cache of the pool A uses."""
    a, pool = shared_pool
    want = alone(tiny_llm, PROMPTS)
    b = LLM(gpt=a.model, seed=1, engine=a.engine_config)
    pool.attach(b)
    with pytest.raises(ValueError, match=r"built their weights from \(checkpoint, seed\) = \(None, 1\), not \(None, 2\)"):
        pool.attach(LLM(gpt=a.model, seed=2, engine=a.engine_config))     # one model's shapes, other weights
    a.reset_prefix_cache()
    assert ask(a, "paged", want) == 0
    with WorkerPool(a) as other:                  # A's pool replaced: a new memory, an empty cache
        assert [ask(a, s, want) for s in ("chunked", "paged")] == [0, 32]
        assert ask(b, "chunked", want) == 32      # the first pool's cache, kept while A was away
    assert other.prefix_cache is None
    pool.attach(a)
    assert ask(a, "chunked", want) == 32
    a.reset_prefix_cache()
    assert ask(b, "paged", want) == 0


def test_an_engine_whose_memory_was_lent_on_admits_nothing_more(tiny_llm):
    """An engine done but not closed, its cache lent to the next engine over the same K/V pool: it
    refuses a new request's admission (it would take blocks the other engine holds), and the other
    engine's tokens stay its own."""
    memory = KVPool(SHARED["n_slots"], tiny_llm.cfg.n_layers, tiny_llm.cfg.n_kv_heads, tiny_llm.cfg.head_dim)
    want = alone(tiny_llm, PROMPTS)
    first = engine_over(memory, tiny_llm.model, "paged", True)
    first.add_request(PROMPTS[0], SamplingParams(max_gen_tokens=2))
    first.run()
    second = engine_over(memory, tiny_llm.model, "chunked", True)
    reqs = [second.add_request(p, SamplingParams(max_gen_tokens=4, ignore_eos=True)) for p in PROMPTS]
    second.step()
    first.add_request(PROMPTS[1], SamplingParams(max_gen_tokens=2))
    with pytest.raises(RuntimeError, match="lent to a newer engine"):
        first.step()
    second.run()
    assert [list(r.output) for r in reqs] == want and reqs[0].n_prefix_hit == 32


async def ask_wave(url, wave):
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def one(prompt, sp):
            body = {"prompt": prompt, "max_tokens": sp.max_gen_tokens, "temperature": sp.temperature,
                    "top_k": sp.top_k, "ignore_eos": True, "return_token_ids": True}
            if sp.seed is not None:
                body["seed"] = sp.seed
            r = await http.post("/v1/completions", json=body)
            return r.json()["choices"][0]["token_ids"]
        return await asyncio.gather(*(one(p, sp) for p, sp in wave))


@pytest.mark.parametrize("system", ["paged", "chunked"])
def test_over_http_the_same_tokens_and_the_counters_on_metrics(want, tmp_path, capsys, system):
    flags = ["--model", "tiny", "--seed", "1", "--max-bs", 4, "--n-slots", 1024, "--block-size", BS,
             "--max-num-batched-tokens", 24, "--prefix-caching", "--system", system]
    with ServerProcess(*flags) as server:
        got = []
        for wave in WAVES:
            got += asyncio.run(ask_wave(server.url, wave))
        m = metrics(server.url)
        out = tmp_path / "bench"
        main(["bench", "--base-url", server.url, "--n-requests", "4", "--dataset", "few-shot", "--input-len", "40",
              "--output-len", "2", "--rate", "inf", "--max-concurrency", "1", "--out", str(out)])
    assert got == want
    row = json.loads((out / "bench.json").read_text())["summary"][0]
    assert row["prefix_hit_rate"] > 0.3 and "prefix_hit_rate" in capsys.readouterr().out   # 3 of 4 find 40
    # the second wave finds all it can; the first may find its own system prompt, by arrival timing
    assert m["orca_lab_prefix_cache_hit_tokens_total"] >= 24 + 40 + 24 + 24 + 32 + 8
    assert m["orca_lab_prefix_cache_query_tokens_total"] == sum(len(p) for w in WAVES for p, _ in w)


def test_under_memory_pressure_cached_blocks_are_evicted_held_ones_never_and_none_leaks(tiny_llm):
    """Three system prompts of 40 tokens (5 blocks each), a pool of 12 blocks of 8 (96 slots): the
    cache cannot hold every prefix at once. Waves of one system prompt after another: a wave finds
    the blocks of the one before it of the same prompt, and evicts those of the others; two requests
    at once may need more blocks than are free (preemption)."""
    rng = random.Random(3)
    systems = [[rng.randrange(256) for _ in range(40)] for _ in range(3)]
    ask = lambda s: (systems[s] + [rng.randrange(256) for _ in range(rng.randint(1, 9))],
                     SamplingParams(max_gen_tokens=rng.randint(2, 9)))
    waves = [[ask(s) for _ in range(n)] for s, n in ((0, 2), (0, 1), (1, 2), (1, 1), (2, 2), (0, 2), (2, 1))]
    cfg = dict(max_bs=4, n_slots=96, block_size=BS, max_num_batched_tokens=24)
    plain = LLM(gpt=tiny_llm.model, engine=EngineConfig(**cfg))
    expect = [list(r.output) for r in run_waves(plain.new_engine("paged"), waves)]
    for system in ("paged", "chunked"):
        engine = LLM(gpt=tiny_llm.model, engine=EngineConfig(prefix_caching=True, **cfg)).new_engine(system)
        reqs = run_waves(engine, waves, check=check_invariants)
        assert [list(r.output) for r in reqs] == expect, system
        kv = engine.scheduler.kv
        assert kv.n_evictions > 0 and kv.hit_tokens > 0, (system, kv.n_evictions, kv.hit_tokens)
        assert_clean(kv)


def test_prefix_caching_is_refused_where_slots_are_reserved_and_lpm_needs_it(tiny_llm):
    for system in ("orca", "ft"):
        llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(prefix_caching=True, n_slots=256))
        with pytest.raises(ValueError, match=rf"prefix_caching=True is not allowed with system='{system}'.*reserves"):
            llm.new_engine(system)
    with pytest.raises(ValueError, match="schedule_policy='lpm'.*needs prefix_caching=True"):
        EngineConfig(schedule_policy="lpm")
    with pytest.raises(ValueError, match="schedule_policy='sjf' is not allowed"):
        EngineConfig(prefix_caching=True, schedule_policy="sjf")
    with pytest.raises(ValueError, match="prefix_caching=1 is not allowed"):
        EngineConfig(prefix_caching=1)
    with pytest.raises(ValueError, match="prefix_caching=True is not allowed with system='orca'"):
        SimBackend("tiny", prefix_caching=True, n_slots=256).new_engine(Curve("orca", 4))


# -- the block hashes, reference counts and LRU against a plain reference -------------------------
class Reference:
    """The same cache keyed by token prefixes, not hashes, and holding no block ids."""

    def __init__(self, n_blocks):
        self.n_blocks, self.held, self.lru, self.tables = n_blocks, {}, OrderedDict(), {}

    def registered(self, key):
        return key in self.held or key in self.lru

    def hit(self, tokens):
        n = 0
        while n < (len(tokens) - 1) // BS and self.registered(tuple(tokens[:(n + 1) * BS])):
            n += 1
        return n

    def n_private(self):
        return sum(1 for t in self.tables.values() for k in t if not isinstance(k, tuple))

    def take(self, n):
        """Fresh blocks first, then the least recently freed cached ones."""
        fresh = self.n_blocks - len(self.held) - len(self.lru) - self.n_private()
        for _ in range(max(0, n - fresh)):
            self.lru.popitem(last=False)

    def add(self, rid, tokens, n_hit):
        keys = [tuple(tokens[:(i + 1) * BS]) for i in range(n_hit)]
        for k in keys:
            self.lru.pop(k, None)
            self.held[k] = self.held.get(k, 0) + 1
        self.tables[rid] = keys

    def grow(self, rid, n_tokens):
        need = -(-n_tokens // BS) - len(self.tables[rid])
        self.take(need)
        self.tables[rid] += [object() for _ in range(need)]

    def written(self, rid, tokens, lo, hi):
        """Tokens [lo, hi) hold K/V: full blocks among them registered unless already."""
        t = self.tables[rid]
        for i in range(lo // BS, hi // BS):
            key = tuple(tokens[:(i + 1) * BS])
            if not isinstance(t[i], tuple) and not self.registered(key):
                t[i] = key
                self.held[key] = 1

    def release(self, rid):
        for k in reversed(self.tables.pop(rid)):
            if isinstance(k, tuple):
                self.held[k] -= 1
                if not self.held[k]:
                    del self.held[k]
                    self.lru[k] = None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "decode", "finish"]), st.integers(0, 3), st.integers(1, 40),
                          st.integers(0, 10 ** 6)), min_size=1, max_size=60))
def test_hashes_reference_counts_and_lru_against_a_plain_reference(ops):
    n_blocks = 8            # small: cached blocks are evicted within a few operations
    kv, ref = PrefixCachingBlockManager(n_blocks * BS, BS), Reference(n_blocks)
    stems = [[s] * 20 + [s + 1] * 20 for s in range(4)]          # four families of shared prefixes
    live, rid = {}, 0
    for op, stem, length, salt in ops:
        if op == "new":
            tokens = stems[stem][:length] + [salt % 7]
            req = Request(rid, tokens, SamplingParams(max_gen_tokens=50))
            hit = kv.lookup(req)
            assert len(hit) == ref.hit(tokens)
            rid += 1
            if not kv.can_admit(len(tokens) - len(hit) * BS, hit):
                continue
            kv.share(req, hit)
            ref.add(req.rid, tokens, len(hit))
            kv.grow(req, len(tokens))
            ref.grow(req.rid, len(tokens))
            lo = req.n_cached
            kv.cache(req, len(tokens))
            ref.written(req.rid, tokens, lo, len(tokens))
            live[req.rid] = req
        elif live:
            req = live[sorted(live)[salt % len(live)]]
            if op == "decode" and kv.can_grow(req, req.context_len + 1):
                req.output.append(salt % 3)
                kv.grow(req, req.context_len)
                ref.grow(req.rid, req.context_len)
                lo = req.n_cached
                kv.cache(req, req.context_len)
                ref.written(req.rid, req.prompt + req.output, lo, req.context_len)
            elif op == "finish":
                req.finish_reason = "length"
                kv.release(req)
                ref.release(req.rid)
                del live[req.rid]
        check_invariants(kv)
        lru_keys = [kv.hash_of[b] for b in kv.lru]
        assert lru_keys == [chain_hashes(list(k), BS, len(k) // BS)[-1] for k in ref.lru]
        assert sorted(kv.hash_of.values()) == sorted(chain_hashes(list(k), BS, len(k) // BS)[-1]
                                                     for k in [*ref.held, *ref.lru])
    for req in list(live.values()):
        req.finish_reason = "length"
        kv.release(req)
    assert_clean(kv)


def test_names_are_sha256_chained_from_the_parent():
    from orca_lab.engine.prefix_cache import ROOT
    tokens = list(range(2 * BS))
    first, second = chain_hashes(tokens, BS, 2)
    assert first == hashlib.sha256(ROOT + struct.pack(f"<{BS}q", *tokens[:BS])).digest()
    assert second == hashlib.sha256(first + struct.pack(f"<{BS}q", *tokens[BS:])).digest()
    assert chain_hashes([9] * BS + tokens[BS:], BS, 2)[1] != second     # the same tokens, another parent


@pytest.mark.parametrize("digest", ["constant", "first byte"])
def test_a_forced_collision_of_names_serves_no_block_of_other_tokens(tiny_llm, monkeypatch, digest):
    """Names made to collide (every block one name, or 256 names only): a prompt finds no block
    registered from other tokens, and gets the tokens it gets alone; an equal prompt still finds its
    own blocks."""
    sha = prefix_cache.hashlib.sha256
    cheap = {"constant": lambda data: sha(b""), "first byte": lambda data: sha(sha(data).digest()[:1])}[digest]
    monkeypatch.setattr(prefix_cache.hashlib, "sha256", cheap)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(33)] for _ in range(40)]
    want = tiny_llm.generate(prompts, 2, ignore_eos=True)
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(prefix_caching=True, **SETTINGS))
    engine = llm.new_engine("paged")
    reqs = []
    for p in prompts + prompts[:1]:                       # one at a time: each finds what came before
        reqs.append(engine.add_request(p, SamplingParams(max_gen_tokens=2, ignore_eos=True)))
        while engine.has_work():
            engine.step()
    assert [list(r.output) for r in reqs] == want + want[:1]
    assert [r.n_prefix_hit for r in reqs[:-1]] == [0] * len(prompts)    # names collide, tokens differ
    assert reqs[-1].n_prefix_hit == (BS if digest == "constant" else 32)  # its own blocks, where named
    assert_clean(engine.scheduler.kv)


def test_a_padding_row_takes_a_block_outside_the_cache_even_when_every_free_block_is_cached():
    """The CUDA graphs' padding row (``cuda_graphs.PadRequest``) reserves one slot between a
    decode's select and its return: with no never-used block left it evicts a cached one, and gives
    it back unregistered."""
    from orca_lab.model.cuda_graphs import PadRequest
    kv = PrefixCachingBlockManager(4 * BS, BS, 1, 1, 2)                # K/V tensors: slots as a tensor
    req = Request(0, list(range(4 * BS)), SamplingParams(max_gen_tokens=1), finish_reason="length")
    kv.share(req, kv.lookup(req))
    kv.grow(req, 4 * BS)
    kv.cache(req, 4 * BS)
    kv.release(req)
    assert len(kv.lru) == 4 and kv._spans == []                  # every free block is cached
    pad = PadRequest()
    assert kv.can_reserve(1)
    kv.reserve(pad, 1)
    assert pad.slots.tolist() == [3 * BS] and kv.n_reserved == BS and list(kv.lru) == [2, 1, 0]
    kv.release(pad)                                                    # the prompt's tail went first
    assert pad.slots is None and kv._spans == [[3 * BS, 4 * BS]]
    assert_clean(kv)


# -- the cache-aware order, and the simulator --------------------------------------------------
def starving_trace(vocab=257, n_hits=24):
    """A request that shares nothing (rid 1) arrives just after the first of a stream of requests that
    all share a 64-token prefix with it, and before the rest of the stream."""
    rng = random.Random(0)
    tok = lambda n: tuple(rng.randrange(vocab) for _ in range(n))
    prefix = tok(64)
    trace = [TraceItem(0.0, prefix + tok(4), 4), TraceItem(1e-9, tok(68), 4)]
    return trace + [TraceItem(2e-9, prefix + tok(4), 4) for _ in range(n_hits)]


def first_iteration(result, rid):
    return min(it.iteration for it in result.iterations if rid in it.rids)


def test_longest_prefix_first_serves_hits_first_and_starves_a_request_that_shares_nothing(tiny_llm):
    trace = starving_trace()
    runs = {}
    for policy in ("fcfs", "lpm"):
        sim = SimBackend(tiny_llm.cfg, cost=AnalyticalCost(tiny_llm.cfg), n_slots=4096, block_size=BS,
                         prefix_caching=True, schedule_policy=policy)
        runs[policy] = sim.serve(Curve("paged", 2), trace)
    fcfs, lpm = (first_iteration(runs[p], 1) for p in ("fcfs", "lpm"))
    assert fcfs <= 1                                 # FCFS: right after the first request
    starts = sorted((first_iteration(runs["lpm"], r), r) for r in range(len(trace)))
    assert starts[-1][1] == 1                        # lpm: the last of all to start...
    assert lpm >= 20 * max(fcfs, 1)                  # ...after every hit that arrived after it
    hits = runs["lpm"].requests_df()["prefix_hit_tokens"]
    assert hits.iloc[1] == 0 and (hits.iloc[2:] == 64).all()


def test_longest_prefix_first_goes_fcfs_past_128_waiting_as_sglang_does(tiny_llm):
    """Past ``LPM_MAX_WAITING`` waiting, the request that shares nothing starts in arrival order (no
    lookup of every waiting request), where with 24 waiting it starts last (the test above)."""
    from orca_lab.engine.policies import LPM_MAX_WAITING
    trace = starving_trace(n_hits=LPM_MAX_WAITING + 40)
    sim = SimBackend(tiny_llm.cfg, cost=AnalyticalCost(tiny_llm.cfg), n_slots=4096, block_size=BS,
                     prefix_caching=True, schedule_policy="lpm")
    run = sim.serve(Curve("paged", 2), trace)
    assert first_iteration(run, 1) <= 1


@pytest.mark.parametrize("system", ["paged", "chunked"])
def test_simulator_and_engine_make_the_same_batches_on_a_prefix_shared_trace(tiny_llm, system):
    """A hit shortens the prefill in the simulator as in the engine: the same batches, new tokens,
    K/V counts and hits, iteration by iteration (offline, two batches in flight)."""
    trace = few_shot_trace(10, prefix_len=40, question_len=(1, 12), gen_len=(2, 6), vocab_size=257, seed=2)
    trace += [TraceItem(0.0, it.prompt, 3) for it in multi_turn_trace(2, None, scale=0.1, think_s=0.0,
                                                                          vocab_size=257, max_len=256, seed=1)]
    cfg = dict(max_bs=4, n_slots=256, block_size=BS, max_num_batched_tokens=24, prefix_caching=True)
    real = LLM(gpt=tiny_llm.model, engine=EngineConfig(pipeline_parallel=2, executor="local", **cfg)) \
        .new_engine(system).run(trace)
    sim = SimBackend(tiny_llm.cfg, cost=AnalyticalCost(tiny_llm.cfg, pipeline_parallel=2), n_slots=256,
                     block_size=BS, max_num_batched_tokens=24, prefix_caching=True)
    simulated = sim.serve(Curve(system, 4), trace)
    key = lambda res: [(it.iteration, it.rids, it.q_lens, it.kv_reserved, it.kv_used)
                       for it in res.iterations if it.stage == 0]
    assert key(simulated) == key(real)
    hits = list(real.requests_df()["prefix_hit_tokens"])
    assert list(simulated.requests_df()["prefix_hit_tokens"]) == hits and sum(hits) > 0


def test_a_mooncake_trace_becomes_prompts_that_share_what_its_hash_ids_share():
    """The example of Mooncake's README (FAST25-release): two requests sharing their first 12 of
    512-token blocks; as prompts, they share those 6,144 tokens, and both readings of the reuse agree."""
    records = [{"timestamp": 27482, "input_length": 6955, "output_length": 52,
                "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]},
               {"timestamp": 30535, "input_length": 6472, "output_length": 26,
                "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2366]}]
    a, b = mooncake_trace(records, vocab_size=257)
    assert (len(a.prompt), len(b.prompt), a.max_gen_tokens, b.arrival) == (6955, 6472, 52, 30.535)
    assert a.prompt[:6144] == b.prompt[:6144] and a.prompt[6144:6656] != b.prompt[6144:6656]
    stats = mooncake_reuse(records)
    assert stats["reuse"] == 6144 / (6955 + 6472) == prefix_reuse([a, b], 512)


def test_the_benchmark_runs_at_a_toy_size_and_writes_its_report(tmp_path):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "prefix_caching.py"
    spec = importlib.util.spec_from_file_location("bench_prefix_caching", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--smoke", "--threads", str(torch.get_num_threads()), "--out", str(tmp_path / "p.json")])
    report = json.loads((tmp_path / "p.json").read_text())
    assert "torch" in report["environment"] and report["ttft_median_ratio"] > 0
    for part in ("tiny_measured", "gpt3_13b_simulated"):
        assert report[part]["with caching"]["prefix_hit_rate"] > 0 == report[part]["without"]["prefix_hit_rate"]
