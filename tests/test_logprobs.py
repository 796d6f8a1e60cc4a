"""Log-probabilities, echo and the sampling fields, in process on every system: each against a plain
reference computed apart (transformers' GPT-2 on the same weights, full sequences, fp32), and each
request batched equal to the same request alone."""
import dataclasses
import json
import math

import pytest
import torch

from orca_lab import LLM, EngineConfig, SamplingParams

from helpers import hf_log_softmax, random_prompts

SYSTEMS = ("orca", "ft", "paged", "chunked")


@pytest.fixture(scope="module")
def llm():
    # a 16-token prefill budget: the chunked policy splits every prompt here into chunks
    return LLM("tiny", seed=0, engine=EngineConfig(max_bs=4, n_slots=2048, max_num_batched_tokens=16))


@pytest.fixture(scope="module")
def reference(llm, tmp_path_factory):
    """``log_softmax`` of transformers' logits for a whole sequence: ``[len(ids), vocab]``, fp32."""
    return hf_log_softmax(llm, tmp_path_factory.mktemp("tiny"))


def check_entry(entry, token, row, k):
    assert entry.token == token
    assert math.isclose(entry.logprob, row[token].item(), abs_tol=1e-4)
    want = row.topk(k)
    assert [t for t, _ in entry.top] == want.indices.tolist()
    assert all(math.isclose(a, b, abs_tol=1e-4) for (_, a), b in zip(entry.top, want.values.tolist()))


@pytest.mark.parametrize("system", SYSTEMS)
def test_logprobs_and_prompt_logprobs_equal_log_softmax_of_the_models_logits(llm, reference, system):
    prompts = random_prompts(4, 257, lo=3, hi=40, seed=5)
    params = [SamplingParams(max_gen_tokens=6, logprobs=k, prompt_logprobs=k) for k in (0, 1, 5, 20)]
    for prompt, c, p in zip(prompts, llm.complete(prompts, system=system, sampling_params=params), params):
        lp = reference(prompt + c.token_ids)
        assert len(c.logprobs) == 6 and len(c.prompt_logprobs) == len(prompt) and c.prompt_logprobs[0] is None
        for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            check_entry(entry, tok, lp[len(prompt) + i - 1], p.logprobs)
        for i in range(1, len(prompt)):
            check_entry(c.prompt_logprobs[i], prompt[i], lp[i - 1], p.prompt_logprobs)


@pytest.mark.parametrize("system", ["paged", "chunked"])
def test_prompt_logprobs_score_every_position_with_prefix_caching(reference, system):
    """A prompt already cached (its blocks from an earlier request) is still computed whole for a
    request that asks for its prompt's logprobs: no position goes unscored."""
    cached = LLM("tiny", seed=0, engine=EngineConfig(max_bs=4, n_slots=2048, block_size=4, prefix_caching=True))
    prompt = random_prompts(1, 257, lo=30, hi=31, seed=9)[0]
    cached.generate([prompt], max_gen_tokens=2, system=system)              # fills the cache
    c = cached.complete([prompt], system=system, sampling_params=[SamplingParams(max_gen_tokens=2, prompt_logprobs=3)])[0]
    lp = reference(prompt)
    assert len(c.prompt_logprobs) == len(prompt) and c.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        check_entry(c.prompt_logprobs[i], prompt[i], lp[i - 1], 3)


def test_logprobs_come_from_the_raw_distribution_not_the_sampler(llm):
    """Temperature, top-k and a bias change which token is drawn, never its reported logprob."""
    prompt = random_prompts(1, 257, lo=8, hi=9, seed=2)[0]
    raw = llm.complete([prompt], sampling_params=SamplingParams(max_gen_tokens=1, logprobs=3))[0]
    biased = llm.complete([prompt], sampling_params=SamplingParams(
        max_gen_tokens=1, logprobs=3, temperature=0.5, top_k=2, seed=1, logit_bias={7: 100.0}))[0]
    assert biased.token_ids == [7]
    assert biased.logprobs[0].top == raw.logprobs[0].top          # the model's own top 3, bias or not


