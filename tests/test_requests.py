"""Per-request life: parameters, stops, finish reasons and cancellation (the hooks a server drives)."""
import numpy as np
import pytest
import torch
from helpers import random_prompts

from orca_lab import LLM, EngineConfig, SamplingParams
from orca_lab.engine.request import RequestState
from orca_lab.workload import TraceItem


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: this module runs many small iterations, which two OpenMP threads slow
    down several times on a busy 2-core machine (see executor.py)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def alone(llm, prompt, n, **kw):
    return llm.generate([prompt], max_gen_tokens=n, **kw)[0]


def engine_of(tiny_llm, system="orca", **ec):
    cfg = dict(max_bs=4, n_slots=4096, executor="local") | ec
    return LLM(gpt=tiny_llm.model, engine=EngineConfig(**cfg)).new_engine(system)


def drain(engine):
    events = []
    while engine.has_work():
        events += engine.step()
    return events


def assert_no_slot_leak(engine):
    kv = engine.scheduler.kv
    assert kv.n_reserved == 0 and kv.n_holders == 0 and kv._spans == [[0, kv.n_slots]]
    assert engine.stats().waiting == engine.stats().running == 0


# -- abort --------------------------------------------------------------------------------------
def test_abort_a_waiting_request_it_never_runs(tiny_llm):
    engine = engine_of(tiny_llm, max_bs=1)
    prompts = random_prompts(3, 257, 3, 20, seed=1)
    reqs = [engine.add_request(p, SamplingParams(max_gen_tokens=5)) for p in prompts]
    engine.step()
    assert engine.stats().waiting == 2 and engine.stats().running == 1
    assert engine.abort(reqs[1].rid) and reqs[1].finish_reason == "abort"
    assert engine.stats().waiting == 1
    events = drain(engine)
    assert reqs[1].output == [] and reqs[1].t_scheduled is None and reqs[1].n_iterations == 0
    assert all(r is not reqs[1] for r, _ in events)
    for i in (0, 2):
        assert reqs[i].output == alone(tiny_llm, prompts[i], 5) and reqs[i].finish_reason == "length"
    assert_no_slot_leak(engine)


def test_abort_between_iterations_frees_slots_at_once(tiny_llm):
    engine = engine_of(tiny_llm)
    prompts = random_prompts(3, 257, 3, 20, seed=2)
    reqs = [engine.add_request(p, SamplingParams(max_gen_tokens=8)) for p in prompts]
    engine.step()
    engine.step()
    victim = reqs[1]
    assert victim.state is RequestState.INCREMENT and len(victim.output) == 2
    reserved = engine.scheduler.kv.n_reserved
    assert engine.abort(victim)
    assert engine.scheduler.kv.n_reserved == reserved - victim.max_tokens and victim.slots is None
    assert victim.state is RequestState.FINISHED and not engine.abort(victim)   # already done
    events = drain(engine)
    assert all(r is not victim for r, _ in events) and len(victim.output) == 2
    for i in (0, 2):
        assert reqs[i].output == alone(tiny_llm, prompts[i], 8)
    assert_no_slot_leak(engine)


def test_abort_in_flight_drops_its_token_when_the_batch_returns(tiny_llm):
    """Two pipeline stages: after one step a batch is in flight and no token has come back."""
    engine = engine_of(tiny_llm, pipeline_parallel=2)
    prompts = random_prompts(4, 257, 3, 20, seed=3)
    reqs = [engine.add_request(p, SamplingParams(max_gen_tokens=6)) for p in prompts[:2]]
    assert engine.step() == [] and engine.n_scheduled == 1
    victim = reqs[0]
    assert victim.state is RequestState.RUNNING
    assert engine.abort(victim.rid) and victim.finished
    assert engine.scheduler.kv.n_holders == 2          # its slots are still read by the batch in flight
    reqs += [engine.add_request(p, SamplingParams(max_gen_tokens=6)) for p in prompts[2:]]  # joins mid-flight
    returned = engine.step()                            # submits a 2nd batch, the 1st comes back
    assert [r for r, _ in returned] == [reqs[1]]        # the victim's token was dropped, slots freed
    assert victim.output == [] and victim.slots is None and victim.finish_reason == "abort"
    drain(engine)
    for r, p in zip(reqs[1:], prompts[1:]):
        assert r.output == alone(tiny_llm, p, 6)
    assert_no_slot_leak(engine)


