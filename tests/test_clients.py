"""What real clients send to ``/v1/completions``, over HTTP with the official ``openai`` client:
logprobs and echo (against transformers' GPT-2 on the same weights, and streamed equal to whole),
the sampling fields, usage, the models routes, error bodies, every field of the request schema
honoured or refused, and a shutdown past ``--drain-s``."""
import json
import math
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from orca_lab import LLM, SamplingParams
from orca_lab.serving.launch import ServerProcess
from orca_lab.config import FieldError
from orca_lab.engine.fields import FIELDS
from orca_lab.serving.protocol import NEUTRAL, CompletionRequest, validation_error
from pydantic import ValidationError

from helpers import hf_log_softmax, random_prompts

CHATML = Path(__file__).parent / "chat" / "chatml.jinja"
from server_helpers import engine_pid, metrics, paused


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--model", "tiny", "--seed", "0", "--max-bs", "8", "--n-slots", "2048",
                      "--chat-template", CHATML).start()
    yield s
    assert s.stop() < 15 and s.proc.returncode == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", seed=0)


@pytest.fixture(scope="module")
def reference(llm, tmp_path_factory):
    """``log_softmax`` of transformers' logits of a whole sequence, fp32, computed apart."""
    return hf_log_softmax(llm, tmp_path_factory.mktemp("tiny"))


def text_of(t: int) -> str:
    return LLM("tiny").tokenizer.decode([t])


def name_of(t: int) -> str:
    """A byte tokenizer's token as logprobs name it: a byte below 128 is its character, one above a
    piece of a character (OpenAI's ``bytes:`` form), EOS has no bytes (vLLM's ``token_id:`` form)."""
    return chr(t) if t < 128 else f"bytes:\\x{t:02x}" if t < 256 else f"token_id:{t}"


def check_choice(lp, ids, row_of, k, first_null=False):
    """An OpenAI logprobs object against the reference rows: token names, logprobs, top k, offsets
    (into the choice's text: each token's decoded text)."""
    assert lp.tokens == [name_of(t) for t in ids]
    assert lp.text_offset == [sum(len(text_of(t)) for t in ids[:i]) for i in range(len(ids))]
    for i, t in enumerate(ids):
        if first_null and i == 0:
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            continue
        row = row_of(i)
        assert math.isclose(lp.token_logprobs[i], row[t].item(), abs_tol=1e-4)
        want = {}
        for j, v in zip(row.topk(k).indices.tolist(), row.topk(k).values.tolist()):
            want[name_of(j)] = v
        want.setdefault(name_of(t), row[t].item())
        assert len(want) in (k, k + 1)                 # k distinct names, and the chosen one
        got = lp.top_logprobs[i]
        assert got.keys() == want.keys() and all(math.isclose(got[x], want[x], abs_tol=1e-4) for x in want)


