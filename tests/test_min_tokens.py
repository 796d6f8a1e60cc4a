"""``min_tokens`` holds against every stop, as in vLLM: EOS and the stop token ids are masked until
that many tokens are out, and a stop string that ends earlier is text like any other; in process,
on worker processes and over HTTP."""
import json

import httpx
import pytest

from orca_lab import LLM, EngineConfig
from orca_lab.serving.launch import ServerProcess

PROMPT, MIN, MAX = "ab$cd", 6, 8
EXECUTORS = {"in process": dict(executor="local"), "workers": dict(executor="workers")}


def cut(tokens: list[int], stop: str, start: int = 1) -> tuple[list[int], str | None]:
    """``tokens`` up to where ``stop`` (an ASCII character: one byte-tokenizer token) first comes
    out at token ``start`` or later, with "stop"; all of them and None when it never does."""
    ends = [j for j in range(start, len(tokens) + 1) if tokens[j - 1] == ord(stop)]
    return (tokens[:ends[0]], "stop") if ends else (tokens, None)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_stop_string_before_min_tokens_does_not_stop_the_request(tiny_llm, executor):
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=2, n_slots=256, **EXECUTORS[executor]))
    ref, = llm.complete([PROMPT], MAX, min_tokens=MIN)
    stop = next(chr(t) for t in ref.token_ids[:MIN - 1] if 32 <= t < 127)   # out before MIN tokens
    got, = llm.complete([PROMPT], MAX, min_tokens=MIN, stop=[stop])
    tokens, reason = cut(ref.token_ids, stop, MIN)
    assert (got.token_ids, got.finish_reason) == (tokens, reason or ref.finish_reason)
    assert len(got.token_ids) >= MIN and stop in got.text    # the early one is text
    early, = llm.complete([PROMPT], MAX, stop=[stop])          # without min_tokens it stops there
    assert (early.token_ids, early.finish_reason) == cut(ref.token_ids, stop)
    first = ref.token_ids[0]
    ids, = llm.complete([PROMPT], MAX, min_tokens=MIN, stop_token_ids=[first])
    assert len(ids.token_ids) >= MIN and first not in ids.token_ids[:MIN]


def test_over_http_min_tokens_holds_against_a_stop_string():
    """The issue's request: ``"$"`` comes out second, and the request goes on to 6 tokens at least."""
    body = {"prompt": PROMPT, "max_tokens": MAX, "min_tokens": MIN, "temperature": 0, "return_token_ids": True}
    with ServerProcess("--model", "tiny", "--seed", "0", "--max-bs", "4", "--n-slots", "2048") as server:
        ref = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        got = httpx.post(f"{server.url}/v1/completions", json=body | {"stop": ["$"]}, timeout=60).json()["choices"][0]
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stop": ["$"], "stream": True},
                          timeout=60) as r:
            streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                               if line.startswith("data: {"))
    assert ord("$") in ref["token_ids"][:MIN - 1]        # the stop string comes out before min_tokens
    tokens, reason = cut(ref["token_ids"], "$", MIN)
    assert (got["token_ids"], got["finish_reason"]) == (tokens, reason or ref["finish_reason"])
    # the text is those tokens' (the early "$" in it), whole or streamed: never cut at the early "$"
    assert "$" in got["text"] and ref["text"].startswith(got["text"]) and streamed == got["text"]
    assert got["text"] == ref["text"] if reason is None else len(got["text"]) > ref["text"].index("$")


def test_a_mask_that_leaves_no_token_is_refused_where_it_enters(tiny_llm):
    """min_tokens masks EOS and the stop token ids: all 257 of them left no token to draw, and the
    engine died in torch.multinomial. One id left is a request like any other."""
    kw = dict(temperature=1.0, min_tokens=2, seed=0)
    for ends in (dict(stop_token_ids=list(range(257))), dict(stop_token_ids=list(range(256)), ignore_eos=False)):
        with pytest.raises(ValueError, match="with min_tokens=2 it leaves no token to sample") as e:
            tiny_llm.generate([[1, 2, 3]], 3, **kw, **ends)
        assert e.value.field == "stop_token_ids"
    assert tiny_llm.generate([[1, 2, 3]], 3, stop_token_ids=list(range(256)), **kw)[0][:2] == [256, 256]