def test_request_level_baseline_abort(tiny_llm):
    """Queued: it leaves the queue. In the batch: held, no more tokens, slots freed with the batch."""
    engine = engine_of(tiny_llm, "ft", max_bs=2, n_slots=2048)
    prompts = random_prompts(4, 257, 3, 20, seed=4)
    gens = [3, 9, 4, 4]
    reqs = [engine.add_request(p, SamplingParams(max_gen_tokens=g)) for p, g in zip(prompts, gens)]
    engine.step()
    engine.step()
    assert engine.abort(reqs[2]) and reqs[2].t_scheduled is None            # queued
    n_before = len(reqs[1].output)
    assert engine.abort(reqs[1])                                             # active, in the batch
    assert engine.scheduler.kv.n_reserved == 2 * 1024                        # held until the batch ends
    events = drain(engine)
    assert len(reqs[1].output) == n_before and all(r is not reqs[1] for r, _ in events)
    assert reqs[2].output == [] and reqs[1].finish_reason == reqs[2].finish_reason == "abort"
    assert reqs[0].output == alone(tiny_llm, prompts[0], 3)
    assert reqs[3].output == alone(tiny_llm, prompts[3], 4)
    assert_no_slot_leak(engine)


def test_request_level_batch_ends_when_every_request_in_it_is_aborted(tiny_llm):
    engine = engine_of(tiny_llm, "ft", max_bs=2, n_slots=2048)
    reqs = [engine.add_request(p, SamplingParams(max_gen_tokens=20)) for p in random_prompts(3, 257, seed=5)]
    engine.step()
    engine.abort(reqs[0])
    engine.abort(reqs[1])
    events = drain(engine)                         # no deadlock: the empty batch ends, the third runs
    assert {r.rid for r, _ in events} == {reqs[2].rid} and len(reqs[2].output) == 20
    assert_no_slot_leak(engine)


def test_abort_names_unknown_requests(tiny_llm):
    engine = engine_of(tiny_llm)
    with pytest.raises(ValueError, match="rid=7 names no request"):
        engine.abort(7)


# -- driving the loop from outside ---------------------------------------------------------------
def test_idle_step_returns_at_once_and_requests_join_between_steps(tiny_llm, monkeypatch):
    engine = engine_of(tiny_llm, pipeline_parallel=2)
    waited = []                    # "at once": it neither waits for a batch nor sleeps (not timed)
    for obj, name in ((engine.executor, "wait"), (engine.clock, "sleep_until")):
        monkeypatch.setattr(obj, name, lambda *a, name=name: waited.append(name))
    assert engine.step() == [] and not engine.has_work()
    assert waited == []
    monkeypatch.undo()
    a = engine.add_request([1, 2, 3], SamplingParams(max_gen_tokens=4))
    engine.step()                                  # a's batch is in flight
    b = engine.add_request([4, 5, 6, 7], SamplingParams(max_gen_tokens=3))
    drain(engine)
    assert a.output == alone(tiny_llm, [1, 2, 3], 4) and b.output == alone(tiny_llm, [4, 5, 6, 7], 3)
    assert engine.step(timeout=0.01) == []


def test_finish_reason_is_recorded(tiny_llm):
    engine = engine_of(tiny_llm)
    done = engine.add_request([1, 2], SamplingParams(max_gen_tokens=2))
    gone = engine.add_request([3, 4], SamplingParams(max_gen_tokens=2))
    engine.abort(gone)
    drain(engine)
    df = engine.result().requests_df().set_index("rid")
    assert df.loc[done.rid, "finish_reason"] == "length" and df.loc[gone.rid, "finish_reason"] == "abort"


@pytest.mark.parametrize("prompt,kw,match", [
    ([], {}, "prompt is empty"), ([1, 300], {}, "prompt token id=300 is out of the vocabulary"),
    ([5.7, 6.0], {}, "prompt token id=5.7 must be an integer"),      # never rounded into another prompt
    ([True, 1], {}, "prompt token id=True must be an integer"), (["5"], {}, "prompt token id='5' must be an integer"),
    ([1] * 1020, dict(max_gen_tokens=8), "exceeds the model's max length"),
    ([1] * 600, dict(max_gen_tokens=8), "more than the n_slots=512"),
    ([1], dict(stop_token_ids=[257]), "stop_token_ids=257 is out of the vocabulary"),
    ([1], dict(eos_token_id=999, ignore_eos=False), "eos_token_id=999 is out of the vocabulary"),
])
def test_add_request_refuses_and_adds_nothing(tiny_llm, prompt, kw, match):
    engine = engine_of(tiny_llm, n_slots=512)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, SamplingParams(**kw))
    # several at once: a good one before the bad one is not added either
    with pytest.raises(ValueError, match=match):
        engine.add_requests([((5, 6), SamplingParams(), None), (prompt, SamplingParams(**kw), None)])
    assert engine.requests == [] and not engine.has_work()