def test_requests_without_logprobs_carry_none(llm):
    c = llm.complete([[1, 2, 3]], max_gen_tokens=2)[0]
    assert c.logprobs is None and c.prompt_logprobs is None


# -- the sampling fields ------------------------------------------------------------------------
FIELDS = {
    "logit_bias": dict(logit_bias={65: 5.0, 66: -100.0, 97: 3.5}),
    "presence_penalty": dict(presence_penalty=1.5),
    "frequency_penalty": dict(frequency_penalty=1.2),
    "negative_penalties": dict(presence_penalty=-0.7, frequency_penalty=-0.4),
    "repetition_penalty": dict(repetition_penalty=1.8),
    "min_tokens": dict(min_tokens=6, ignore_eos=False, stop_token_ids=(47,)),
}


def plain_reference(reference, prompt, n, p: SamplingParams, eos):
    """Greedy decoding written out: full-sequence logprobs each step, each field applied by hand."""
    out = []
    for _ in range(n):
        row = reference(prompt + out)[-1].clone()       # log_softmax differs from logits by a constant
        if len(out) < p.min_tokens:
            for t in list(p.stop_token_ids) + [eos]:
                row[t] = -math.inf
        for t, b in p.logit_bias:
            row[t] += b
        for t in set(prompt + out):
            if p.repetition_penalty != 1.0:
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t in set(out):
            row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
        tok = int(row.argmax())
        out.append(tok)
        if tok in p.stop_token_ids or (not p.ignore_eos and tok == eos):
            break
    return out


@pytest.mark.parametrize("field", FIELDS)
def test_each_sampling_field_equals_a_plain_reference_batched_and_alone(llm, field):
    prompts = random_prompts(3, 257, lo=2, hi=20, seed=11)
    p = SamplingParams(max_gen_tokens=12, **FIELDS[field])
    # the repetition penalty divides positive logits: the reference must see logits, not logprobs
    transformers = pytest.importorskip("transformers")
    hf = _hf(llm, transformers)

    def logits(ids):
        with torch.inference_mode():
            return hf(torch.tensor([ids])).logits[0].float()
    want = [plain_reference(logits, q, 12, p, llm.eos_token_id) for q in prompts]
    without = SamplingParams(max_gen_tokens=12, ignore_eos=p.ignore_eos, stop_token_ids=p.stop_token_ids)
    plain = llm.generate(prompts, sampling_params=without)
    assert all(w != q for w, q in zip(want, plain))       # the field changes every output
    for system in SYSTEMS:
        others = [without] * 2                            # batched with requests that ask nothing
        batched = llm.generate(prompts + prompts[:2], system=system, sampling_params=[p] * 3 + others)
        assert batched[:3] == want, system
        assert batched[3:] == plain[:2], system
        assert [llm.generate([q], system=system, sampling_params=p)[0] for q in prompts] == want, system


_HF = {}


def _hf(llm, transformers):
    if "m" not in _HF:
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            llm.save_pretrained(d)
            _HF["m"] = transformers.GPT2LMHeadModel.from_pretrained(d).eval().float()
    return _HF["m"]


def test_sampled_requests_with_penalties_draw_the_same_batched_and_alone(llm):
    prompts = random_prompts(3, 257, lo=2, hi=20, seed=4)
    p = SamplingParams(max_gen_tokens=10, temperature=0.9, seed=3, frequency_penalty=0.8, repetition_penalty=1.3,
                       logit_bias={5: 2.0})
    batched = llm.generate(prompts, sampling_params=p)
    assert batched == [llm.generate([q], sampling_params=p)[0] for q in prompts]


