"""Faults stay where they start. One request's failure inside an iteration (its row of logits turned
nan, its stop check raising) ends that request with finish_reason "error" and frees its K/V; the
batch goes on and every other request gets the tokens it gets alone: in process for every system,
with prefix caching on and off, on worker processes, and over HTTP whole and streamed. A stuck
engine turns /health and /v1/models to 503 and its log names where it is stuck.

The fault is real, not mocked: a checkpoint whose position embedding at ``POISON`` is nan. A request
whose context reaches that position gets nan logits from there on (its own rows only: selective
batching keeps requests apart), exactly as a model whose numerics blow up for one input does."""
import asyncio
import contextlib
import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from server_helpers import metrics, wait_for

from orca_lab import LLM, EngineConfig, RequestsFailed, SamplingParams
from orca_lab.engine.beam_search import BeamSearchParams
from orca_lab.distributed.pool import WorkerPool
from orca_lab.llm import Completion
from orca_lab.engine.detokenizer import Detokenizer
from orca_lab.serving.engine_client import EngineClient, Stream
from orca_lab.serving.engine_core import EngineArgs, EngineProcess
from orca_lab.serving.launch import ServerProcess
from orca_lab.serving.metrics import ServerMetrics
from orca_lab.serving.watchdog import Watchdog

POISON = 20                     # the nan position
SETTINGS = dict(max_bs=4, n_slots=1024, block_size=4, max_num_batched_tokens=8)
GOOD = [[5, 6, 7], [9, 8], [1, 2, 3, 4, 5], [30, 31, 32]]      # contexts stay below POISON
BAD = list(range(40, 58))       # 18 tokens at positions 0-17: its tokens from positions 17-19, then nan
N_BEFORE = POISON - len(BAD) + 1      # tokens it gets before it fails
N_GEN = 6
PROMPTS = [GOOD[0], BAD, GOOD[1], GOOD[2], GOOD[3]]


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """A tiny GPT-2 checkpoint with a nan position embedding, and what each good prompt gets alone."""
    path = tmp_path_factory.mktemp("poisoned")
    llm = LLM("tiny", seed=0)
    with torch.no_grad():
        llm.model.wpe.weight[POISON] = float("nan")
    llm.model.save_pretrained(path)
    return path, {tuple(p): llm.generate([p], N_GEN, ignore_eos=True)[0] for p in GOOD}


def check(completions, alone):
    """The bad prompt failed alone, naming why; every other one got its tokens alone."""
    for prompt, c in zip(PROMPTS, completions):
        if prompt is BAD:
            assert c.finish_reason == "error" and "nan" in c.error and len(c.token_ids) == N_BEFORE
        else:
            assert (c.finish_reason, c.token_ids) == ("length", alone[tuple(prompt)]), prompt


@pytest.mark.parametrize("system,prefix_caching", [("orca", False), ("ft", False), ("paged", False),
                                                   ("paged", True), ("chunked", True)])
def test_a_request_that_fails_in_process_fails_alone(poisoned, system, prefix_caching):
    path, alone = poisoned
    llm = LLM.from_pretrained(path, engine=EngineConfig(**SETTINGS, prefix_caching=prefix_caching))
    engine = llm.new_engine(system)
    reqs = [engine.add_request(p, SamplingParams(max_gen_tokens=N_GEN, ignore_eos=True)) for p in PROMPTS]
    engine.run()
    assert engine.stats().kv_reserved == 0 and not engine.live          # nothing held, nothing leaked
    check([_completion(r) for r in reqs], alone)
    check(llm.complete(PROMPTS, N_GEN, system, ignore_eos=True), alone)     # the LLM's API, and again
    with pytest.raises(RequestsFailed) as e:        # streamed: the failed prompt's tokens, then its end
        llm.generate(PROMPTS, N_GEN, system, ignore_eos=True)     # (ft holds them until its batch ends)
    assert list(e.value.errors) == [1] and len(e.value.outputs[1]) == N_BEFORE


def test_generate_names_the_prompt_that_failed_and_gives_the_others(poisoned):
    path, alone = poisoned
    llm = LLM.from_pretrained(path, engine=EngineConfig(**SETTINGS))
    with pytest.raises(RequestsFailed, match="prompt 1 failed: no token can be drawn") as e:
        llm.generate(PROMPTS, N_GEN, ignore_eos=True)
    assert list(e.value.errors) == [1]
    assert [e.value.outputs[i] for i in (0, 2, 3, 4)] == [alone[tuple(p)] for p in GOOD]
    bad, good = llm.beam_search([BAD, GOOD[0]], BeamSearchParams(beam_width=2, max_tokens=N_GEN, ignore_eos=True))
    assert [b.finish_reason for b in bad] == ["error"] * 2 and "no token can be drawn" in bad[0].error
    assert [b.finish_reason for b in good] == ["length"] * 2