@pytest.mark.parametrize("arrival", [float("nan"), float("inf"), 1e12, -1.0, "0"])
def test_an_arrival_no_clock_reaches_is_refused_naming_its_item(tiny_llm, arrival):
    """A nan arrival never comes (the engine waited for it for ever, the rest of the trace with it);
    past 1e9 s, sleeping until it overflows."""
    engine = engine_of(tiny_llm)
    trace = [TraceItem(0.0, (4, 5), 2), TraceItem(arrival, (1, 2, 3), 2)]
    with pytest.raises(ValueError, match=r"trace\[1\]\.arrival=.* \[0, 1000000000\]"):
        engine.run(trace)
    with pytest.raises(ValueError, match=r"^arrival="):
        engine.add_request([1, 2], SamplingParams(), arrival=arrival)
    assert engine.requests == [] and not engine.has_work()
    assert len(engine.run([TraceItem(np.float32(0.0), (4, 5), 2)]).requests) == 1   # numpy's floats are numbers


def test_integer_ids_of_numpy_and_torch_are_a_prompt_as_they_are(tiny_llm):
    engine = engine_of(tiny_llm, n_slots=512)
    got = [engine.add_request(p, SamplingParams(max_gen_tokens=1)).prompt
           for p in (np.array([5, 6]), torch.tensor([5, 6]), [np.int64(5), torch.tensor(6)])]
    assert got == [[5, 6]] * 3 and all(type(t) is int for p in got for t in p)


# -- per-request parameters in the Python API: each batched == alone, token for token ---------------
def alone_with(llm, prompt, sp, system="orca"):
    return llm.generate([prompt], system=system, sampling_params=sp)[0]


@pytest.mark.parametrize("system", ["orca", "ft"])
def test_per_request_max_gen_tokens(tiny_llm, system):
    prompts = random_prompts(5, 257, 2, 30, seed=8)
    gens = [1, 7, 3, 12, 5]
    out = tiny_llm.generate(prompts, max_gen_tokens=gens, system=system)
    assert [len(o) for o in out] == gens
    assert out == [alone(tiny_llm, p, g) for p, g in zip(prompts, gens)]


def test_per_request_sampling_params(tiny_llm):
    prompts = random_prompts(5, 257, 2, 30, seed=9)
    params = [SamplingParams(max_gen_tokens=6, temperature=0.8, seed=1),
              SamplingParams(max_gen_tokens=4),                                      # greedy
              SamplingParams(max_gen_tokens=8, temperature=1.2, top_k=30, seed=2),
              SamplingParams(max_gen_tokens=5, temperature=1.0, top_p=0.7, seed=3),
              SamplingParams(max_gen_tokens=6, temperature=1.0, top_k=50, top_p=0.9, seed=4)]
    out = tiny_llm.generate(prompts, sampling_params=params)
    assert out == [alone_with(tiny_llm, p, sp) for p, sp in zip(prompts, params)]
    assert out[1] == alone(tiny_llm, prompts[1], 4)
    reseeded = [SamplingParams(**{**vars(sp), "seed": 99}) if sp.seed else sp for sp in params]
    assert tiny_llm.generate(prompts, sampling_params=reseeded) != out      # the seed matters


def test_top_p_keeps_the_nucleus_only(tiny_llm):
    prompt = random_prompts(1, 257, 5, 20, seed=10)[0]
    nucleus_of_one = SamplingParams(max_gen_tokens=8, temperature=1.0, top_p=1e-6, seed=5)
    assert alone_with(tiny_llm, prompt, nucleus_of_one) == alone(tiny_llm, prompt, 8)   # only the argmax
    wide = SamplingParams(max_gen_tokens=8, temperature=1.0, top_p=1.0, seed=5)
    assert alone_with(tiny_llm, prompt, wide) != alone(tiny_llm, prompt, 8)


def eos_after(tiny_llm, prompt, k):
    """A token the greedy output first shows at position k (so EOS there stops it after k+1 tokens)."""
    out = alone(tiny_llm, prompt, 24)
    k = next(i for i in range(k, 24) if out[i] not in out[:i])
    return out, k


