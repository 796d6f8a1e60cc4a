"""What one iteration costs besides its math: host synchronizations, launches, stage clocks.

- One host sync per iteration: the forward of a mixed prefill + decode batch reads nothing back from
  the device except the sampled tokens, on both attention backends.
- CUDA graphs: the padding to graph sizes and the static buffers run eagerly here (the same tokens as
  unpadded, batched == alone); capture and replay need a GPU.
"""
import copy
import sys

import pytest
import torch
from helpers import random_prompts
from torch.overrides import TorchFunctionMode

from orca_lab import LLM, EngineConfig, ModelConfig, SamplingParams
from orca_lab.engine.clock import StageClock
from orca_lab.model.cuda_graphs import BUCKETS, DecodeGraphs, decode_graphs_for, padded_size
from orca_lab.model.executor import LocalExecutor
from orca_lab.model.gpt import GPT
from orca_lab.model.sampler import sample
from orca_lab.workload import paper_trace

# Tensor methods that copy device data to the host (a synchronization on a GPU).
READ_BACKS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
              "__array__", "nonzero"}


class CountReadBacks(TorchFunctionMode):
    """Counts read-backs made by orca_lab and torch; Triton's interpreter, which emulates a GPU by
    copying kernel arguments to numpy, is not counted (on a GPU it does not run)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READ_BACKS and not sys._getframe(1).f_globals.get("__name__", "").startswith("triton"):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def small_gpt():
    """Odd and small (2 layers, 3 heads of 16, vocabulary 97): Triton's interpreter runs it quickly."""
    return GPT.random(ModelConfig("small", n_layers=2, d_model=48, n_heads=3, vocab_size=97,
                                  max_seq_len=128), seed=4)


def small_llm(gpt, backend, fused_ops_backend=None, **kw):
    cfg = EngineConfig(n_slots=600, attention_backend=backend, fused_ops_backend=fused_ops_backend or backend,
                       **kw)
    return LLM(gpt=copy.deepcopy(gpt), engine=cfg)


def mixed_batch(llm):
    """An engine whose next batch mixes two running requests (one token each) with two new prompts."""
    engine = llm.new_engine()
    vocab = llm.cfg.vocab_size
    for p in random_prompts(2, vocab, 5, 12, seed=1):
        engine.add_request(p, SamplingParams(max_gen_tokens=4))
    engine.step()
    for p in random_prompts(2, vocab, 3, 9, seed=2):
        engine.add_request(p, SamplingParams(max_gen_tokens=4))
    batch = engine.scheduler.select()
    assert set(batch.phases) == {"prefill", "decode"}
    return engine, batch


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_host_read_back_per_iteration(small_gpt, backend):
    llm = small_llm(small_gpt, backend, max_bs=4)
    engine, batch = mixed_batch(llm)
    bt = batch.tensors("cpu")        # host metadata: built from host arrays, read nothing back
    with torch.inference_mode(), CountReadBacks() as counted:
        tokens = sample(llm.model(bt, engine.scheduler.kv), batch)
    assert counted.calls == ["tolist"] and len(tokens) == len(batch)
    engine.close()


def test_out_of_range_slot_ids_are_refused_once_where_they_enter(tiny_llm):
    engine, batch = mixed_batch(tiny_llm)
    batch.requests[0].slots = batch.requests[0].slots + engine.scheduler.kv.n_slots
    with pytest.raises(ValueError, match=r"slot ids hold values in \[\d+, \d+\], allowed \[0, n_slots=4096\)"):
        tiny_llm.model(batch.tensors("cpu"), engine.scheduler.kv)
    engine.close()


