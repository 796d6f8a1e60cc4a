"""One K/V pool per LLM: allocated by its first engine, lent to every later one (the allocator is
reset, not the memory), never two at once; slot ids on the host for every system."""
import copy

import pytest
import torch

from helpers import needs_gpu, random_prompts
from orca_lab import LLM, EngineConfig, SamplingParams
from orca_lab.engine.batch import Batch, BatchTensors
from orca_lab.engine.blocks import BlockManager
from orca_lab.engine.kv_manager import KVPool
from orca_lab.engine.policies import SYSTEMS
from orca_lab.engine.request import Request
from orca_lab.workload import TraceItem


@pytest.fixture
def llm(tiny_llm):
    return LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=4, n_slots=2048, block_size=8,
                                                       max_num_batched_tokens=16))


def test_every_engine_and_system_of_an_llm_reads_one_pool(llm, tiny_llm, monkeypatch):
    """Engines of every system, one after the other, and every entry point: one pool, allocated
    once; and the stale K/V a run leaves in it never reaches the next run's tokens."""
    prompts = random_prompts(3, llm.cfg.vocab_size, 5, 30, seed=2)
    expected = [tiny_llm.generate([p], max_gen_tokens=5)[0] for p in prompts]
    allocated = []
    monkeypatch.setattr(KVPool, "__init__", lambda self, *a, real=KVPool.__init__, **k:
                        allocated.append(a) or real(self, *a, **k))
    engines = []
    for system in SYSTEMS:
        engine = llm.new_engine(system)
        for p in prompts:
            engine.add_request(p, SamplingParams(max_gen_tokens=5))
        assert [list(r.output) for r in engine.run().requests] == expected, system
        engines.append(engine)            # kept alive: a pool of their own would stay allocated
    assert len({e.scheduler.kv.k.data_ptr() for e in engines}) == 1
    assert llm.generate(prompts, max_gen_tokens=5, system="chunked") == expected
    assert [c.token_ids for c in llm.complete(prompts, max_gen_tokens=5)] == expected
    assert [list(r.output) for r in llm.serve([TraceItem(0.0, tuple(p), 5) for p in prompts]).requests] == expected
    assert len(allocated) == 1


def test_two_engines_of_one_llm_never_hold_two_pools(llm):
    """The pool goes to the newest engine: one that is done is closed when the next is built; one
    that still serves requests is not interrupted, the new one is refused, naming why."""
    first = llm.new_engine()
    req = first.add_request([1, 2, 3], SamplingParams(max_gen_tokens=3))
    with pytest.raises(RuntimeError, match=r"another engine of this LLM \(or of one sharing its K/V pool\) still serves requests \(1 waiting, 0 running\)"):
        llm.new_engine("paged")
    first.step()
    with pytest.raises(RuntimeError, match=r"\(0 waiting, 1 running\).*engine.close\(\)"):
        llm.generate([[4, 5]], max_gen_tokens=2)
    first.run()
    assert len(req.output) == 3
    second = llm.new_engine("paged")         # the first is done: it is closed, its pool lent on
    with pytest.raises(RuntimeError, match="no longer serves: a newer engine of its LLM took over the K/V pool"):
        first.add_request([1, 2], SamplingParams(max_gen_tokens=2))
    second.add_request([1, 2], SamplingParams(max_gen_tokens=2))
    second.close()                           # closed with work: the pool is free again
    assert llm.generate([[4, 5]], max_gen_tokens=2)[0] == llm.generate([[4, 5]], max_gen_tokens=2)[0]
    assert first.result().requests[0].n_generated == 3     # a closed engine's run can still be read


def test_slot_ids_of_paged_requests_stay_on_the_host_and_grow_in_place():
    """A pool on another device (meta here, a GPU in use) leaves slot ids on the host, so building an
    iteration's metadata copies nothing back from the device; a request's table grows in one host
    buffer (a block costs its own slots, not the whole context again)."""
    kv = BlockManager(64, 8, 2, 2, 4, device="meta")
    req = Request(0, list(range(1, 21)), SamplingParams(max_gen_tokens=12))
    kv.grow(req, 20)
    buffer = req.slots.untyped_storage().data_ptr()
    kv.grow(req, 25)
    assert req.slots.device.type == "cpu" and req.slots.tolist() == list(range(32))
    assert req.slots.untyped_storage().data_ptr() == buffer
    bt = BatchTensors.build(Batch.selective([req], [20]), "cpu")
    assert bt.slot_mapping.tolist() == list(range(20)) and bt.kv_slot_ids.tolist() == list(range(20))
    kv.release(req)
    assert kv._spans == [[0, 64]] and kv.n_used == 0 and kv._tables == {}