def test_logprobs_equal_log_softmax_of_the_models_logits_streamed_and_whole(client, reference):
    prompts = random_prompts(3, 256, lo=2, hi=20, seed=1)
    for k in (0, 3, 20):
        kw = dict(model="tiny", prompt=prompts, max_tokens=5, temperature=0, logprobs=k,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
        whole = sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
        for prompt, c in zip(prompts, whole):
            ids = c.model_extra["token_ids"]
            lp = reference(prompt + ids)
            check_choice(c.logprobs, ids, lambda i: lp[len(prompt) + i - 1], k)
        chunks = {}
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                chunks.setdefault(c.index, []).append(c)
        for c in whole:
            parts = chunks[c.index]
            assert "".join(p.text for p in parts) == c.text
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                assert [x for p in parts for x in getattr(p.logprobs, key)] == getattr(c.logprobs, key)


def test_chat_returns_token_ids_whole_and_streamed_as_vllm(client):
    """vLLM's return_token_ids on chat: each choice's token_ids (the same the completion of the
    rendered prompt gives), and the prompt's token ids once, beside the choices."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, n=2,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    prompt = whole.model_extra["prompt_token_ids"]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert [c.model_extra["token_ids"] for c in whole.choices] == [plain.model_extra["token_ids"]] * 2
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [t for ch in chunks for c in ch.choices if c.index == 0 for t in c.model_extra.get("token_ids") or []]
    assert streamed == plain.model_extra["token_ids"] and chunks[0].model_extra["prompt_token_ids"] == prompt
    assert "token_ids" not in client.chat.completions.create(**{**kw, "extra_body": {}}).choices[0].model_extra


def test_echo_gives_the_prompts_logprobs_first_token_null(client, reference):
    prompt = random_prompts(1, 256, lo=12, hi=13, seed=8)[0]
    text = bytes(prompt).decode("utf-8", errors="replace")
    # lm-eval's scoring request: the prompt only, max_tokens=0
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    c = r.choices[0]
    lp = reference(prompt)
    check_choice(c.logprobs, prompt, lambda i: lp[i - 1], 2, first_null=True)
    assert c.text == text and c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (12, 0)
    # with a completion: prompt then tokens, one sequence
    kw = dict(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=1, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    c = client.completions.create(**kw).choices[0]
    ids = prompt + c.model_extra["token_ids"]
    lp = reference(ids)
    check_choice(c.logprobs, ids, lambda i: lp[i - 1], 1, first_null=True)
    assert c.text.startswith(text)
    parts = [ch.choices[0] for ch in client.completions.create(stream=True, **kw)]
    assert "".join(p.text for p in parts) == c.text
    assert [x for p in parts for x in p.logprobs.token_logprobs] == c.logprobs.token_logprobs
    # echo without logprobs: the prompt's text before the completion
    c2 = client.completions.create(model="tiny", prompt="ORCA", max_tokens=3, echo=True, temperature=0)
    assert c2.choices[0].text.startswith("ORCA") and c2.choices[0].logprobs is None


def test_top_logprobs_has_k_distinct_names_streamed_and_whole(client):
    """Every byte >= 128 decodes alone to U+FFFD: named by its text, k = 5 gave 2 to 4 keys."""
    kw = dict(model="tiny", prompt="a", max_tokens=12, temperature=0, logprobs=5, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    assert any(t.startswith("bytes:") for top in whole.top_logprobs for t in top)
    assert all(len(top) in (5, 6) for top in whole.top_logprobs), whole.top_logprobs
    streamed = [x for ch in client.completions.create(stream=True, **kw) for x in ch.choices[0].logprobs.top_logprobs]
    assert streamed == whole.top_logprobs


def test_return_tokens_as_token_ids_in_completions_and_chat_streamed_and_whole(client):
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    kw = dict(model="tiny", prompt="ORCA", max_tokens=5, temperature=0, logprobs=3, echo=True,
              extra_body={**extra, "return_token_ids": True})
    c = client.completions.create(**kw).choices[0]
    ids = list(b"ORCA") + c.model_extra["token_ids"]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(len(top) in (3, 4) and all(k.startswith("token_id:") for k in top) for top in c.logprobs.top_logprobs[1:])
    assert [t for ch in client.completions.create(stream=True, **kw) for t in ch.choices[0].logprobs.tokens] == \
        c.logprobs.tokens
    chat = dict(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                extra_body=extra)
    content = client.chat.completions.create(**chat).choices[0].logprobs.content
    assert all(x.token.startswith("token_id:") and bytes(x.bytes).decode() == x.token
               for c in content for x in (c, *c.top_logprobs))
    streamed = [x for ch in client.chat.completions.create(stream=True, **chat) if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.content]
    assert [x.token for x in streamed] == [x.token for x in content]


def test_prompt_logprobs_in_vllms_shape(client, reference):
    """``choice.prompt_logprobs``: None, then for each prompt token {id: {logprob, rank,
    decoded_token}} of the k most likely tokens and the prompt's own, streamed and whole."""
    prompt = random_prompts(1, 256, lo=8, hi=9, seed=3)[0]
    kw = dict(model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2})
    got = client.completions.create(**kw).choices[0].model_extra["prompt_logprobs"]
    lp = reference(prompt)
    assert got[0] is None and len(got) == len(prompt)
    for i, entry in enumerate(got[1:], start=1):
        row = lp[i - 1]
        top = row.topk(2).indices.tolist()
        assert set(entry) == {str(t) for t in {*top, prompt[i]}}
        for t, e in entry.items():
            assert math.isclose(e["logprob"], row[int(t)].item(), abs_tol=1e-4) and e["decoded_token"] == name_of(int(t))
            assert e["rank"] == (top.index(int(t)) + 1 if int(t) in top else None)
    first = next(iter(client.completions.create(stream=True, **kw))).choices[0]
    assert first.model_extra["prompt_logprobs"] == got


def test_a_one_token_prompt_has_its_null_entry_with_echo_and_prompt_logprobs(client):
    """The engine scores no position of a one-token prompt: its entry is null all the same (echo's
    first token was left out, prompt_logprobs was null), found by benchmarks/soak.py."""
    for stream in (False, True):
        r = client.completions.create(model="tiny", prompt=[63], max_tokens=2, echo=True, logprobs=1, stream=stream,
                                      extra_body={"prompt_logprobs": 2, "ignore_eos": True})
        c = next(iter(r)).choices[0] if stream else r.choices[0]
        assert c.logprobs.tokens[0] == "?" and c.logprobs.token_logprobs[0] is None
        assert c.model_extra["prompt_logprobs"] == [None]


def test_the_model_card_has_root_and_parent(client):
    card = client.models.retrieve("tiny")
    assert card.model_extra["root"] == "tiny" and card.model_extra["parent"] is None


def test_matched_stop_names_the_stop_string_or_token_id_streamed_and_whole(client):
    kw = dict(model="tiny", prompt="ab", max_tokens=30, temperature=0)
    ids = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"]
    text = LLM("tiny").tokenizer.decode(ids)
    stop = next(text[i:i + 2] for i in range(2, len(text)) if "\ufffd" not in text[i:i + 2])
    for extra, matched in (({"stop": ["\u2603", stop]}, stop), ({"stop_token_ids": [ids[3]]}, ids[3]), ({}, None)):
        whole = client.completions.create(**kw, extra_body=extra).choices[0]
        assert whole.model_extra["matched_stop"] == matched and whole.finish_reason == ("stop" if matched else "length")
        last = list(client.completions.create(stream=True, **kw, extra_body=extra))[-1].choices[0]
        assert last.model_extra["matched_stop"] == matched
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                          extra_body={"stop_token_ids": list(range(256))})
    assert chat.choices[0].model_extra["matched_stop"] in range(256)