def test_a_request_that_fails_on_workers_fails_alone(poisoned):
    """A 2-stage pipeline of worker processes: the last stage's sampler reports the row's failure."""
    path, alone = poisoned
    llm = LLM.from_pretrained(path, engine=EngineConfig(**SETTINGS, pipeline_parallel=2))
    with WorkerPool(llm):
        for system in ("orca", "ft"):
            check(llm.complete(PROMPTS, N_GEN, system, ignore_eos=True), alone)


# A prompt whose middle chunk holds the nan position (chunks of 12: 0-11, 12-23, 24-27): that chunk
# draws no token, and its K/V at 12-19 turn nan too (masked attention weighs the hidden value by 0,
# and 0 x nan is nan). SHARER shares its clean first 16 tokens (4 blocks of 4) and, with its
# N_SHARER tokens, never reaches POISON itself.
SPILLER = list(range(60, 76)) + list(range(80, 92))
SHARER, N_SHARER = SPILLER[:16] + [1], 3


@pytest.mark.parametrize("workers", [False, True], ids=["in process", "2 pipeline stages"])
def test_a_chunk_that_meets_the_fault_hands_none_of_it_to_a_request_sharing_its_prefix(poisoned, workers):
    """chunked with prefix caching: a prompt's blocks wait for its first token before they are
    cached, so the request after it (or beside it) that shares the prefix gets its tokens alone."""
    path, _ = poisoned
    config = EngineConfig(**{**SETTINGS, "max_num_batched_tokens": 12}, prefix_caching=True,
                          pipeline_parallel=2 if workers else 1)
    llm = LLM.from_pretrained(path, engine=config)
    alone = LLM.from_pretrained(path).complete([SHARER], N_SHARER, ignore_eos=True)[0].token_ids
    with WorkerPool(llm) if workers else contextlib.nullcontext():
        for prompts in ([SPILLER], [SHARER], [SPILLER, SHARER], [SHARER]):
            *_, last = llm.complete(prompts, N_SHARER, "chunked", ignore_eos=True)
            if prompts[-1] is SHARER:
                assert (last.finish_reason, len(last.token_ids)) == ("length", N_SHARER) and last.token_ids == alone
            else:
                assert last.finish_reason == "error" and "nan" in last.error


class Fragile:
    """Bytes, but a tokenizer that cannot decode ``bad`` (as tiktoken cannot an id past its ranks)."""

    def __init__(self, bad: int):
        self.bad = bad

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        if self.bad in ids:
            raise ValueError(f"cannot decode {self.bad}")
        return bytes(i % 256 for i in ids).decode("latin-1")