@pytest.mark.parametrize("kw, message", [
    (dict(logprobs=21), "logprobs=21 is out of range: allowed [0, 20]"),
    (dict(prompt_logprobs=-1), "prompt_logprobs=-1 is out of range"),
    (dict(logprobs=True), "logprobs=True must be an integer"),
    (dict(presence_penalty=2.5), "presence_penalty=2.5 is out of range: allowed [-2.0, 2.0]"),
    (dict(frequency_penalty=-3.0), "frequency_penalty=-3.0 is out of range"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0 is out of range: allowed [0.01, 100.0]"),
    (dict(min_tokens=17), "min_tokens=17 is out of range: allowed [0, 16]"),
    (dict(logit_bias={3: 101.0}), "logit_bias[3]=101.0 is out of range: allowed [-100.0, 100.0]"),
])
def test_bad_sampling_fields_are_refused_naming_the_field(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**kw)


def test_a_bias_outside_the_vocabulary_is_refused_by_the_engine(llm):
    engine = llm.new_engine()
    try:
        with pytest.raises(ValueError, match="logit_bias token id=300 is out of the vocabulary"):
            engine.add_request([1, 2], SamplingParams(logit_bias={300: 1.0}))
    finally:
        engine.close()


# -- on worker processes -------------------------------------------------------------------------
def test_a_logprob_entry_crosses_the_control_plane_unchanged():
    from orca_lab.model.logprobs import TokenLogprob, from_plain, to_plain
    entry = TokenLogprob(7, -0.5, ((7, -0.5), (3, -1.25)))
    assert from_plain(json.loads(json.dumps(to_plain(entry)))) == entry
    assert from_plain(to_plain(None)) is None


@pytest.mark.parametrize("degree", ["pipeline_parallel", "tensor_parallel"])
def test_worker_processes_honour_every_sampling_field(llm, degree):
    """The last stage samples with each request's prompt and output and scores the logits gathered
    over the tensor ranks: every field gives the tokens and log-probabilities of the engine sampling
    in its own process, on every system (the chunked prompts' prompt_logprobs arrive a chunk at a
    time), batched with requests that ask for nothing."""
    from orca_lab.distributed.pool import WorkerPool
    prompts = random_prompts(3, 257, lo=2, hi=20, seed=11)     # each field changes its request's output
    fields = [*FIELDS.values(), dict(logprobs=3, prompt_logprobs=2),
              dict(temperature=0.9, seed=3, frequency_penalty=0.8, logprobs=1)]
    params = [SamplingParams(max_gen_tokens=8, **f) for f in fields] + [SamplingParams(max_gen_tokens=8)] * 2
    batch = [prompts[i % 3] for i in range(len(params))]
    plain = llm.generate(batch, sampling_params=[SamplingParams(max_gen_tokens=8, ignore_eos=p.ignore_eos,
                                                                 stop_token_ids=p.stop_token_ids) for p in params])
    workers = LLM(gpt=llm.model, engine=dataclasses.replace(llm.engine_config, **{degree: 2}))
    with WorkerPool(workers):
        for system in SYSTEMS:
            want = llm.complete(batch, system=system, sampling_params=params)
            assert all(w.token_ids != q for w, q in zip(want[:len(FIELDS)], plain)), system   # each field acts
            for w, g in zip(want, workers.complete(batch, system=system, sampling_params=params)):
                assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason), system
                for lp, lw in ((g.logprobs, w.logprobs), (g.prompt_logprobs, w.prompt_logprobs)):
                    assert (lp is None) == (lw is None) and len(lp or ()) == len(lw or ()), system
                    for a, b in zip(lp or (), lw or ()):
                        assert (a is None) == (b is None), system
                        if a is not None:
                            assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
                            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4), system


def test_the_simulator_refuses_the_fields_that_need_a_models_logits():
    """A cost model has no logits to shape or score: refused by name, not ignored."""
    from orca_lab.sim.backends import SimBackend
    from orca_lab.sim.sweep import Curve
    engine = SimBackend("tiny", n_slots=1024).new_engine(Curve("orca", 4))
    for kw in (dict(logprobs=1), dict(prompt_logprobs=0), dict(min_tokens=2), dict(logit_bias={5: 1.0})):
        with pytest.raises(ValueError, match=f"^{next(iter(kw))}=.*the simulator's cost model"):
            engine.add_request([1, 2, 3], SamplingParams(max_gen_tokens=2, **kw))
    engine.close()