def test_a_seed_near_the_top_wraps_for_the_next_choices(client):
    """Choice j draws with seed + j: past 2**63 - 1 it wraps to 0 (it was refused naming a seed
    the client never sent)."""
    kw = dict(model="tiny", prompt="ab", max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    two = sorted(client.completions.create(seed=2 ** 63 - 1, n=2, **kw).choices, key=lambda c: c.index)
    assert two[1].text == client.completions.create(seed=0, **kw).choices[0].text
    assert two[0].text == client.completions.create(seed=2 ** 63 - 1, **kw).choices[0].text


def test_sampling_fields_over_http_equal_the_engines(client, llm):
    prompts = random_prompts(2, 256, lo=3, hi=15, seed=6)
    cases = [
        (dict(logit_bias={"65": 100}), dict(logit_bias={65: 100.0})),
        (dict(frequency_penalty=1.5, presence_penalty=0.5), dict(frequency_penalty=1.5, presence_penalty=0.5)),
        (dict(extra_body={"repetition_penalty": 1.7}), dict(repetition_penalty=1.7)),
        (dict(extra_body={"min_tokens": 6, "stop_token_ids": [47]}), dict(min_tokens=6, stop_token_ids=(47,))),
    ]
    for http_kw, params in cases:
        body = dict(http_kw.pop("extra_body", {}))
        body.setdefault("ignore_eos", True)
        body["return_token_ids"] = True
        r = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, extra_body=body,
                                      **http_kw)
        got = [c.model_extra["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)]
        want = llm.generate(prompts, sampling_params=SamplingParams(max_gen_tokens=8, **params))
        assert got == want, http_kw
    assert all(t == 65 for t in want_of(client, prompts))


def want_of(client, prompts):
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0.8, seed=1,
                                  logit_bias={"65": 100}, extra_body={"return_token_ids": True})
    return [t for c in r.choices for t in c.model_extra["token_ids"]]


def test_usage_counts_each_prompt_once_whatever_n(client):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    r = client.completions.create(model="tiny", prompt=prompts, n=3, max_tokens=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (8, 12, 20)
    chunks = list(client.completions.create(model="tiny", prompt=prompts, n=3, max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.prompt_tokens == 8 and chunks[-1].usage.completion_tokens == 12


def test_models_route_and_error_bodies_in_openai_shape(server, client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["param"] == "model" and "gpt-4" in e.value.body["message"]
    for method, path, code in (("GET", "/v1/nowhere", 404), ("DELETE", "/v1/completions", 405),
                               ("POST", "/v1/models", 405)):
        r = httpx.request(method, server.url + path)
        assert r.status_code == code
        assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["code"] == code


# -- every field of the schema: honoured (tested above or in test_serving.py) or refused by name -----
HONOURED = {"model", "prompt", "echo", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
            "stop_token_ids", "n", "stream", "stream_options", "ignore_eos", "return_token_ids", "logprobs",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias",
            "prompt_logprobs", "return_tokens_as_token_ids", "truncate_prompt_tokens", "use_beam_search",
            "length_penalty",
            "user",          # metadata: nothing to honour
            "best_of"}       # 1 (or null) only: refused otherwise, below


def off_value(neutral):
    """A value that is not ``neutral``, of a kind a client would send (``0`` for ``false``: 0 == False)."""
    return {bool: 0, float: 0.5, int: False, type(None): 1}[type(neutral)]


def test_every_field_of_the_request_schema_is_honoured_or_refused_by_name(server):
    schema = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
    fields = set(schema["properties"])
    assert fields == HONOURED | set(NEUTRAL), fields ^ (HONOURED | set(NEUTRAL))
    bodies = [(name, {name: off_value(neutral)}) for name, neutral in NEUTRAL.items()]
    bodies += [(name, {name: v}) for name, v in (("best_of", 2), ("best_of", 0), ("not_a_field", 1), ("suffix", "x"))]
    for name, extra in bodies:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1, **extra})
        assert r.status_code == 400, (name, extra, r.text)
        assert r.json()["error"]["param"] == name and name in r.json()["error"]["message"], r.text
    for name, neutral in NEUTRAL.items():          # the neutral value (what clients send by default) passes
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1, name: neutral})
        assert r.status_code == 200, (name, r.text)


def past(x, direction):
    """The next value past bound ``x`` of an int or float field (``direction`` -1 below, +1 above)."""
    return x + direction if isinstance(x, int) else math.nextafter(x, direction * math.inf)


@pytest.mark.parametrize("f", [f for f in FIELDS.values() if f.kind is not str and f.name in SamplingParams.__annotations__],
                         ids=lambda f: f.name)
def test_the_table_of_fields_is_the_one_range_of_each_field(f):
    """SamplingParams and the protocol (its checks and its schema) read each field's range from the
    table (engine/fields.py): its bounds pass, one step past them is refused naming the field, in
    process and over HTTP alike, except where the table says why HTTP's range differs."""
    wrap = {"stop_token_ids": lambda v: [v], "logit_bias": lambda v: {5: v}}.get(f.name, lambda v: v)
    others = {f.up_to: 7} if f.up_to else {}                   # min_tokens: at most max_gen_tokens
    in_process = lambda v: SamplingParams(**others, **{f.name: wrap(v)})
    over_http = lambda v: CompletionRequest(prompt="a", echo=True, **{FIELDS[k].http: n for k, n in others.items()},
                                            **{f.http: json.loads(json.dumps(wrap(v)))})
    schema = CompletionRequest.model_json_schema()["properties"]
    for send, http in ((in_process, False), (over_http, True)) if f.http else ((in_process, False),):
        lo, hi = f.limits(http)
        hi = others.get(f.up_to, hi)
        send(hi)
        send(past(lo, +1) if f.open_lo else lo)
        for v in (past(lo, -1), past(hi, +1)) + ((lo,) if f.open_lo else ()):
            with pytest.raises(ValidationError if http else FieldError) as e:
                send(v)
            assert (validation_error(e.value.errors())[1] if http else e.value.field) == (f.http if http else f.name)
        if http:
            s = schema[f.http]
            s = s.get("items") or s.get("additionalProperties") or s
            assert (s.get("minimum", s.get("exclusiveMinimum")), s["maximum"]) == f.limits(http)


@pytest.mark.parametrize("body, field, words", [
    ({"logprobs": 21}, "logprobs", "allowed [0, 20]"),
    ({"logprobs": -1}, "logprobs", "allowed [0, 20]"),
    ({"logprobs": True}, "logprobs", "must be an integer in [0, 20]"),
    ({"max_tokens": 0}, "max_tokens", "0 with echo=true"),
    ({"echo": 1}, "echo", "valid boolean"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream=true"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias", "not a token id"),        # a digit to str.isdigit only
    ({"logit_bias": {"5": 101}}, "logit_bias", "allowed [-100.0, 100.0]"),
    ({"logit_bias": {"300": 1}}, "logit_bias", "out of the vocabulary"),
    ({"logit_bias": [1, 2]}, "logit_bias", "must be an object"),
    ({"presence_penalty": 2.5}, "presence_penalty", "allowed [-2.0, 2.0]"),
    ({"frequency_penalty": "1"}, "frequency_penalty", "must be a finite number in [-2.0, 2.0]"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty", "allowed [0.01, 100.0]"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "allowed [0, 4]"),
    ({"min_tokens": -1}, "min_tokens", "allowed [0, 4]"),
    # the engine's refusals carry their field (max_gen_tokens is HTTP's max_tokens), never read from text
    ({"max_tokens": 1024}, "max_tokens", "exceeds the model's max length"),
    ({"logit_bias": {"1" * 5000: 1}}, "logit_bias", "(5000 digits) is out of range: allowed [0, 16777215]"),
    ({"logit_bias": {"1": 10 ** 400}}, "logit_bias", "is out of range: allowed [-100.0, 100.0]"),
    ({"temperature": 10 ** 400}, "temperature", "(401 digits) is out of range: allowed [0.0, 2.0]"),
    ({"temperature": 2.5}, "temperature", "allowed [0.0, 2.0]"),
    ({"seed": -10 ** 400}, "seed", "-1000000000... (401 digits) is out of range: allowed [0, 9223372036854775807]"),
    ({"stop": "a\ud800"}, "stop", "lone surrogate"),
    ({"stop": ["ok", "\udfff"]}, "stop", "lone surrogate"),
    # every logit masked until min_tokens are out: refused at entry, never a dead engine
    ({"max_tokens": 3, "temperature": 1, "stop_token_ids": list(range(257)), "min_tokens": 2},
     "stop_token_ids", "with min_tokens=2 it leaves no token to sample"),
])
def test_bad_new_fields_get_a_400_naming_the_field(server, body, field, words):
    r = httpx.post(server.url + "/v1/completions", content=json.dumps({"prompt": "a", "max_tokens": 4, **body}),
                   headers={"content-type": "application/json"})    # escaped: a lone surrogate is valid JSON
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and words in err["message"], err


@pytest.mark.parametrize("body, field, message", [
    ('{"prompt": "a", "max_tokens": 9N}', "max_tokens",
     "max_tokens=99999999999... (5000 digits) is out of range: allowed [0, 1048576]"),
    # in an item or entry of the field: the field, not a key inside it
    ('{"prompt": "a", "logit_bias": {"1": 9N}}', "logit_bias",
     "logit_bias holds 99999999999... (5000 digits), out of range: allowed [-100.0, 100.0]"),
    ('{"prompt": [1, 9N]}', "prompt", "prompt holds 99999999999... (5000 digits), out of range: allowed [0, 16777215]"),
    ('{"prompt": "a:\\"9N", "stop_token_ids": [-9N]}', "stop_token_ids",      # digits in a string are text
     "stop_token_ids holds -9999999999... (5000 digits), out of range: allowed [0, 16777215]"),
])
def test_a_number_too_long_for_json_names_its_field(server, body, field, message):
    """Python reads no JSON integer of over 4,300 digits, so the body fails to parse; the 400 still
    names the field and its range."""
    raw = body.replace("9N", "9" * 5000)
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field, r.text
    assert err["message"] == message


def test_a_client_that_leaves_while_sending_its_body_leaves_no_traceback(server):
    """The body half sent, then the connection closed: the server logs no traceback (looking into
    an unreadable body for a long number once read it a second time, and raised) and goes on."""
    import socket
    import time
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"prompt": "a", "max_tok')
    time.sleep(0.5)
    assert "Traceback" not in server.output and httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": [-1, 5], "echo": True}, "prompt"),          # echo decoded them: a 500
    ("/v1/completions", {"prompt": [[1], [5, 300]], "echo": True, "logprobs": 1}, "prompt"),
    ("/v1/completions", {"prompt": [-1, 5], "echo": True, "stream": True}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stop_token_ids": [999]},
     "stop_token_ids"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_a_token_id_out_of_the_vocabulary_is_a_400_on_every_route(server, route, body, param):
    """Every id is checked before anything decodes it."""
    r = httpx.post(server.url + route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_chat_too_long_for_the_model_names_its_messages_and_bodies_not_json_say_why(server):
    """A chat has no prompt field: its messages are at fault. A body not UTF-8, or JSON sent under
    another content type, is refused saying which."""
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 5000}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages", err
    assert err["message"].startswith("messages, as the chat template renders them: prompt (") and "max length" in \
        err["message"]
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "a\xff"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not UTF-8, as JSON text must be: byte 0xff at 13" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "a"}', headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "must be JSON sent as content-type: application/json, not 'text/plain'" in r.text


def test_echo_scoring_a_prompt_with_no_room_names_max_tokens_as_sent(server):
    """max_tokens 0 with echo (lm-eval's scoring) still runs one step: a prompt of the model's whole
    length is refused saying so, never naming a max_gen_tokens of 1 the client did not send."""
    max_len = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    for n, status in ((max_len - 1, 200), (max_len, 400)):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * n, "max_tokens": 0, "echo": True},
                       timeout=60)
        assert r.status_code == status, r.text
    assert f"with max_tokens 0 (echo) allowed <= {max_len - 1}" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt" and "max_gen_tokens" not in r.text


LONE = "x\ud800y"      # valid JSON ("x\\ud800y"), no UTF-8: no tokenizer can encode it


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": LONE}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", LONE], "stream": True}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a", "name": LONE}]}, "messages"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages"),
])
def test_text_no_tokenizer_can_encode_is_a_400_naming_the_field_on_every_route(server, route, body, param):
    """A lone surrogate was a 500 (the tokenizer raised, unguarded): refused where it enters."""
    r = httpx.post(server.url + route, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "surrogate" in r.json()["error"]["message"], r.json()


def test_an_unknown_field_named_by_a_lone_surrogate_is_a_400_not_an_unencodable_error_body(server):
    r = httpx.post(server.url + "/v1/completions", content=json.dumps({"prompt": "a", LONE: 1}),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x\\ud800y", r.text


def test_echo_of_a_bad_id_through_the_openai_client_names_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[-1, 5], echo=True, max_tokens=1)
    assert e.value.body["param"] == "prompt" and "-1" in e.value.body["message"]


def test_a_request_larger_than_the_queue_can_ever_hold_is_a_400_naming_both_numbers(client):
    """65 prompts x n=16 = 1040 sequences, past --max-queue 1024: never admissible, so not a 503."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[[1]] * 65, n=16, max_tokens=1)
    assert "1040" in e.value.body["message"] and "max_queue=1024" in e.value.body["message"]
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:       # as many prompts alone: the prompt is at fault
        client.completions.create(model="tiny", prompt=[[1]] * 1025, max_tokens=1)
    assert e.value.body["param"] == "prompt" and "1025" in e.value.body["message"]


# -- vLLM's fields: return_token_ids, truncate_prompt_tokens, continuous_usage_stats, beam search -------
def choices_by_index(chunks):
    out = {}
    for chunk in chunks:
        for c in chunk.choices:
            out.setdefault(c.index, []).append(c)
    return out


def test_return_token_ids_gives_the_prompts_and_the_generated_ids_streamed_and_whole(server, client, llm):
    """Each choice's ``prompt_token_ids`` (what /tokenize gives) and ``token_ids`` (the engine's greedy
    tokens), n > 1 and two prompts, with echo; streamed: the prompt's ids with each choice's first
    chunk, the tokens chunk by chunk; not asked: both null, as vLLM sends them."""
    prompts = ["ORCA serves", [7, 8, 9]]
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": prompts[0]}).json()["tokens"], prompts[1]]
    want = llm.generate(ids, max_gen_tokens=4)
    kw = dict(model="tiny", prompt=prompts, n=2, max_tokens=4, temperature=0, echo=True,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
    assert [(c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]) for c in whole] == \
        [(ids[i // 2], want[i // 2]) for i in range(4)]
    assert whole[0].text.startswith("ORCA serves")
    streamed = choices_by_index(client.completions.create(stream=True, **kw))
    for c in whole:
        parts = streamed[c.index]
        assert parts[0].model_extra["prompt_token_ids"] == c.model_extra["prompt_token_ids"]
        assert all("prompt_token_ids" not in p.model_extra for p in parts[1:])
        assert [t for p in parts for t in p.model_extra["token_ids"]] == c.model_extra["token_ids"]
        assert "".join(p.text for p in parts) == c.text
    plain = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_truncate_prompt_tokens_keeps_the_prompts_last_k_tokens(server, client, llm):
    prompt = list(range(40, 60))
    kw = dict(model="tiny", max_tokens=4, temperature=0, echo=True,
              extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True, "ignore_eos": True})
    r = client.completions.create(prompt=[prompt, "truncated"], **kw)
    assert r.usage.prompt_tokens == 10
    c = sorted(r.choices, key=lambda c: c.index)
    assert c[0].model_extra["prompt_token_ids"] == prompt[-5:] and c[1].text.startswith("cated")
    assert c[0].model_extra["token_ids"] == llm.generate([prompt[-5:]], max_gen_tokens=4)[0]
    kw["extra_body"]["truncate_prompt_tokens"] = -1           # as many as max_tokens leaves of 1024: 14
    stream = client.completions.create(prompt=prompt, stream=True, **{**kw, "max_tokens": 1010})
    assert next(iter(stream)).choices[0].model_extra["prompt_token_ids"] == prompt[-14:]
    stream.close()                                            # the client leaves: its request is cancelled
    for k, words in ((0, "allowed -1 or >= 1"), (-2, "allowed -1 or >= 1"), (1021, "allowed -1 or [1, 1020]"),
                     ("5", "must be an integer"), (True, "must be an integer")):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 4, "truncate_prompt_tokens": k})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
        assert words in r.json()["error"]["message"], r.text


def test_continuous_usage_stats_puts_each_choices_usage_so_far_in_every_chunk(server, client):
    """vLLM's rule: only with include_usage (implied when left out), the last chunk's usage too."""
    kw = dict(model="tiny", prompt=[[1, 2, 3], [4, 5]], n=2, max_tokens=3, temperature=0, stream=True,
              extra_body={"ignore_eos": True})
    for options in ({"include_usage": True, "continuous_usage_stats": True}, {"continuous_usage_stats": True}):
        chunks = list(client.completions.create(stream_options=options, **kw))
        assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 12)
        for index, parts in choices_by_index(chunks[:-1]).items():
            usage = [ch.usage for ch in chunks[:-1] if ch.choices[0].index == index]
            assert [u.completion_tokens for u in usage] == [1, 2, 3] and len(parts) == 3
            assert all(u.prompt_tokens == (3 if index < 2 else 2) and u.total_tokens == u.prompt_tokens + u.completion_tokens
                       for u in usage)
    quiet = list(client.completions.create(stream_options={"include_usage": False, "continuous_usage_stats": True}, **kw))
    assert all(ch.usage is None for ch in quiet)
    last_only = list(client.completions.create(stream_options={"include_usage": True}, **kw))
    assert [ch.usage is None for ch in last_only] == [True] * 12 + [False]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "stream": True,
                                                       "stream_options": {"continuous_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.continuous_usage", r.text


BEAM_PROMPTS, ROWS = random_prompts(2, 256, lo=3, hi=8, seed=21), {}


def plain_beam_search(logprobs_of, prompt, width, max_tokens, eos, length_penalty=1.0):
    """vLLM's beam search written plainly over a full log_softmax: ``(output, cumulative logprob,
    finish reason)`` of the ``width`` best, best first."""
    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for seq, total in live:
            row = ROWS.get(tuple(seq))
            if row is None:
                row = ROWS[tuple(seq)] = logprobs_of(seq)[-1]
            for t in row.topk(2 * width).indices.tolist():
                if t == eos:
                    done.append((seq, total + row[t].item(), "stop"))
                else:
                    grown.append((seq + [t], total + row[t].item()))
        live = sorted(grown, key=lambda b: -b[1])[:width]
    ranked = sorted(done + [(s, v, "length") for s, v in live], key=lambda b: -b[1] / len(b[0]) ** length_penalty)
    return [(s[len(prompt):], v, why) for s, v, why in ranked[:width]]


def test_beam_search_finds_what_a_plain_one_over_transformers_logits_finds(llm, reference):
    from orca_lab import BeamSearchParams
    got = llm.beam_search(BEAM_PROMPTS, BeamSearchParams(beam_width=3, max_tokens=3, length_penalty=0.5))
    for prompt, beams in zip(BEAM_PROMPTS, got):
        want = plain_beam_search(reference, prompt, 3, 3, llm.eos_token_id, 0.5)
        assert [(b.output, b.finish_reason) for b in beams] == [(o, why) for o, _, why in want]
        assert all(math.isclose(b.cum_logprob, v, abs_tol=1e-3) for b, (_, v, _) in zip(beams, want))
        assert all(b.text == llm.tokenizer.decode(b.output) for b in beams)
    with pytest.raises(ValueError, match="1025 exceeds the model's max length"):       # before its first step
        llm.beam_search([[1] * 1021], BeamSearchParams(beam_width=2, max_tokens=4))


def test_beam_search_sets_eos_beams_aside_and_ranks_them_by_length_penalty():
    """The search alone, over made-up scores: a beam whose candidate is EOS is finished then and
    there (EOS left out), the others grow; the ranking divides by len(prompt + output) ** length_penalty."""
    from orca_lab.engine.beam_search import BeamSearch, BeamSearchParams
    tops = {(): [(9, -0.1), (5, -1.0), (6, -3.0), (7, -4.0)], (5,): [(8, -0.1), (9, -0.2)], (6,): [(8, -0.1), (7, -0.2)]}
    for penalty, order in ((1.0, [([], "stop"), ([5, 8], "length")]), (3.0, [([5, 8], "length"), ([], "stop")])):
        search = BeamSearch([0], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=penalty), eos_token_ids=[9])
        while not search.done:
            search.advance([tops[b.tokens[1:]] for b in search.live])
        assert [(b.output, b.finish_reason) for b in search.best()] == order
        assert sorted(round(b.cum_logprob, 6) for b in search.finished) == [-1.2, -0.1]


def test_beam_search_over_http_returns_n_choices_per_prompt_best_first(server, client, llm, reference):
    prompts = BEAM_PROMPTS
    r = client.completions.create(model="tiny", prompt=prompts, n=3, max_tokens=3, temperature=0.7, echo=True,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.5, "return_token_ids": True})
    assert [c.index for c in r.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        want = plain_beam_search(reference, prompt, 3, 3, llm.eos_token_id, 0.5)
        got = r.choices[3 * i:3 * i + 3]
        assert [(c.model_extra["token_ids"], c.finish_reason) for c in got] == [(o, why) for o, _, why in want]
        assert all(c.model_extra["prompt_token_ids"] == prompt for c in got)
        assert all(c.text == llm.tokenizer.decode(prompt + c.model_extra["token_ids"]) for c in got)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (sum(map(len, prompts)),
                                                                  sum(len(c.model_extra["token_ids"]) for c in r.choices))
    for extra, param in (({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop"),
                         ({"top_k": 5}, "top_k"), ({"max_tokens": 0, "echo": True}, "max_tokens"),
                         ({"length_penalty": 11}, "length_penalty"), ({"max_tokens": 1024}, "max_tokens")):
        body = {"prompt": "a", "max_tokens": 3, "n": 2, "use_beam_search": True, **extra}
        resp = httpx.post(server.url + "/v1/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (extra, resp.text)


# -- shutdown ---------------------------------------------------------------------------------
def test_past_drain_every_running_request_ends_as_an_abort_its_client_reads_and_the_process_exits_0():
    s = ServerProcess("--model", "tiny", "--seed", "0", "--max-bs", "4", "--n-slots", "2048", "--drain-s", "0.3")
    s.start()
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        assert "--chat-template" in r.json()["error"]["message"]
        got, body = {}, {"prompt": "ORCA", "max_tokens": 1000, "ignore_eos": True}

        def whole():
            got["whole"] = httpx.post(s.url + "/v1/completions", json=body, timeout=60)

        def stream():
            with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                got["stream"] = [line for line in r.iter_lines() if line]

        threads = [threading.Thread(target=whole), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while time.time() < deadline and metrics(s.url).get("orca_lab_requests_running", 0) < 2:
            time.sleep(0.05)
        with paused(engine_pid(s)):      # neither can finish in the drain, however fast the host
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3 + 0.2)
        for t in threads:
            t.join(60)
        assert s.proc.wait(30) == 0
    finally:
        s.kill()
    r = got["whole"]
    assert r.status_code == 503 and "--drain-s" in r.json()["error"]["message"]
    lines = got["stream"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "abort"


# -- chat, tokenize --------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is ORCA?"}]


def test_chat_is_the_completion_of_its_template_streamed_and_whole(server, client):
    import jinja2
    want_prompt = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(
        CHATML.read_text()).render(messages=MESSAGES, add_generation_prompt=True)
    ids = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert ids == list(want_prompt.encode())
    kw = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(messages=MESSAGES, **kw)
    comp = client.completions.create(prompt=want_prompt, **kw)
    assert chat.choices[0].message.content == comp.choices[0].text and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, stream_options={"include_usage": True},
                                                 **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-2].choices[0].finish_reason == "length"
    # stop: the text ends before the stop string, finish_reason "stop"
    text = chat.choices[0].message.content
    stop = next(ch for ch in text[2:] if ch.isprintable() and ch != "\ufffd")
    stopped = client.chat.completions.create(messages=MESSAGES, stop=[stop], **kw).choices[0]
    assert stopped.message.content == text[:text.index(stop)] and stopped.finish_reason == "stop"


def test_chat_logprobs_are_the_completions_of_its_template_streamed_and_whole(server, client):
    """``logprobs`` / ``top_logprobs`` as OpenAI's chat gives them: each output token with its
    log-probability, its UTF-8 bytes and its k most likely tokens, the numbers of the same prompt's
    completion; a stream's chunks add up to the whole answer."""
    prompt = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    kw = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    comp = client.completions.create(prompt=prompt, logprobs=3, **kw).choices[0].logprobs
    chat = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **kw).choices[0].logprobs
    assert [c.token for c in chat.content] == comp.tokens
    assert [c.logprob for c in chat.content] == comp.token_logprobs
    answer = client.chat.completions.create(messages=MESSAGES, **kw).choices[0].message.content
    assert bytes(b for c in chat.content for b in c.bytes).decode(errors="replace") == answer
    for c, top in zip(chat.content, comp.top_logprobs):
        assert len(c.bytes) == 1 and c.token == name_of(c.bytes[0])      # one byte a token here
        assert len(c.top_logprobs) == 3 and len({bytes(t.bytes) for t in c.top_logprobs}) == 3
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        # the completions' top_logprobs keep one entry per text: pieces of a character share U+FFFD
        assert all(top[t.token] == t.logprob for t in c.top_logprobs if t.token != "\ufffd")
    chunks = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, stream=True, **kw)
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    assert streamed == chat.content
    bare = client.chat.completions.create(messages=MESSAGES, logprobs=True, **kw).choices[0].logprobs
    assert [c.logprob for c in bare.content] == comp.token_logprobs and all(c.top_logprobs == [] for c in bare.content)
    assert client.chat.completions.create(messages=MESSAGES, **kw).choices[0].logprobs is None