def test_graph_sizes_follow_vllms_buckets():
    assert BUCKETS[:6] == (1, 2, 4, 8, 16, 24)
    assert [padded_size(n) for n in (1, 3, 5, 8, 9, 17, 33)] == [1, 4, 8, 8, 16, 24, 40]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_decode_gives_the_unpadded_tokens(small_gpt, backend):
    """Decode iterations padded to graph sizes (3 -> 4, 5 -> 8 requests), eagerly through the static
    buffers: each request's tokens as when it runs alone, unpadded. No slot leaks. (The token-wise
    ops stay on PyTorch: the padding concerns attention, and the interpreter is slow.)"""
    llm = small_llm(small_gpt, backend, "torch", max_bs=5)
    prompts = random_prompts(5, llm.cfg.vocab_size, 2, 12, seed=6)
    expected = [llm.generate([p], max_gen_tokens=3)[0] for p in prompts]
    for n in (3, 5):
        engine = llm.new_engine()
        kv = engine.scheduler.kv
        graphs = engine.executor.graphs = DecodeGraphs(llm.model, kv, 5, capture=False)
        ran = []
        real_run = graphs.run
        graphs.run = lambda batch: ran.append(len(batch)) or real_run(batch)
        rids = [engine.add_request(p, SamplingParams(max_gen_tokens=3)).rid for p in prompts[:n]]
        out = {rid: [] for rid in rids}
        while engine.has_work():
            for req, tok in engine.step():
                out[req.rid].append(tok)
        assert [out[r] for r in rids] == expected[:n]
        assert ran and set(ran) == {n}, "decode iterations went through the padded path"
        assert kv.n_holders == 0 and kv.stats().free == kv.n_slots
        engine.close()


def run_ft(llm, prompts, gens, mbs, graphs: bool):
    """Each prompt's tokens under ``ft(max_bs, mbs)``; with ``graphs``, the decode graphs' static-buffer
    forward (eager here). Also the one-token steps and the batches the graphs ran (their phases)."""
    engine = llm.new_engine("ft", mbs)
    kv = engine.scheduler.kv
    ran = []
    if graphs:
        g = engine.executor.graphs = DecodeGraphs(llm.model, kv, llm.engine_config.max_bs, capture=False)
        real_run = g.run

        def run(batch):
            logits = real_run(batch)
            if logits is not None:
                ran.append(tuple(batch.phases))
            return logits
        g.run = run
    reqs = [engine.add_request(p, SamplingParams(max_gen_tokens=n)) for p, n in zip(prompts, gens)]
    while engine.has_work():
        engine.step()
    one_token_steps = sum(all(q == 1 for q in it.q_lens) for it in engine.records)
    assert kv.n_holders == 0 and kv.stats().free == kv.n_slots
    engine.close()
    return [list(r.output) for r in reqs], ran, one_token_steps


@pytest.mark.parametrize("mbs", [None, 3], ids=["mbs=max_bs", "micro-batches"])
def test_every_ft_decode_step_takes_the_graph_path_and_gives_the_eager_tokens(small_gpt, mbs):
    """The baseline's one-token steps (its decodes, the longer prompts fed a token at a time, and the
    rows of requests held after they finished) run through the decode graphs' static buffers, as
    ORCA's decodes do (eagerly here; a GPU replays them): every one of them, with the tokens of the
    run without graphs, token for token, which are each request's tokens alone. Batches of 5 and of
    3 + 2 (micro-batches): 5 and 3 are padded to graph sizes, and early finishers are held."""
    llm = LLM(gpt=copy.deepcopy(small_gpt), engine=EngineConfig(max_bs=5, n_slots=5 * 128 + 8, attention_backend="torch",
                                                              fused_ops_backend="torch"))
    prompts = random_prompts(5, llm.cfg.vocab_size, 2, 9, seed=8)
    gens = [2, 7, 3, 5, 1]
    eager, ran_eager, steps = run_ft(llm, prompts, gens, mbs, graphs=False)
    graphed, ran, graph_steps = run_ft(llm, prompts, gens, mbs, graphs=True)
    assert not ran_eager and steps == graph_steps > 0
    assert len(ran) == steps, "every one-token step of ft went through the graphs' static buffers"
    assert any("held" in phases for phases in ran) and any("prefill" in phases for phases in ran)
    assert graphed == eager == [llm.generate([p], max_gen_tokens=n)[0] for p, n in zip(prompts, gens)]


def test_padding_steps_aside_when_no_slot_is_free(tiny_llm):
    """A batch of 3 needs a padding row (graph size 4), hence a free slot; a batch of a graph size
    (here 2) needs none, so it runs on a full pool: FT's reservations fill one exactly (Figure 9 on
    the H200: batch 8 x 2,048 slots of 16,384)."""
    engine, batch = mixed_batch(tiny_llm)
    kv = engine.scheduler.kv
    graphs = DecodeGraphs(tiny_llm.model, kv, 4, capture=False)
    decoding = [i for i, p in enumerate(batch.phases) if p == "decode"]
    assert len(decoding) == 2

    def decode(rows):
        return type(batch)([batch.requests[i] for i in rows], [batch.starts[i] for i in rows], [1] * len(rows),
                           tokens=[batch.tokens[i] for i in rows])
    assert graphs.takes(decode(decoding)) and not graphs.takes(batch)
    kv.n_reserved = kv.n_slots          # the pool is full: no slot for the padding rows
    assert graphs.run(decode(decoding + decoding[:1])) is None
    with torch.inference_mode():
        logits = graphs.run(decode(decoding))
        assert logits is not None and logits.shape == (2, tiny_llm.cfg.vocab_size)
    engine.close()


