"""The engine's invariants: batched = alone, FCFS, reservations, in-flight batches, the baseline."""
import copy
import itertools

import pytest
import torch
from helpers import engine_config, on_device, random_prompts

from orca_lab import LLM, EngineConfig, SamplingParams
from orca_lab.config import FieldError
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.request import Request, RequestState
from orca_lab.engine.scheduler import OrcaScheduler
from orca_lab.workload import TraceItem, paper_trace


@pytest.fixture(scope="module")
def tiny_llm(tiny_llm):
    """The session's tiny model on the test device (a GPU where there is one)."""
    return on_device(tiny_llm)


def alone(llm, prompt, n, **kw):
    return llm.generate([prompt], max_gen_tokens=n, **kw)[0]


def ragged_trace(vocab, n=10, seed=0):
    """Requests of different prompt and generation lengths, all present at the start."""
    prompts = random_prompts(n, vocab, 1, 60, seed)
    gens = [1 + (7 * i + seed) % 13 for i in range(n)]
    return [TraceItem(0.0, tuple(p), g) for p, g in zip(prompts, gens)]


@pytest.mark.parametrize("system,n_workers,mbs", [("orca", 1, None), ("orca", 3, None), ("ft", 1, None),
                                                   ("ft", 2, 2), ("ft", 2, 1)])
def test_batched_greedy_equals_each_request_alone(tiny_llm, system, n_workers, mbs):
    """In this process; with n_workers > 1 the pipeline stages are emulated (test_parallel.py runs
    real worker processes)."""
    llm = LLM(gpt=tiny_llm.model, engine=engine_config(max_bs=3, n_slots=4096, pipeline_parallel=n_workers,
                                                      executor="local"))
    trace = ragged_trace(llm.cfg.vocab_size, seed=n_workers)
    result = llm.serve(trace, system=system, mbs=mbs)
    mixed = [it for it in result.iterations if {"prefill", "decode"} <= set(it.phases)]
    if system == "orca":
        assert mixed, "the trace should mix initiation and increment phases in one iteration"
    by_rid = {r.rid: r for r in result.requests}
    for rid, item in enumerate(trace):
        assert list(by_rid[rid].output) == alone(tiny_llm, list(item.prompt), item.max_gen_tokens)


def test_sampled_output_does_not_depend_on_batching(tiny_llm):
    prompts = random_prompts(5, tiny_llm.cfg.vocab_size, seed=3)
    kw = dict(temperature=0.9, top_k=20, seed=11)
    batched = tiny_llm.generate(prompts, max_gen_tokens=6, **kw)
    assert batched == [alone(tiny_llm, p, 6, **kw) for p in prompts]
    assert batched != tiny_llm.generate(prompts, max_gen_tokens=6)     # not greedy after all


def test_unseeded_sampling_draws_from_os_entropy_and_seeded_requests_beside_it_do_not_move(tiny_llm):
    """Without a seed, two calls draw different tokens (48 tokens at temperature 1 over 257 ids:
    equal by chance with negligible probability); seeded requests batched with unseeded ones get
    the tokens they get alone, in every system."""
    prompt = random_prompts(1, tiny_llm.cfg.vocab_size, 8, 8, seed=9)[0]
    draws = [tiny_llm.generate([prompt], max_gen_tokens=48, temperature=1.0)[0] for _ in range(2)]
    assert draws[0] != draws[1]
    seeded = SamplingParams(max_gen_tokens=6, temperature=1.0, seed=5)
    unseeded = SamplingParams(max_gen_tokens=6, temperature=1.0)
    alone_seeded = tiny_llm.generate([prompt], sampling_params=[seeded])[0]
    llm = LLM(gpt=tiny_llm.model, engine=engine_config(max_bs=4, n_slots=4096, block_size=8,
                                                      max_num_batched_tokens=16))
    for system in ("orca", "ft", "paged", "chunked"):
        out = llm.generate([prompt, prompt, prompt], system=system, sampling_params=[unseeded, seeded, unseeded])
        assert out[1] == alone_seeded, system