@pytest.mark.parametrize("body, field, words", [
    ({"messages": []}, "messages", "empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "role='robot'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content", "only"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "allowed [0, 20]"),
    ({"messages": MESSAGES, "logprobs": 1}, "logprobs", "valid boolean"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"messages": MESSAGES, "temperature": 3}, "temperature", "[0.0, 2.0]"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ({"messages": MESSAGES, "best_of": 2}, "best_of", "not a field"),
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens",     # as sent; no echo in a chat
     "max_completion_tokens=0 is out of range: allowed [1, 1048576]"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "max_tokens=0 is out of range: allowed [1, 1048576]"),
    ({"messages": MESSAGES, "max_completion_tokens": 1000}, "max_completion_tokens",    # past the model's length
     "max_completion_tokens=1000 is out of range: the chat's prompt is 102 tokens, so allowed [1, 922]"),
])
def test_bad_chat_input_gets_a_400_naming_the_field(server, body, field, words):
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and words in r.json()["error"]["message"], r.json()


def test_a_chat_with_no_bound_runs_to_the_models_length_and_null_is_a_fields_default(server, client):
    """OpenAI's and vLLM's chat: no max_tokens is the rest of the model's length (16 is only the
    legacy completions' default). A field sent as null (the openai client sends an explicit None so)
    takes its default, as OpenAI's schema has it."""
    long = [{"role": "user", "content": "a" * 960}]
    n_prompt = len(httpx.post(server.url + "/tokenize", json={"messages": long}).json()["tokens"])
    answer = client.chat.completions.create(model="tiny", messages=long, temperature=0, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 1024 - n_prompt and answer.choices[0].finish_reason == "length"
    kw = dict(model="tiny", max_tokens=3, temperature=0)
    chat = client.chat.completions.create(messages=MESSAGES, **kw).choices[0].message.content
    assert client.chat.completions.create(messages=MESSAGES, n=None, logprobs=None, stream=None,
                                          extra_body={"min_p": 0.0}, **kw).choices[0].message.content == chat
    text = client.completions.create(prompt="ORCA", **kw).choices[0].text
    assert client.completions.create(prompt="ORCA", n=None, echo=None, stream=None, **kw).choices[0].text == text


def test_tokenize_and_detokenize_as_vllm_serves_them(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "ORCA", "return_token_strs": True}).json()
    assert r == {"count": 4, "max_model_len": 1024, "tokens": list(b"ORCA"), "token_strs": list("ORCA")}
    assert httpx.post(server.url + "/detokenize", json={"tokens": list(b"ORCA")}).json() == {"prompt": "ORCA"}
    r = httpx.post(server.url + "/detokenize", json={"tokens": [1, 999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens" and "999" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/tokenize", json={"prompt": "a", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(server.url + "/tokenize", json={"messages": []})           # as a chat refuses them
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "empty" in r.text
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x" * 1025})     # as vLLM: past the model's length
    assert r.status_code == 400 and "1025 tokens, more than the model's max length: allowed <= 1024" in r.text


@pytest.mark.parametrize("text, message", [(None, "cannot read it"), ("{% for m in messages %}", "not a Jinja template")])
def test_serve_refuses_a_bad_chat_template_before_it_starts(tmp_path, capsys, text, message):
    from orca_lab.cli import main
    path = tmp_path / "template.jinja"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--chat-template", str(path)])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags", [("--system", "ft"), ("--system", "chunked"), ("--system", "paged", "--tp", "2")],
                         ids=["ft", "chunked", "paged-tp2-workers"])
def test_logprobs_over_http_are_the_same_on_the_other_systems(client, flags):
    """The request-level baseline hands a request all its tokens at once, the chunked policy splits
    prompts, and worker processes sample on their last stage over logits gathered from two tensor
    ranks: the endpoint pairs each token with its own entry all the same, penalties applied."""
    prompts = random_prompts(3, 256, lo=20, hi=40, seed=12)
    kw = dict(model="tiny", prompt=prompts, max_tokens=5, temperature=0, logprobs=3, echo=True,
              frequency_penalty=0.5, extra_body={"ignore_eos": True})
    want = sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
    with ServerProcess("--model", "tiny", "--seed", "0", "--max-bs", "4", "--n-slots", "2048",
                       "--max-num-batched-tokens", "16", *flags) as s:
        other = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        got = sorted(other.completions.create(**kw).choices, key=lambda c: c.index)
        chunks = {}
        for chunk in other.completions.create(stream=True, **kw):
            for c in chunk.choices:
                chunks.setdefault(c.index, []).append(c)
    for w, g in zip(want, got):
        assert g.text == w.text and g.logprobs.tokens == w.logprobs.tokens
        assert g.logprobs.text_offset == w.logprobs.text_offset
        assert all((a is None and b is None) or math.isclose(a, b, abs_tol=1e-4)
                   for a, b in zip(g.logprobs.token_logprobs, w.logprobs.token_logprobs))
        streamed = [x for p in chunks[g.index] for x in p.logprobs.token_logprobs]
        assert streamed == g.logprobs.token_logprobs