@pytest.mark.parametrize("system", ["orca", "ft"])
def test_eos_stops_a_request_and_frees_its_slots_at_once(tiny_llm, system):
    prompts = random_prompts(3, 257, 3, 20, seed=11)
    full, k = eos_after(tiny_llm, prompts[0], 3)
    params = [SamplingParams(max_gen_tokens=24, ignore_eos=False, eos_token_id=full[k]),
              SamplingParams(max_gen_tokens=24, eos_token_id=full[k]),                 # ignores EOS
              SamplingParams(max_gen_tokens=10, ignore_eos=False, eos_token_id=full[k])]
    engine = engine_of(tiny_llm, system, n_slots=4096)
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while not reqs[0].finished:
        engine.step()
        if reqs[0].finished and system == "orca":
            assert reqs[0].slots is None and engine.scheduler.kv.n_holders == 2     # freed in that step
    assert reqs[0].output == full[:k + 1] and reqs[0].finish_reason == "stop"
    drain(engine)
    assert reqs[1].output == full[:0] + alone(tiny_llm, prompts[1], 24) and reqs[1].finish_reason == "length"
    for r, p, sp in zip(reqs, prompts, params):
        assert r.output == alone_with(tiny_llm, p, sp, system)
    assert_no_slot_leak(engine)


def test_eos_defaults_from_the_tokenizer(tiny_llm):
    engine = engine_of(tiny_llm)
    assert engine.add_request([1], SamplingParams(ignore_eos=False)).params.eos_token_id == 256
    assert engine.add_request([1], SamplingParams()).params.eos_token_id is None     # ignored: not filled


def test_stop_token_ids_per_request(tiny_llm):
    prompts = random_prompts(4, 257, 3, 20, seed=12)
    params = []
    for i, p in enumerate(prompts):
        full, k = eos_after(tiny_llm, p, 1 + 2 * i)
        params.append(SamplingParams(max_gen_tokens=24, stop_token_ids=[full[k], 256]))
    done = tiny_llm.complete(prompts, sampling_params=params)
    for c, p, sp in zip(done, prompts, params):
        assert c.finish_reason == "stop" and c.token_ids[-1] in sp.stop_token_ids
        assert c.token_ids == alone_with(tiny_llm, p, sp)
        assert c.text == tiny_llm.tokenizer.decode(c.token_ids[:-1])                  # stop token not in text