def test_stream_yields_one_token_per_request_per_iteration(tiny_llm):
    prompts = random_prompts(3, tiny_llm.cfg.vocab_size, seed=4)
    events = list(tiny_llm.stream(prompts, max_gen_tokens=4))
    assert sorted(i for i, _ in events) == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert [i for i, _ in events[:3]] == [0, 1, 2]        # all three prefill in the first iteration
    streamed = [[t for i, t in events if i == k] for k in range(3)]
    assert streamed == tiny_llm.generate(prompts, max_gen_tokens=4)


def test_string_prompts_use_the_byte_tokenizer(tiny_llm):
    out = tiny_llm.generate(["hello", "orca"], max_gen_tokens=3)
    assert out[0] == alone(tiny_llm, list(b"hello"), 3)


@pytest.mark.parametrize("system", ["orca", "ft"])
def test_every_slot_is_free_after_a_trace(tiny_llm, system):
    engine = tiny_llm.new_engine(system)
    engine.run(paper_trace(8, rate=None, seed=2, scale=0.05, vocab_size=tiny_llm.cfg.vocab_size))
    kv = engine.scheduler.kv
    assert engine.scheduler.n_rsrv == 0 and kv.n_holders == 0
    assert kv.stats().free == kv.n_slots and kv._spans == [[0, kv.n_slots]]   # one free run
    assert all(r.state is RequestState.FINISHED for r in engine.requests)


def test_iteration_level_fcfs_property(tiny_llm):
    """If x_i arrived before x_j, x_i has run at least as many iterations as x_j, at all times."""
    llm = LLM(gpt=tiny_llm.model, engine=engine_config(max_bs=3, n_slots=160))
    trace = [TraceItem(0.0, tuple(p), 1 + i % 5) for i, p in
             enumerate(random_prompts(9, llm.cfg.vocab_size, 5, 50, seed=5))]
    result = llm.serve(trace)
    counts = {r.rid: 0 for r in result.requests}
    for it in sorted(result.iterations, key=lambda it: it.end):
        for rid in it.rids:
            counts[rid] += 1
        done = {r.rid for r in result.requests if r.t_finish is not None and r.t_finish <= it.end}
        for i, j in itertools.combinations(sorted(counts), 2):   # rid order = arrival order here
            if i not in done:
                assert counts[i] >= counts[j], (i, j, counts)
    assert max(len(it.rids) for it in result.iterations) == 3     # max_bs held


def test_select_breaks_instead_of_skipping():
    kv = KVSlotManager(100)
    sched = OrcaScheduler(kv, max_bs=8)
    params = lambda n: SamplingParams(max_gen_tokens=n)
    big, too_big, small = (Request(0, [1] * 50, params(10), 0.0), Request(1, [1] * 40, params(10), 1.0),
                           Request(2, [1] * 5, params(5), 2.0))
    for r in (big, too_big, small):
        sched.add(r)
    batch = sched.select()
    assert batch.requests == [big]           # 60 reserved; 50 more do not fit, so 10 must wait too
    assert sched.n_rsrv == 60 and small.state is RequestState.INITIATION
    assert sched.select() is None            # big is RUNNING; the queue head still does not fit


def test_n_workers_batches_in_flight(tiny_llm):
    llm = LLM(gpt=tiny_llm.model, engine=engine_config(max_bs=2, n_slots=4096, pipeline_parallel=3,
                                                      executor="local"))
    result = llm.serve(ragged_trace(llm.cfg.vocab_size, n=8))
    assert max(it.in_flight for it in result.iterations) == 3
    assert {it.stage for it in result.iterations} == {0, 1, 2}
    first = [it for it in result.iterations if it.stage == 0][:3]
    assert len({it.rids for it in first}) == 3 and not set(first[0].rids) & set(first[1].rids)