def test_graphs_are_off_on_cpu_and_when_switched_off(tiny_llm):
    engine = tiny_llm.new_engine()
    assert isinstance(engine.executor, LocalExecutor) and engine.executor.graphs is None
    cfg = EngineConfig(cuda_graphs=False)
    assert decode_graphs_for(tiny_llm.model, engine.scheduler.kv, cfg) is None
    with pytest.raises(ValueError, match="cuda_graphs=0"):
        EngineConfig(cuda_graphs=0)
    engine.close()


def test_stage_clock_on_cpu_is_the_wall_clock():
    ticks = iter([1.0, 2.5, 4.0])
    clock = StageClock("cpu", lambda: next(ticks))
    for _ in range(3):
        clock.mark()
    assert clock.times() == [1.0, 2.5, 4.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and events need a GPU")
def test_cuda_graph_replay_gives_the_eager_tokens(tiny_llm):
    """On a GPU: the first decode of each size is eager and captured, later ones replay, for ORCA's
    decodes and FT's one-token steps alike; the tokens equal the run without graphs, and the stage
    times come from CUDA events in order."""
    prompts = random_prompts(6, tiny_llm.cfg.vocab_size, 2, 30, seed=3)
    runs, replayed = {}, []
    for graphs in (False, True):
        cfg = EngineConfig(max_bs=6, n_slots=6 * 1024 + 8, device="cuda", attention_backend="triton",
                           fused_ops_backend="triton", cuda_graphs=graphs)
        llm = LLM(gpt=copy.deepcopy(tiny_llm.model).cuda(), engine=cfg)
        engine = llm.new_engine()
        assert (engine.executor.graphs is not None) == graphs
        engine.close()
        if graphs:
            real_run = llm._graphs.run
            llm._graphs.run = lambda batch: replayed.append(batch.padded) or real_run(batch)
        runs[graphs] = [llm.generate(prompts, max_gen_tokens=8, system=s) for s in ("orca", "ft")]
    assert runs[True] == runs[False] and runs[True][0] == runs[True][1]
    lens = [len(p) for p in prompts]          # FT: the shortest prompt, then one token a step to the end
    assert replayed.count(False) == 7 and replayed.count(True) == max(lens) + 7 - min(lens)
    result = llm.serve(paper_trace(4, rate=None, seed=1, scale=0.05, vocab_size=llm.cfg.vocab_size))
    assert all(0 <= it.start <= it.end for it in result.iterations)


def test_warm_up_meets_every_graph_size_and_settles_the_tuner(small_gpt, monkeypatch):
    """``LLM.warm_up`` (a GPU server and a measured sweep call it before their first request) runs a
    one-token step at every graph size up to ``max_bs`` (here eagerly, through the graphs' static
    buffers) and prompts of several lengths, then settles the launch tuner, and leaves the pool empty."""
    from orca_lab.kernels import attention
    monkeypatch.setattr(attention, "_TUNER", attention.LaunchTuner())
    llm = LLM(gpt=copy.deepcopy(small_gpt), engine=EngineConfig(max_bs=6, n_slots=4096))
    engine = llm.new_engine()
    graphs = llm._graphs = DecodeGraphs(llm.model, engine.scheduler.kv, 6, capture=False)
    engine.close()
    sizes, real_run = set(), graphs.run

    def run(batch):
        sizes.add(padded_size(len(batch)))
        return real_run(batch)
    graphs.run = run
    ran = llm.warm_up()
    assert sizes == {1, 2, 4, 8} and ran["batch_sizes"] == [1, 2, 4, 6]
    assert ran["prompt_lens"][:2] == [16, 64] and ran["prompt_lens"][-1] == llm.cfg.max_seq_len - 2
    assert attention._TUNER.settled
    engine = llm.new_engine()
    assert engine.scheduler.kv.stats().free == 4096
    engine.close()
    # runs known to be short (Figure 9's 32- and 128-token prompts) need no longer prompt warmed up
    assert llm.warm_up(longest=100)["prompt_lens"] == [16, 64, 100]