def test_a_tokenizer_that_raises_fails_its_request_alone():
    """A tokenizer that cannot decode a token the model drew: the request with stop strings (whose
    end the engine reads as text) fails in the engine, the same prompt without them when its text is
    made (``complete``, beam search); the other prompt, which never drew that token, goes on."""
    llm = LLM("tiny", seed=0)
    first, other = llm.generate([[5, 6, 7], [9, 8]], 3, ignore_eos=True)
    assert first[1] not in other
    llm.tokenizer = Fragile(first[1])
    why = f"its tokenizer could not decode its tokens (ValueError: cannot decode {first[1]})"
    engine = llm.new_engine()
    a, b = [engine.add_request([5, 6, 7], SamplingParams(max_gen_tokens=3, stop=stop)) for stop in (("\x00\x01",), ())]
    engine.run()
    assert a.finish_reason == "error" and why in a.error
    assert (b.finish_reason, b.output) == ("length", first) and engine.stats().kv_reserved == 0
    bad, good = llm.complete([[5, 6, 7], [9, 8]], 3, ignore_eos=True)
    assert (bad.finish_reason, bad.error, bad.text) == ("error", why, None)
    assert (good.finish_reason, good.token_ids, good.text) == ("length", other, Fragile(-1).decode(other))
    bad, good = llm.beam_search([[5, 6, 7], [9, 8]], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    assert [(b.finish_reason, b.error) for b in bad] == [("error", why)] * 2
    assert [b.finish_reason for b in good] == ["length"] * 2 and all(b.error is None for b in good)


def test_a_token_the_endpoint_cannot_decode_fails_its_stream_alone():
    """The endpoint makes each stream's text from the engine's token ids (the engine decodes only
    requests with stop strings): a token its tokenizer cannot decode ends that stream with "error"
    and frees its slots; the stream beside it in the same iterations gets its text, and the engine
    process serves on."""
    first, other = LLM("tiny", seed=0).generate([[5, 6, 7], [9, 8]], 3, ignore_eos=True)
    core = EngineProcess(EngineArgs("tiny", engine=EngineConfig(max_bs=4, n_slots=1024)))
    core.info = dataclasses.replace(core.info, tokenizer=Fragile(first[1]))

    async def serve(prompts):
        q = asyncio.Queue()
        streams = [Stream(i, p, SamplingParams(max_gen_tokens=3, ignore_eos=True), 0.0, q,
                          detokenizer=Detokenizer(client.decode)) for i, p in enumerate(prompts)]
        await client.submit(streams)
        events = {i: [] for i in range(len(prompts))}
        while sum(bool(ev) and ev[-1].finish_reason is not None for ev in events.values()) < len(prompts):
            i, ev = await asyncio.wait_for(q.get(), 60)
            events[i].append(ev)
        return list(events.values())

    async def run():
        client.start(asyncio.get_running_loop())
        bad, good = await serve([[5, 6, 7], [9, 8]])
        (again,) = await serve([[9, 8]])
        while client.metrics.kv_reserved._value.get():       # the engine's abort of the failed one
            await serve([[9, 8]])
        return bad, good, again

    try:
        client = EngineClient(core, ServerMetrics(), 16)
        bad, good, again = asyncio.run(run())
    finally:
        client.stop()
        core.join(10)
    assert bad[-1].finish_reason == "error" and bad[-1].error.startswith("its tokenizer could not decode")
    assert [e.token for e in bad] == first[:1]        # the token it could not decode (its first) ended it
    for events in (good, again):
        assert [e.token for e in events] == other and events[-1].finish_reason == "length"
        assert "".join(e.text for e in events) == Fragile(-1).decode(other)
    assert client.alive is False and core.proc.exitcode == 0   # stopped when asked, not failed



class Breaks(Fragile):
    """Fragile, and its encode fails on "boom" with an error no tokenizer is expected to raise."""

    def encode(self, text):
        if "boom" in text:
            raise RuntimeError("the tokenizer broke")
        return super().encode(text)


def test_ids_the_tokenizer_cannot_decode_are_a_400_and_a_fault_of_the_servers_a_500_in_openais_shape():
    """Ids a client sent that this tokenizer cannot decode (echo's prompt, /detokenize's tokens) are a
    400 naming the field; a fault of the server's own on one request is a 500 in OpenAI's shape (it
    was Starlette's plain text); the server serves on."""
    from fastapi.testclient import TestClient
    from orca_lab.serving.app import build_app
    core = EngineProcess(EngineArgs("tiny", engine=EngineConfig(max_bs=4, n_slots=1024)))
    core.info = dataclasses.replace(core.info, tokenizer=Breaks(7))
    with TestClient(build_app(core), raise_server_exceptions=False) as http:
        for route, body, param in (("/detokenize", {"tokens": [5, 7]}, "tokens"),
                                   ("/v1/completions", {"prompt": [[1], [5, 7]], "echo": True, "max_tokens": 1},
                                    "prompt")):
            r = http.post(route, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "could not decode its tokens (ValueError: cannot decode 7)" in r.json()["error"]["message"]
        r = http.post("/tokenize", json={"prompt": "boom"})
        assert r.status_code == 500 and r.json()["error"]["message"] == \
            "the server failed on this request (RuntimeError: the tokenizer broke)", r.text
        r = http.post("/v1/completions", json={"prompt": [5, 6], "echo": True, "max_tokens": 1})
        assert r.status_code == 200 and http.get("/health").status_code == 200, r.text

# -- over HTTP ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(poisoned):
    """orca without and chunked with prefix caching, started side by side."""
    path = poisoned[0]
    flags = ["--checkpoint", path, "--max-bs", 4, "--n-slots", 1024, "--block-size", 4, "--drain-s", 1]
    made = [ServerProcess(*flags), ServerProcess(*flags, "--system", "chunked", "--prefix-caching",
                                                 "--max-num-batched-tokens", 8)]
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(ServerProcess.start, made))
    yield started
    for s in started:
        assert s.stop() < 10


@pytest.mark.parametrize("which", [0, 1], ids=["orca", "chunked-prefix-caching"])
def test_a_request_that_fails_over_http_fails_alone_and_the_server_goes_on(servers, poisoned, which):
    s, alone = servers[which], poisoned[1]
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    body = dict(model=str(poisoned[0]), max_tokens=N_GEN, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt=PROMPTS, **body)
    for prompt, choice in zip(PROMPTS, whole.choices):
        if prompt is BAD:
            assert choice.finish_reason == "error" and "nan" in choice.model_extra["error"]
        else:
            assert choice.finish_reason == "length"
    with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                      json={"prompt": BAD, "max_tokens": N_GEN, "stream": True, "ignore_eos": True}) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert r.status_code == 200
    tokens = [e for e in events if "choices" in e]
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None] * N_BEFORE + ["error"]
    assert "choice 0 failed: no token can be drawn" in events[-1]["error"]["message"]
    with pytest.raises(openai.APIError, match="no token can be drawn"):       # the official client says so
        list(client.completions.create(prompt=BAD, stream=True, **body))
    good = client.completions.create(prompt=GOOD, logprobs=0, **{
        **body, "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}})
    for prompt, choice in zip(GOOD, good.choices):           # the server's engine went on unharmed
        assert [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens] == alone[tuple(prompt)]
    if which == 0:          # beam search: the prompt whose beams reach the nan fails alone, with 200
        beams = client.completions.create(prompt=[BAD, GOOD[0]], n=2, **{
            **body, "extra_body": {"ignore_eos": True, "use_beam_search": True}})
        assert [c.finish_reason for c in beams.choices] == ["error", "error", "length", "length"]
        assert "nan" in beams.choices[0].model_extra["error"] and beams.choices[2].text
    assert httpx.get(s.url + "/health").status_code == 200
    m = metrics(s.url)
    failed = 3 + 2 * (which == 0)       # beam search: both live beams' step past the nan
    assert m['orca_lab_requests_total{status="error"}'] == failed and wait_for(
        lambda: metrics(s.url)["orca_lab_kv_slots_reserved"] == 0)


# -- a stuck engine -------------------------------------------------------------------------------
def test_the_watchdog_names_where_a_turn_is_stuck_and_when_it_returns(tmp_path):
    said, stalled = [], threading.Event()

    def send(msg):
        said.append(msg)
        stalled.set()

    dog = Watchdog(send, stall_s=0.2, plugins=__file__.rsplit("/", 1)[0])
    with dog.turn():
        assert stalled.wait(10)
    kind, why = said[0]
    assert kind == "stalled" and "no iteration has returned for 0.2 s" in why
    assert "your test_the_watchdog_names_where_a_turn_is_stuck_and_when_it_returns (" in why and \
        "a piece plugged with --plugins" in why
    assert said[1:] == [("progress",)]
    said.clear(), stalled.clear()

    def learners_loop():       # a plugged loop drives the turns from a thread of its own (guards.watched)
        with dog.turn():
            assert stalled.wait(10)
    thread = threading.Thread(target=learners_loop)
    thread.start(), thread.join(20)
    assert "your learners_loop (" in said[0][1], said


def _completion(req):
    return Completion(req.prompt, req.output, None, req.finish_reason, error=req.error)


ORPHAN = """
import multiprocessing as mp, sys, threading, time
from orca_lab.serving.engine_core import _end_if_orphaned

def engine():                  # loading a model: nothing reads the pipe yet
    _end_if_orphaned(mp.parent_process().pid, threading.Event())
    print("watching", flush=True)
    time.sleep(60)

if __name__ == "__main__":
    child = mp.get_context("spawn").Process(target=engine)
    child.start()
    print(child.pid, flush=True)
    time.sleep(60)
"""


def test_an_engine_whose_endpoint_is_killed_while_the_model_loads_ends_too(tmp_path):
    """An endpoint killed before its engine serves (a SIGTERM to it alone; the engine ignores
    SIGTERM) leaves no engine building a model no one will use: it ends at once."""
    import os
    import signal
    import subprocess
    import sys
    import time
    (tmp_path / "orphan.py").write_text(ORPHAN)
    endpoint = subprocess.Popen([sys.executable, str(tmp_path / "orphan.py")], stdout=subprocess.PIPE, text=True)
    child = int(endpoint.stdout.readline())
    assert endpoint.stdout.readline() == "watching\n"       # (killed before, it ends on its first look)
    endpoint.send_signal(signal.SIGKILL)
    endpoint.wait()

    def gone():
        try:
            return open(f"/proc/{child}/stat").read().split(")")[-1].split()[0] == "Z"    # a zombie: it ended
        except FileNotFoundError:
            return True
    deadline = time.monotonic() + 20
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    outlived = not gone()
    if outlived:
        os.kill(child, signal.SIGKILL)
    assert not outlived, f"the engine (pid {child}) outlived its endpoint"
