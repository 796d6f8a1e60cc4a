"""schemathesis drives the server through its own OpenAPI schema (``/openapi.json``): every answer
is 2xx or 4xx (never 5xx), has a status code, content type, headers and body that the schema
documents, and what the schema calls invalid is refused. Afterwards the server still answers
``LLM.generate``'s greedy tokens.

The checks leave out schemathesis's positive_data_acceptance: a schema-valid request may still be
refused with 400 for what only the model knows (token ids in its vocabulary, prompt + max_tokens
within its length and its K/V slots), as OpenAI's and vLLM's schemas leave those out too. The
server has 64 K/V slots, so a request it accepts is short. The examples are derandomized: CI runs
the same ones every time (``FUZZ_EXAMPLES=600`` explores further)."""
import json
import os
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
import schemathesis.specs.openapi.schemas  # noqa: F401  (see below)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import checks

from orca_lab import LLM
from orca_lab.serving.launch import ServerProcess

# schemathesis imports its OpenAPI half lazily, and pytest rewrites a plugin's modules (ast.parse) as
# they load: loaded here, at collection, before any test has started a thread. Loaded in the fixture,
# one full run on Python 3.11.7 failed there with "SystemError: AST constructor recursion depth
# mismatch", a CPython 3.11 bug seen in threaded programs (python/cpython#106905, pytest-dev/pytest#10763).
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance, checks.negative_data_rejection]
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
CHATML = Path(__file__).parent / "chat" / "chatml.jinja"


@pytest.fixture(scope="module")
def fuzzed():
    s = ServerProcess("--max-bs", "8", "--n-slots", "64", "--debug", "--chat-template", CHATML).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api(fuzzed):
    return schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 60, suppress_health_check=list(HealthCheck))
def test_every_answer_is_what_the_schema_says(case, fuzzed):
    case.call_and_validate(base_url=fuzzed.url, checks=CHECKS)


# token ids anywhere (the tiny model's vocabulary is [0, 256]), where the schema alone cannot refuse them
IDS = st.lists(st.one_of(st.integers(0, 256), st.integers(-2 ** 40, -1), st.integers(257, 2 ** 40)),
               min_size=1, max_size=6)
MESSAGES = [{"role": "user", "content": "a"}]
BODIES = st.one_of(
    st.builds(lambda ids, lp, stream: ("/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 1,
                                                           "logprobs": lp, "stream": stream}, "prompt", ids),
              IDS, st.sampled_from([None, 0, 2]), st.booleans()),
    st.builds(lambda ids, k: ("/v1/completions", {"prompt": [[1], ids], "prompt_logprobs": k, "max_tokens": 1},
                              "prompt", ids), IDS, st.sampled_from([None, 1])),
    st.builds(lambda ids: ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "stop_token_ids": ids},
                           "stop_token_ids", ids), IDS),
    st.builds(lambda ids: ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                    "logit_bias": {str(t): 1.0 for t in ids}}, "logit_bias", ids), IDS),
    st.builds(lambda ids: ("/detokenize", {"tokens": ids}, "tokens", ids), IDS))


@given(BODIES)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 60, suppress_health_check=list(HealthCheck))
def test_token_ids_out_of_the_vocabulary_are_a_400_naming_the_field_on_every_route(fuzzed, sent):
    """Echo decoded a prompt's ids before they were checked (-1: a plain-text 500): every route
    checks every id before anything decodes it."""
    route, body, param, ids = sent
    r = httpx.post(fuzzed.url + route, json=body, timeout=60)
    if all(0 <= t <= 256 for t in ids):
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# text with a lone surrogate (valid JSON, no UTF-8), which the schema's strings cannot say and
# schemathesis does not send: in each place a client puts text
UNENCODABLE = st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), st.characters(categories=["Cs"]),
                        st.text(max_size=4))
PLACES = [("/v1/completions", lambda t: {"prompt": t}, "prompt"),
          ("/v1/completions", lambda t: {"prompt": ["a", t], "stream": True}, "prompt"),
          ("/v1/completions", lambda t: {"prompt": "a", "stop": ["b", t]}, "stop"),
          ("/v1/completions", lambda t: {"prompt": "a", "logit_bias": {t: 1}}, "logit_bias"),
          ("/v1/chat/completions", lambda t: {"messages": [{"role": "user", "content": t}]}, "messages"),
          ("/v1/chat/completions", lambda t: {"messages": MESSAGES, "user": t}, "user"),
          ("/tokenize", lambda t: {"prompt": t}, "prompt"),
          ("/tokenize", lambda t: {"messages": [{"role": "system", "content": [{"type": "text", "text": t}]}]},
           "messages")]


@given(st.sampled_from(PLACES), UNENCODABLE)
@settings(max_examples=EXAMPLES // 4, deadline=None, derandomize=EXAMPLES <= 60, suppress_health_check=list(HealthCheck))
def test_text_no_tokenizer_can_encode_is_a_400_naming_its_field_on_every_route(fuzzed, place, text):
    """A lone surrogate was a 500 (``tokenizer.encode`` raised, unguarded)."""
    route, body, param = place
    r = httpx.post(fuzzed.url + route, content=json.dumps(body(text)), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_server_still_serves_greedy_tokens_afterwards(fuzzed):
    client = openai.OpenAI(base_url=fuzzed.url + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(model="tiny", prompt="after the fuzz", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == LLM("tiny", seed=0).generate(["after the fuzz"], 8)[0]


@pytest.mark.parametrize("extreme", [dict(temperature=5e-324), dict(temperature=1.0, top_p=5e-324)],
                         ids=["temperature", "top_p"])
def test_what_the_fuzzer_found_a_vanishing_temperature_or_top_p_is_greedy(extreme):
    """Each killed the engine (logits / 5e-324 overflow to NaN; a top_p below float32's least number
    dropped every token): now the most likely token, every time."""
    llm = LLM("tiny", seed=0)
    assert llm.generate([[1, 2, 3]], 6, seed=7, **extreme) == llm.generate([[1, 2, 3]], 6)
