"""Per-request life: parameters, stops, finish reasons and cancellation (the hooks a server drives)."""
import time

import pytest

from helpers import random_prompts
from orca_lab import LLM, EngineConfig, SamplingParams
from orca_lab.engine.request import RequestState


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
    assert kv.n_reserved == 0 and kv.n_holders == 0 and sorted(kv._free) == list(range(kv.n_slots))
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
def test_idle_step_returns_at_once_and_requests_join_between_steps(tiny_llm):
    engine = engine_of(tiny_llm, pipeline_parallel=2)
    t = time.perf_counter()
    assert engine.step() == [] and not engine.has_work()
    assert time.perf_counter() - t < 0.05
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
    ([], {}, "prompt is empty"), ([1, 300], {}, "prompt token id 300"),
    ([1] * 1020, dict(max_gen_tokens=8), "exceeds the model's max length"),
    ([1] * 600, dict(max_gen_tokens=8), "exceeds n_slots=512"),
    ([1], dict(stop_token_ids=[257]), "stop_token_ids=257 is out of the vocabulary"),
    ([1], dict(eos_token_id=999, ignore_eos=False), "eos_token_id=999 is out of the vocabulary"),
])
def test_check_request_refuses_what_add_request_refuses_and_adds_nothing(tiny_llm, prompt, kw, match):
    engine = engine_of(tiny_llm, n_slots=512)
    for call in (engine.check_request, engine.add_request):
        with pytest.raises(ValueError, match=match):
            call(prompt, SamplingParams(**kw))
    assert engine.requests == [] and not engine.has_work()
    assert engine.check_request((5, 6), SamplingParams()) == [5, 6] and engine.requests == []