def stop_string_in(text):
    """Two characters of ``text`` past its start, neither an incomplete byte sequence (U+FFFD)."""
    s = next(text[i:i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    return s, text.find(s)


def test_stop_strings_end_the_text_before_them(tiny_llm):
    prompts = random_prompts(4, 256, 3, 20, seed=7)
    full = tiny_llm.complete(prompts, 24)
    params, expect = [], []
    for c in full:
        stop, j = stop_string_in(c.text)
        params.append(SamplingParams(max_gen_tokens=24, stop=["\x00never", stop]))
        expect.append(c.text[:j])
    done = tiny_llm.complete(prompts, sampling_params=params)
    for c, f, p, sp, text in zip(done, full, prompts, params, expect):
        assert c.finish_reason == "stop" and c.text == text
        assert c.token_ids == f.token_ids[:len(c.token_ids)]      # the tokens up to the stop string's end
        assert c.token_ids == alone_with(tiny_llm, p, sp)


def test_streamed_text_only_grows_and_ends_as_the_final_text(tiny_llm):
    prompt = random_prompts(1, 256, 3, 20, seed=7)[0]
    full = tiny_llm.complete([prompt], 24)[0].text
    stop, j = stop_string_in(full)
    engine = engine_of(tiny_llm)
    req = engine.add_request(prompt, SamplingParams(max_gen_tokens=24, stop=[stop]))
    shown = ""
    while engine.has_work():
        for r, _ in engine.step():
            assert r.text.startswith(shown)
            shown = r.text
    assert shown == req.text == full[:j]


def test_a_stop_string_needs_a_tokenizer(tiny_llm):
    llm = LLM(gpt=tiny_llm.model, tokenizer=None)
    llm.tokenizer = None
    with pytest.raises(ValueError, match="stop=.*needs a tokenizer"):
        llm.generate([[1, 2]], stop="x")


@pytest.mark.parametrize("kw,match", [
    (dict(top_p=0.0), r"top_p=0.0 is out of range: allowed \(0.0, 1.0\]"), (dict(top_p=1.5), "top_p=1.5"),
    (dict(stop=[""]), "empty string"), (dict(stop=[1]), "stop=.*str"),
    (dict(stop_token_ids=[-1]), "stop_token_ids=-1"), (dict(stop_token_ids="a"), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(seed=-1), "seed=-1"),
    (dict(stop=["ok", "a\ud800"]), r"stop\[1\] holds a lone surrogate"),      # no tokenizer could match it
    # lists the engine reads at every token: capped where they enter (one request held others 3.5 s)
    (dict(stop_token_ids=[1] * 1025), "stop_token_ids holds 1025 items: allowed at most 1024"),
    (dict(stop=["a"] * 65), "stop holds 65 items: allowed at most 64"),
    (dict(stop=["a" * 1025]), r"stop\[0\] is 1025 characters long: allowed at most 1024"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias holds 1025 items: allowed at most 1024"),
])
def test_new_sampling_params_are_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
    assert SamplingParams(stop="ab", stop_token_ids=3).stop == ("ab",)


@pytest.mark.parametrize("kw,match", [
    (dict(max_gen_tokens=[2, 3]), "max_gen_tokens has 2 entries for 3 prompts"),
    (dict(sampling_params=[SamplingParams()]), "sampling_params has 1 entries for 3 prompts"),
    (dict(sampling_params=SamplingParams(), temperature=1.0), "either sampling_params or"),
    (dict(max_gen_tokens=[2, 0, 1]), "max_gen_tokens=0 is out of range"),
])
def test_per_prompt_lists_must_match_the_prompts(tiny_llm, kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_llm.generate([[1], [2], [3]], **kw)


@pytest.mark.parametrize("prompts", [5, None, {1: 2}, b"ab"])
def test_prompts_that_are_no_prompt_or_list_are_refused_by_name(tiny_llm, prompts):
    with pytest.raises(ValueError, match="prompts=.*allowed a text, or a list of prompts"):
        tiny_llm.generate(prompts, 2)


# -- the caller's model and tokenizer ---------------------------------------------------------------
def test_llm_leaves_the_callers_model_as_it_is(tiny_llm):
    import torch

    from orca_lab.model.gpt import GPT
    mine = GPT.random(tiny_llm.cfg, seed=1)
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    assert LLM(gpt=mine).model is mine                                    # nothing to change: shared
    kernels = LLM(gpt=mine, engine=EngineConfig(attention_backend="torch"))
    assert kernels.model is not mine and kernels.model.wte.weight is mine.wte.weight   # same weights
    half = LLM(gpt=mine, engine=EngineConfig(dtype="bfloat16", fused_ops_backend="torch"))
    assert half.model.wte.weight.dtype == torch.bfloat16 and half.generate([[1, 2]], 2)
    assert (mine.attention_backend, mine.fused_ops_backend) == ("auto", "auto")
    assert all(v.dtype == torch.float32 and torch.equal(v, before[k]) for k, v in mine.state_dict().items())
    assert LLM(gpt=mine).generate([[5, 6, 7]], 4)[0] == alone(tiny_llm, [5, 6, 7], 4)


class CharTokenizer:
    """A tokenizer of the user's own: one id per lowercase letter or space, decoded back."""
    alphabet = " abcdefghijklmnopqrstuvwxyz"

    def encode(self, text):
        return [self.alphabet.index(c) for c in text]

    def decode(self, ids):
        return "".join(self.alphabet[i] if i < len(self.alphabet) else "?" for i in ids)


def test_any_tokenizer_with_encode_and_decode_works(tiny_llm):
    llm = LLM(gpt=tiny_llm.model, tokenizer=CharTokenizer())
    c = llm.complete(["hello orca"], 6)[0]
    assert c.prompt_token_ids == CharTokenizer().encode("hello orca")
    assert c.token_ids == alone(tiny_llm, c.prompt_token_ids, 6) and c.text == CharTokenizer().decode(c.token_ids)
    with pytest.raises(TypeError, match="needs encode"):
        LLM(gpt=tiny_llm.model, tokenizer=object())
    with pytest.raises(ValueError, match=r"eos_token_id=257 is out of range: allowed \[0, 256\]"):
        LLM(gpt=tiny_llm.model, eos_token_id=257)


def test_forget_bounds_what_a_long_lived_engine_keeps():
    """A server's engine drops the oldest finished requests and iteration records, never a live one."""
    llm = LLM("tiny", seed=0, engine=EngineConfig(max_bs=4, n_slots=2048))
    engine = llm.new_engine()
    try:
        done = [engine.add_request([5, 6, 7], SamplingParams(max_gen_tokens=2)) for _ in range(6)]
        while engine.has_work():
            engine.step()
        running = engine.add_request([1, 2], SamplingParams(max_gen_tokens=4))
        engine.step()
        engine.forget(keep_requests=2, keep_iterations=3)
        assert [r.rid for r in engine.requests] == [done[-1].rid, running.rid]
        assert len(engine.records) == 3
        while engine.has_work():
            engine.step()
        assert running.finish_reason == "length" and engine.result().requests[-1].n_generated == 4
        assert engine.scheduler.kv.n_reserved == 0
    finally:
        engine.close()