@needs_gpu
def test_consecutive_calls_on_a_gpu_allocate_no_new_pool(tiny_llm):
    """``n_slots=None`` sizes the pool to fill the GPU's free memory: the second call, and every
    system after it, runs in the memory the first one left allocated (before, each call allocated the
    pool again, and memory peaked at a second pool's worth)."""
    llm = LLM(gpt=copy.deepcopy(tiny_llm.model), engine=EngineConfig(device="cuda", n_slots=None, max_bs=4,
                                                                     gpu_memory_utilization=0.5))
    prompt = [[1, 2, 3, 4]]
    expected = llm.generate(prompt, max_gen_tokens=3)
    torch.cuda.synchronize()
    pool = llm.new_engine().scheduler.kv.pool
    margin = max(64 << 20, 2 * pool.k.numel() * pool.k.element_size() // 100)   # 1% of the pool
    after_first = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for system in SYSTEMS:
        assert llm.generate(prompt, max_gen_tokens=3, system=system) == expected, system
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - after_first < margin
    assert torch.cuda.max_memory_allocated() - after_first < margin


def test_two_llms_over_one_lent_pool_write_the_same_tensors_and_take_turns(llm, tiny_llm):
    """``LLM(kv_pool=...)``: the RealBackend's LLMs of each max_bs (one pool each took the GPU's
    memory as many times over) write one pool, give the tokens each gave alone, and take turns."""
    prompts = random_prompts(3, llm.cfg.vocab_size, 5, 30, seed=3)
    expected = [tiny_llm.generate([p], max_gen_tokens=5)[0] for p in prompts]
    other = LLM(gpt=tiny_llm.model, engine=llm.engine_config.replace(max_bs=2), kv_pool=llm.kv_pool)
    assert other.kv_pool is llm.kv_pool and other.engine_config.n_slots == 2048
    for system in ("orca", "ft", "paged"):
        for each in (llm, other, llm):
            engine = each.new_engine(system)
            assert engine.scheduler.kv.k is llm.kv_pool.k and engine.scheduler.kv.v is llm.kv_pool.v
            for p in prompts:
                engine.add_request(p, SamplingParams(max_gen_tokens=5))
            assert [list(r.output) for r in engine.run().requests] == expected, system
    busy = other.new_engine()
    busy.add_request([1, 2, 3], SamplingParams(max_gen_tokens=2))
    with pytest.raises(RuntimeError, match=r"of one sharing its K/V pool\) still serves requests \(1 waiting"):
        llm.new_engine()
    busy.run()
    llm.new_engine().close()
    with pytest.raises(RuntimeError, match="a newer engine of its LLM took over the K/V pool"):
        busy.add_request([1, 2], SamplingParams(max_gen_tokens=2))


@pytest.mark.parametrize("field,pool", [
    ("n_slots", lambda c: KVPool(1024, c.n_layers, c.n_kv_heads, c.head_dim)),
    ("n_layers", lambda c: KVPool(2048, c.n_layers + 1, c.n_kv_heads, c.head_dim)),
    ("n_kv_heads", lambda c: KVPool(2048, c.n_layers, c.n_kv_heads + 1, c.head_dim)),
    ("head_dim", lambda c: KVPool(2048, c.n_layers, c.n_kv_heads, c.head_dim * 2)),
    ("dtype", lambda c: KVPool(2048, c.n_layers, c.n_kv_heads, c.head_dim, dtype=torch.float64)),
    ("device", lambda c: KVPool(2048, c.n_layers, c.n_kv_heads, c.head_dim, device="meta")),
])
def test_a_lent_pool_of_another_shape_is_refused_naming_the_field(llm, field, pool):
    with pytest.raises(ValueError, match=rf"kv_pool has {field}=.* but this LLM needs {field}="):
        LLM(gpt=llm.model, engine=llm.engine_config, kv_pool=pool(llm.cfg))


def test_a_lent_pool_is_refused_to_an_llm_that_caches_prefixes(llm):
    """The lender's cached blocks hold K/V of its weights: a borrower does not read them."""
    with pytest.raises(ValueError, match="borrowed pool keeps no prefix cache; use prefix_caching=False"):
        LLM(gpt=llm.model, engine=llm.engine_config.replace(prefix_caching=True), kv_pool=llm.kv_pool)