def test_baseline_micro_batches_take_turns_through_the_pipeline(tiny_llm):
    llm = LLM(gpt=tiny_llm.model, engine=engine_config(max_bs=4, n_slots=4096, pipeline_parallel=2,
                                                      executor="local"))
    trace = [TraceItem(0.0, tuple(range(1, 4 + i)), 2 + i) for i in range(4)]
    result = llm.serve(trace, system="ft", mbs=1)
    order = [it.rids for it in result.iterations if it.stage == 0]
    assert order[:8] == [(0,), (1,), (2,), (3,)] * 2                        # round robin, 4 micro-batches
    assert len(order) == 4 * (3 + 3 + 5 - 3)                                 # each runs FT's fixed step count
    assert max(it.in_flight for it in result.iterations) == 2


def test_baseline_pads_holds_early_finishers_and_reserves_max_length(tiny_llm):
    llm = LLM(gpt=tiny_llm.model, engine=engine_config(max_bs=3, n_slots=3 * 1024))
    trace = [TraceItem(0.0, tuple(range(1, 9)), 2), TraceItem(0.0, tuple(range(1, 21)), 9),
             TraceItem(0.0, tuple(range(1, 6)), 3), TraceItem(0.0, (7, 7), 2)]
    engine = llm.new_engine("ft")
    result = engine.run(trace)
    reqs = {r.rid: r for r in result.requests}
    first_batch = [0, 1, 2]
    assert len({reqs[i].t_finish for i in first_batch}) == 1            # returned together
    assert reqs[3].t_scheduled >= reqs[0].t_finish                        # 3 slots of 1024: 4th waits
    its = [it for it in result.iterations if set(it.rids) == set(first_batch)]
    assert its[0].q_lens == (5, 5, 5)                                     # shortest prompt first
    assert all(it.q_lens == (1, 1, 1) for it in its[1:])                  # then one token each
    assert all(it.n_tokens == 3 * it.q_lens[0] for it in its)             # padded [B, L]
    assert len(its) == 20 + 9 - 5                                         # until the longest is done
    assert any("held" in it.phases for it in its)
    assert max(it.kv_reserved for it in result.iterations) == 3 * 1024
    assert [len(reqs[i].output) for i in range(4)] == [2, 9, 3, 2]


# -- bad input is refused where it enters, and the engine keeps serving the others --------------
@pytest.mark.parametrize("prompt,n,match", [
    ([], 4, "prompt is empty"),
    ([1, 2, 257], 4, "out of the vocabulary"),
    ([1, -1], 4, "out of the vocabulary"),
    ([1, 2], 0, "max_gen_tokens=0"),
    ([1] * 1000, 100, "exceeds the model's max length"),
    ([1] * 600, 100, r"= 700 tokens, for which orca reserves 700 K/V slots, more than the n_slots=512"),
    ("text", 4, "list of token ids"),
])
def test_bad_request_is_refused_and_the_engine_serves_the_others(tiny_llm, prompt, n, match):
    llm = LLM(gpt=tiny_llm.model, engine=engine_config(max_bs=4, n_slots=512))
    engine = llm.new_engine()
    good = engine.add_request([5, 6, 7], SamplingParams(max_gen_tokens=3))
    with pytest.raises((ValueError, TypeError), match=match):
        engine.add_request(prompt, SamplingParams(max_gen_tokens=n))
    engine.run()
    assert good.output == alone(tiny_llm, [5, 6, 7], 3) and engine.scheduler.n_rsrv == 0


def test_baseline_refuses_a_pool_its_max_length_reservation_cannot_hold(tiny_llm):
    """The baseline reserves the model's whole length (1024) for every request: over 512 slots it could
    serve none, so the engine is refused where it is built, naming n_slots, not each request after."""
    llm = LLM(gpt=tiny_llm.model, engine=engine_config(max_bs=4, n_slots=512))
    with pytest.raises(FieldError, match=r"n_slots=512 cannot hold one request of ft: it reserves 1024 K/V "
                                         r"slots for the smallest; allowed n_slots >= 1024") as e:
        llm.new_engine("ft")
    assert e.value.field == "n_slots"
    assert llm.new_engine("orca").add_request([1, 2], SamplingParams(max_gen_tokens=2))   # orca serves on it


@pytest.mark.parametrize("kw,match", [
    (dict(max_bs=0), "max_bs=0 is out of range"), (dict(n_slots=0), "n_slots=0"),
    (dict(dtype="int8"), "dtype='int8'"), (dict(device="tpu"), "device='tpu'"),
    (dict(attention_backend="cuda"), "attention_backend"), (dict(pipeline_parallel=0), "pipeline_parallel"),
])
def test_bad_engine_config_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_more_stages_than_layers_is_refused(tiny_llm):
    with pytest.raises(ValueError, match=r"pipeline_parallel=5 is out of range: allowed \[1, 4\]"):
        LLM(gpt=tiny_llm.model, engine=engine_config(pipeline_parallel=5, executor="local")).new_engine()


def test_kv_manager_reports_used_reserved_and_free():
    kv = KVSlotManager(50, n_layers=2, n_heads=2, head_dim=4)
    r = Request(0, [1, 2, 3], SamplingParams(max_gen_tokens=7))
    kv.reserve(r, r.max_tokens)
    r.n_cached = 4
    assert kv.stats() == type(kv.stats())(used=4, reserved_unused=6, free=40)
    assert r.slots.tolist() == list(range(10)) and kv.layer(1)[0].shape == (50, 2, 4)
    kv.release(r)
    assert kv.stats().free == 50 and r.slots is None
    with pytest.raises(RuntimeError, match="cannot reserve 51"):
        kv.reserve(Request(1, [1], SamplingParams()), 51)


def test_sampling_params_are_validated():
    for kw, match in [(dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"),
                      (dict(temperature=float("nan")), "temperature")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)


def iteration_logits(llm, prompts, n, monkeypatch, forced=None):
    """The last-token logits of every iteration of ``llm.generate(prompts, n)``, as fp32 on the CPU,
    and the tokens chosen; ``forced``: the tokens to feed instead of the argmax (teacher forcing),
    so another run sees exactly the same inputs at every iteration."""
    from orca_lab.model import executor
    logits, tokens = [], []

    def record(rows, requests):
        logits.append(rows.float().cpu())
        tokens.append(forced[len(tokens)] if forced else rows.argmax(-1).tolist())
        return tokens[-1]

    monkeypatch.setattr(executor, "sample", record)
    llm.generate(prompts, max_gen_tokens=n)
    return logits, tokens


@pytest.mark.parametrize("dtype,tol", [("float16", 0.01), ("bfloat16", 0.05)])
def test_float_dtypes_give_the_fp32_logits(tiny_llm, monkeypatch, dtype, tol):
    """Half precision on the same weights and the same inputs (prefill, then decode iterations with
    fp32's tokens fed back): every logit within ``tol`` of fp32's, relative to the largest.
    Sequences are not compared: random-weight half precision picks other tokens after a few steps."""
    prompts = random_prompts(4, tiny_llm.cfg.vocab_size, 3, 40, seed=6)
    ref, tokens = iteration_logits(tiny_llm, prompts, 4, monkeypatch)
    half = LLM(gpt=copy.deepcopy(tiny_llm.model), engine=tiny_llm.engine_config.replace(dtype=dtype))
    assert half.model.wte.weight.dtype == getattr(torch, dtype)
    out, _ = iteration_logits(half, prompts, 4, monkeypatch, forced=tokens)
    assert len(out) == len(ref) == 4 and [r.shape for r in out] == [r.shape for r in ref]
    for i, (a, b) in enumerate(zip(out, ref)):
        err = (a - b).abs().max().item() / b.abs().max().item()
        assert err < tol, f"iteration {i}: {dtype} logits off by {err:.3g} of the largest (allowed {tol})"


def test_the_real_clock_sleeps_through_long_idle_spells_and_polls_the_last_of_them():
    import time

    from orca_lab.engine.clock import RealClock
    clock = RealClock()
    target = clock.now() + RealClock.POLL + 0.15
    cpu = time.process_time()
    clock.sleep_until(target)
    assert clock.now() >= target
    assert time.process_time() - cpu < RealClock.POLL + 0.1     # the 0.15 s before the poll were slept
    clock.sleep_until(clock.now() - 1.0)                         # a time already past returns at once
