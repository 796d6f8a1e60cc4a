"""``orca-lab serve`` over real HTTP: uvicorn in a child process on 127.0.0.1 (a port the OS chooses),
driven by the official ``openai`` client, httpx, and ``orca-lab bench``. Every loop is bounded and
every server is stopped (and checked gone) at the end of its tests."""
import asyncio
import json
import os
import random
import resource
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from orca_lab import LLM
from orca_lab.metrics import summarize
from orca_lab.serving.bench import DebugRun, make_trace, run_load, server_records
from orca_lab.serving.engine_core import HISTORY, EngineLoop
from orca_lab.serving.launch import ServerProcess
from orca_lab.serving.metrics import parse_metrics

from helpers import random_prompts
from server_helpers import (assert_port_free, descendants, engine_pid, kill_left, metrics, paused, running,
                            wait_for)

N_SLOTS = 1000          # below the model's 1024 positions, so the slot check can refuse on its own


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--model", "tiny", "--seed", "0", "--max-bs", "16", "--n-slots", N_SLOTS, "--debug").start()
    yield s
    assert s.stop() < 10


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_greedy_tokens_equal_llm_generate(client):
    prompts = random_prompts(5, 257, lo=1, hi=30, seed=3)
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    want = LLM("tiny", seed=0).generate(prompts, max_gen_tokens=12)
    got = [c.model_extra["token_ids"] for c in sorted(resp.choices, key=lambda c: c.index)]
    assert got == want
    assert resp.usage.completion_tokens == 60 and resp.usage.prompt_tokens == sum(map(len, prompts))


def test_streamed_text_equals_non_streamed(client):
    kw = dict(model="tiny", prompt="Iteration-level scheduling", max_tokens=24, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == whole.model_extra["token_ids"]
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) == 24


def test_64_concurrent_streaming_clients_get_their_tokens(server):
    rng = random.Random(0)
    jobs = [(rng.choice(["ORCA", "selective batching", "x" * 40]), rng.randint(1, 20)) for _ in range(64)]

    async def one(aclient, prompt, n):
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True, "return_token_ids": True})
        ids, usage, reason = [], None, None
        async for chunk in stream:
            if chunk.choices:
                ids += chunk.choices[0].model_extra["token_ids"]
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return len(ids), usage.completion_tokens, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as ac:
            return await asyncio.wait_for(asyncio.gather(*(one(ac, p, n) for p, n in jobs)), 60)

    results = asyncio.run(main())
    assert results == [(n, n, "length") for _, n in jobs]


BAD = [  # (body, status, words the message must hold: the field, the value, the allowed range)
    ({"prompt": "a", "max_tokens": 0}, 400, ["max_tokens=0", "[1,"]),
    ({"prompt": ""}, 400, ["prompt", "empty"]),
    ({"prompt": []}, 400, ["prompt", "empty"]),
    ({"prompt": [[1, 2], []]}, 400, ["prompt[1]", "empty"]),
    ({"prompt": [5, 257]}, 400, ["prompt", "257", "[0, 256]"]),
    ({"prompt": "a", "max_tokens": 1024}, 400, ["max_gen_tokens (1024)", "1025", "<= 1024", "max_tokens"]),
    ({"prompt": "abc", "max_tokens": 999}, 400, ["max_gen_tokens (999) = 1002", f"n_slots={N_SLOTS}"]),
    ({"prompt": "a", "temperature": -0.5}, 400, ["temperature=-0.5", "[0.0, 2.0]"]),
    ({"prompt": "a", "top_p": 0}, 400, ["top_p=0", "(0.0, 1.0]"]),
    ({"prompt": "a", "top_p": 1.5}, 400, ["top_p=1.5", "(0.0, 1.0]"]),
    ({"prompt": "a", "max_tokens": "many"}, 400, ["max_tokens='many'", "integer"]),
    ({"prompt": 7}, 400, ["prompt", "got 7"]),
    ({"prompt": "a", "model": "gpt-5"}, 404, ["model='gpt-5'", "tiny"]),
    ({"prompt": "a", "max_tokens": True}, 400, ["max_tokens=True", "integer"]),      # not 1, as pydantic reads it
    ({"prompt": "a", "temperature": "0.5"}, 400, ["temperature='0.5'", "number"]),
    ({"prompt": "a", "logprobs": 21}, 400, ["logprobs=21", "[0, 20]"]),
    ({"prompt": "a", "best_of": 0}, 400, ["best_of=0", "not supported"]),              # 0 == False slipped through
    ({"prompt": "a", "use_beam_search": True, "stream": True}, 400, ["stream=True", "use_beam_search=true"]),
    ({"prompt": "a", "stop_token_ids": [1] * 300_000}, 400, ["stop_token_ids holds 300000 items: allowed at most 1024"]),
    ({"prompt": "a", "stop": ["a"] * 65}, 400, ["stop holds 65 items: allowed at most 64"]),
    ({"prompt": "a", "logit_bias": {str(i): 1 for i in range(1025)}}, 400, ["logit_bias holds 1025 items"]),
]


def test_bad_input_is_refused_while_good_requests_complete(server, client):
    good = [client.completions.create(model="tiny", prompt="good", max_tokens=n, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True}) for n in (30, 40)]
    with httpx.Client(base_url=server.url) as http:
        for body, status, words in BAD:
            r = http.post("/v1/completions", json=body)
            err = r.json()["error"]
            assert r.status_code == status and err["code"] == status, (body, r.text)
            assert all(w in err["message"] for w in words), (body, err["message"])
        r = http.post("/v1/completions", json={"prompt": [1] * 1024, "max_tokens": 1})   # the prompt is at fault
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = http.post("/v1/completions", json={"prompt": "a", "stop": 5})    # its forms said, not pydantic's names
        assert r.json()["error"]["param"] == "stop" and "a valid string or a valid list" in r.text, r.text
        r = http.post("/v1/completions", content=b"", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "must be a JSON object: it is empty" in r.text, r.text
        r = http.post("/v1/completions", content=b'{"prompt": "a", ', headers={"content-type": "application/json"})
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
        r = http.post("/v1/completions", content=b"\xff", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text     # OpenAI's shape, not FastAPI's
    with pytest.raises(openai.BadRequestError) as e:    # the official client reads the same body
        client.completions.create(model="tiny", prompt="a", max_tokens=0)
    assert e.value.param == "max_tokens" and "max_tokens=0" in e.value.message
    assert [sum(1 for c in s if c.choices) for s in good] == [30, 40]
    still = client.completions.create(model="tiny", prompt="still serving", max_tokens=3,   # sampled: EOS may come early
                                      extra_body={"ignore_eos": True})
    assert still.usage.completion_tokens == 3


def test_a_body_over_the_limit_is_refused_before_it_is_held_and_the_server_goes_on(server, client):
    """413 naming the limit, for a declared length (the official client's) and for a chunked body
    (read only up to the limit); a small chunked body still reaches the endpoint."""
    from orca_lab.serving.protocol import MAX_BODY_BYTES
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="a" * (MAX_BODY_BYTES + 1), max_tokens=1)
    assert e.value.status_code == 413 and f"at most {MAX_BODY_BYTES} bytes (16 MiB)" in e.value.message
    chunks = lambda: (b"a" * (1 << 20) for _ in range((MAX_BODY_BYTES >> 20) + 1))
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "runs past that: this server takes at most" in r.json()["error"]["message"]
        r = http.post("/v1/completions", content=iter([b'{"prompt": [1, 2], ', b'"max_tokens": 2}']),
                      headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text
    # raw HTTP: a small length declared beside a chunked body (which frames it) is no way past the limit;
    # a client asking to continue a body over the limit is answered before it sends any
    host, port = server.url.removeprefix("http://").split(":")
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b"a" * (1 << 20))
    for extra, body in (("Content-Length: 31\r\nTransfer-Encoding: chunked\r\n",
                         chunk * ((MAX_BODY_BYTES >> 20) + 1) + b"0\r\n\r\n"),
                        (f"Content-Length: {10 * MAX_BODY_BYTES}\r\nExpect: 100-continue\r\n", b"")):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall((head + extra + "\r\n").encode() + body)
            assert sock.recv(64).startswith(b"HTTP/1.1 413"), extra
    assert client.completions.create(model="tiny", prompt="still", max_tokens=2).usage.completion_tokens <= 2


def test_a_dropped_stream_frees_its_slots(server):
    body = {"model": "tiny", "prompt": [1] * 10, "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    aborted = metrics(server.url)['orca_lab_requests_total{status="abort"}']
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert sum(1 for ln, _ in zip(lines, range(6)) if ln.startswith("data:")) >= 3
            m = metrics(server.url)
            assert m["orca_lab_kv_slots_reserved"] >= 910 and m["orca_lab_requests_running"] == 1
        # the connection is closed here, mid-stream
    assert wait_for(lambda: metrics(server.url)['orca_lab_requests_total{status="abort"}'] == aborted + 1)
    m = metrics(server.url)
    assert m["orca_lab_kv_slots_reserved"] == 0 and m["orca_lab_kv_slots_used"] == 0
    assert m["orca_lab_requests_running"] == 0 and m["orca_lab_requests_waiting"] == 0
    rec = server_records(server.url).requests[-1]
    assert rec.finish_reason == "abort" and 3 <= rec.n_generated < 900


def test_bench_agrees_with_the_servers_own_records(server):
    """The same requests timed by the client (orca-lab bench) and by the server (arrival at the app
    to its first token chunk and its last byte): TTFT and end-to-end percentiles within 10%. Long
    prompts arriving at once make serving, not the HTTP hop (~10 ms on the loaded 2-core CI), the
    bulk of every latency, as on a real deployment."""
    trace = make_trace("fixed", 16, None, 257, input_len=300, output_len=4)
    run = asyncio.run(run_load(server.url, trace, "tiny"))
    assert run.n_failed == 0 and [r.n_generated for r in run.requests] == [4] * 16
    client_side = summarize(run, run.itl)
    server_side = summarize(server_records(server.url, [r.completion_id for r in run.requests]))
    assert server_side["n_requests"] == 16
    for key in ("ttft_median_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_median_ms", "e2e_p90_ms", "e2e_p99_ms"):
        assert server_side[key] <= client_side[key] <= 1.1 * server_side[key], (key, client_side, server_side)


def test_bench_cli_sweeps_rates_and_writes_its_report(server, tmp_path, capsys):
    from orca_lab.cli import main
    main(["bench", "--base-url", server.url, "--n-requests", "6", "--dataset", "fixed", "--input-len", "8",
          "--output-len", "4", "--sweep-rates", "50", "inf", "--slo-ttft-ms", "10000", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "ttft" in out and "norm_latency" in out and "goodput_rps" in out
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [row["rate"] for row in report["summary"]] == [50, float("inf")]
    assert all(row["n_requests"] == 6 and row["n_failed"] == 0 for row in report["summary"])
    assert report["environment"]["python"] and report["server"]["vocab_size"] == 257
    assert (tmp_path / "bench_sweep.html").stat().st_size > 10_000


def test_bench_takes_the_base_url_the_openai_client_takes(server, tmp_path):
    from orca_lab.cli import main
    main(["bench", "--base-url", server.url + "/v1/", "--n-requests", "2", "--dataset", "fixed",
          "--input-len", "4", "--output-len", "3", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [(row["n_requests"], row["n_failed"]) for row in report["summary"]] == [(2, 0)]


def test_bench_refuses_what_it_cannot_use_naming_it_and_fails_a_run_of_failed_requests(server, tmp_path, capsys):
    """Bad numbers and unusable servers are named before any request; a run whose every request
    failed exits 2 with the first error (its report written), never 0 with a table of NaN."""
    from orca_lab.cli import main
    bad = {("--seed", "-1"): "seed=-1 is out of range", ("--slo-ttft-ms", "nan"): "slo_ttft_ms=nan",
           ("--sweep-rates", "1", "nan"): "sweep_rates=nan is not allowed", ("--vocab-size", "0"): "vocab_size=0",
           ("--out", str(tmp_path / "bench.json")): "cannot make that folder",
           ("--base-url", "http://127.0.0.1:1"): "GET http://127.0.0.1:1/v1/models failed (ConnectError"}
    (tmp_path / "bench.json").write_text("{}")
    for flags, words in bad.items():
        with pytest.raises(SystemExit) as e:
            main(["bench", "--base-url", server.url, "--n-requests", "2", *flags])
        assert e.value.code == 2 and words in capsys.readouterr().err, flags
    with pytest.raises(SystemExit) as e:        # ids past the model's vocabulary: each request a 400
        main(["bench", "--base-url", server.url, "--n-requests", "2", "--dataset", "fixed", "--input-len", "4",
              "--output-len", "2", "--vocab-size", "100000", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "every request failed (2) at inf req/s; the first: HTTP 400" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["summary"][0]["n_failed"] == 2


def test_debug_run_pages_give_new_records_only(server, client):
    """Each page of /debug/run holds what is new since the previous one: here one completion, its
    engine request and its iterations; then nothing."""
    pages = DebugRun(server.url)
    pages.fetch()                                          # everything so far
    done = client.completions.create(model="tiny", prompt="page", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    page = pages.fetch()
    assert list(page["completions"]) == [done.id]
    rids = page["completions"][done.id]["rids"]
    assert [r["rid"] for r in page["requests"]] == rids and page["requests"][0]["n_generated"] == 5
    assert len(page["iterations"]) == 5 and all(rids[0] in it["rids"] for it in page["iterations"])
    assert all(it["end"] > page["since"] for it in page["iterations"]) and page["now"] > page["since"]
    empty = pages.fetch()
    assert (empty["completions"], empty["requests"], empty["iterations"]) == ({}, [], [])
    for bad in ("-1", "abc", "nan"):
        r = httpx.get(server.url + "/debug/run", params={"since": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "query.since", r.text


def assert_no_debug_run(url):
    """Without --debug: a 404 in OpenAI's error shape saying how to turn it on, and not in the schema."""
    r = httpx.get(url + "/debug/run")
    assert r.status_code == 404 and "orca-lab serve --debug" in r.json()["error"]["message"]
    assert "/debug/run" not in httpx.get(url + "/openapi.json").json()["paths"]


# -- a second server: overload, then shutdown ------------------------------------------------------
def test_an_engine_idle_past_its_stall_bound_serves_the_next_burst():
    """An idle engine sends nothing: its silence counts from when it is asked again, so the first
    burst after a quiet spell longer than ``--stall-s`` is served, not refused as stuck (503)."""
    with ServerProcess("--stall-s", 1) as s:
        ask = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
        assert httpx.post(s.url + "/v1/completions", json=ask, timeout=30).status_code == 200
        time.sleep(2)

        async def burst():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
                return await asyncio.gather(*[http.post("/v1/completions", json=ask) for _ in range(8)],
                                            http.get("/health"))
        assert [r.status_code for r in asyncio.run(burst())] == [200] * 9


def test_overload_answers_503_and_loses_nothing_then_shuts_down_clean():
    s = ServerProcess("--max-bs", "1", "--max-queue", "2", "--drain-s", "1").start()
    try:
        assert_no_debug_run(s.url)
        asyncio.run(_overload(s))
        _drain_on_sigterm(s)
    finally:
        s.kill()
    assert_port_free(s)


async def _overload(s):
    """One request holds the only batch place (max_bs 1), two wait (max_queue 2): the next is
    refused with 503 and Retry-After. The holder's client leaves; the two waiting still complete.
    The engine is paused while the queue is full: the holder cannot finish, however fast the host."""
    async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
        post = lambda: asyncio.ensure_future(http.post("/v1/completions", json={
            "prompt": "q", "max_tokens": 3, "temperature": 0, "ignore_eos": True}))
        async with http.stream("POST", "/v1/completions", json={"prompt": "q", "max_tokens": 1000,
                                                                "stream": True, "ignore_eos": True}):
            await _until(http, lambda m: m["orca_lab_requests_running"] == 1)
            with paused(engine_pid(s)):
                queued = [post(), post()]
                await _until(http, lambda m: m["orca_lab_requests_waiting"] == 2)
                r = await http.post("/v1/completions", json={"prompt": "q", "max_tokens": 3})
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert "max_queue=2" in r.json()["error"]["message"]
        done = await asyncio.gather(*queued)
    assert [(d.status_code, d.json()["usage"]["completion_tokens"]) for d in done] == [(200, 3)] * 2


async def _until(http, cond, timeout=20.0):
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        if cond(parse_metrics((await http.get("/metrics")).text)):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the server never reached the expected state")


def _drain_on_sigterm(s, drain_s=1.0):
    """SIGTERM: a request that fits in --drain-s finishes, one that does not is cut, and the process
    exits within 10 s. Once the short one is done the engine is paused until the drain is over, so
    the long one cannot finish in it, however fast the host."""
    with httpx.Client(base_url=s.url, timeout=30) as http:
        short = {"prompt": "a", "max_tokens": 20, "stream": True, "ignore_eos": True}
        long = {**short, "max_tokens": 1000}
        with http.stream("POST", "/v1/completions", json=short) as r1, \
                http.stream("POST", "/v1/completions", json=long) as r2:
            lines1, lines2 = r1.iter_lines(), r2.iter_lines()
            next(lines1), next(lines2)
            s.proc.send_signal(signal.SIGTERM)
            t0 = time.perf_counter()
            got1 = [ln for ln in lines1 if ln.startswith("data:")]
            with paused(engine_pid(s)):
                time.sleep(max(0.0, t0 + drain_s + 0.2 - time.perf_counter()))
            got2 = [ln for ln in lines2 if ln.startswith("data:")]       # aborted at the end of the drain
    assert got1[-1] == "data: [DONE]" and len(got1) == 20      # the 19 tokens left, then [DONE]
    assert got2[-1] == "data: [DONE]" and '"finish_reason": "abort"' in got2[-2] and len(got2) < 1000
    assert s.proc.wait(10) == 0
    assert time.perf_counter() - t0 < 10


# -- with worker processes: nothing outlives the server ---------------------------------------------
def server_with_workers(degree: str, tmp_path, system: str = "orca") -> tuple[ServerProcess, dict]:
    """A server over 2 worker processes that has served one request (its greedy tokens those of
    ``LLM.generate``, all of them), and its process tree: the engine process, the fork server, the
    2 workers, multiprocessing's resource tracker."""
    s = ServerProcess("--max-bs", "4", degree, "2", "--system", system, "--drain-s", "1",
                      env={"TMPDIR": str(tmp_path)}).start()
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="tiny", prompt="hi", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == LLM("tiny", seed=0).generate(["hi"], 6)[0]
        assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
        tree = descendants(s.proc.pid)
        kinds = [next((k for k in ("spawn_main", "forkserver", "resource_tracker") if k in cmd), cmd)
                 for _, cmd in tree.values()]
        assert sorted(kinds) == ["forkserver"] * 3 + ["resource_tracker", "spawn_main"], tree
    except BaseException:
        tree = descendants(s.proc.pid)
        s.kill()
        kill_left(tree)
        raise
    return s, tree


@pytest.mark.parametrize("sig, degree, system", [(signal.SIGTERM, "--tp", "orca"), (signal.SIGINT, "--pp", "ft")],
                         ids=["SIGTERM-tp-orca", "SIGINT-pp-ft"])
def test_workers_stop_with_the_server(sig, degree, system, tmp_path):
    """SIGTERM or SIGINT: when the server has exited, so have its engine process, its workers and the
    fork server they came from; multiprocessing's resource tracker follows its parent; the port and
    the temporary files are gone."""
    s, tree = server_with_workers(degree, tmp_path, system)
    try:
        t0 = time.perf_counter()
        s.proc.send_signal(sig)
        s.proc.wait(10)
        left_at_exit = {p: cmd for p, cmd in running(tree).items() if "resource_tracker" not in cmd}
        assert wait_for(lambda: not running(tree), 10 - (time.perf_counter() - t0)), running(tree)
    finally:
        s.kill()
        kill_left(tree)
    assert left_at_exit == {}
    assert_port_free(s)
    # torchinductor_<user> is torch's compile cache, kept across runs on purpose
    assert [f.name for f in tmp_path.iterdir() if not f.name.startswith("torchinductor_")] == []


def test_a_killed_server_takes_its_engine_and_workers_with_it(tmp_path):
    """SIGKILL leaves the server no say: its engine process reads the end of its pipe, stops its
    workers and the fork server, and exits."""
    s, tree = server_with_workers("--tp", tmp_path)
    try:
        s.proc.kill()
        s.proc.wait()
        assert wait_for(lambda: not running(tree), 10), running(tree)
    finally:
        kill_left(tree)


@pytest.mark.parametrize("flag, value, message", [
    ("--max-queue", "0", "max_queue=0"), ("--drain-s", "-1", "drain_s=-1.0"), ("--max-bs", "0", "max_bs=0"),
    ("--model", "gpt-9", "model='gpt-9'")])
def test_serve_refuses_bad_options_before_it_starts(flag, value, message, capsys):
    from orca_lab.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", flag, value])
    assert e.value.code == 2 and message in capsys.readouterr().err


# -- a third server: its engine process dies --------------------------------------------------------
def test_an_engine_that_dies_ends_its_streams_and_the_server_exits_non_zero():
    """A stream in flight ends with "abort"; a non-streaming request in flight gets 503 naming the
    engine's exit code, not 200 with the text it had so far; then the server exits with code 1 (for
    a supervisor to restart it), saying why, and leaves no process and no port behind."""
    s = ServerProcess("--max-bs", "4", "--drain-s", "1").start()
    body = {"prompt": "a", "max_tokens": 1000, "ignore_eos": True}
    try:
        with httpx.Client(base_url=s.url, timeout=30) as http, ThreadPoolExecutor(1) as pool:
            whole = pool.submit(http.post, "/v1/completions", json=body)
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                assert wait_for(lambda: metrics(s.url)["orca_lab_requests_running"] == 2)
                pid = engine_pid(s)
                os.kill(pid, signal.SIGKILL)
                chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
            assert chunks[-1]["choices"][0]["finish_reason"] == "abort" and len(chunks) < 999
            whole = whole.result()
            assert whole.status_code == 503 and "engine process exited (code -9)" in whole.json()["error"]["message"]
        assert s.proc.wait(15) == 1
        assert "the engine died (the engine process exited (code -9)); exiting with code 1" in s.output, s.output
        assert_port_free(s)
        assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"))   # the engine is gone, not a zombie
    finally:
        s.kill()


def test_an_engine_that_raises_answers_503_with_its_exit_code_and_none_of_the_servers_files():
    """The engine runs out of memory (its address space capped under what a long prompt needs): the
    503 names the exit code and the kind of error; the traceback is the server's log's, not the
    client's; the server exits with code 1."""
    s = ServerProcess("--max-bs", "4", "--n-slots", "2048", "--drain-s", "1").start()
    try:
        pid = engine_pid(s)
        vm = next(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ln.startswith("VmSize")) * 1024
        resource.prlimit(pid, resource.RLIMIT_AS, (vm + (8 << 20), resource.RLIM_INFINITY))
        body = {"prompt": "a" * 500, "max_tokens": 500, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "engine process exited (code 1)" in message and "RuntimeError" in message, message
        assert ".py" not in message and "Traceback" not in message and "orca_lab" not in message, message
        assert s.proc.wait(15) == 1 and "Traceback" in s.output     # the operator has it
        assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"))
    finally:
        s.kill()


# -- what the engine process keeps -----------------------------------------------------------------
@pytest.mark.parametrize("history", [0, HISTORY])
def test_the_engine_loop_keeps_per_request_history_only_for_debug(history):
    """Without --debug (history 0) the engine keeps no request or iteration once it is delivered
    (a server's memory grew with what it served: ~160 MiB over 20,000 requests); with it, a bounded
    history for /debug/run."""
    import multiprocessing as mp
    from orca_lab import SamplingParams
    engine = LLM("tiny", seed=0).new_engine("orca")
    inbox, to_engine = mp.Pipe(duplex=False)
    from_engine, outbox = mp.Pipe(duplex=False)
    loop = EngineLoop(engine, inbox, outbox, history)
    try:
        for i in range(3):
            loop.handle(("add", i, [(i, [1, 2, 3], SamplingParams(max_gen_tokens=4), None)]))
        for _ in range(100):
            if not engine.has_work():
                break
            loop.turn()
        assert not engine.has_work() and not loop.rids
        kept = (len(engine.requests), len(engine.records) > 0)
        assert kept == ((0, False) if history == 0 else (3, True))
    finally:
        engine.close()
        for c in (inbox, to_engine, from_engine, outbox):
            c.close()


@pytest.mark.parametrize("debug", [False, True])
def test_the_endpoint_keeps_http_records_only_for_debug(debug):
    """The HTTP half of the same: without --debug the endpoint keeps no completion's record (it kept
    100,000, ~108 MB); with it, the engine's HISTORY, the last ones."""
    from types import SimpleNamespace
    from orca_lab.serving.app import build_app
    from orca_lab.serving.state import HTTPRecord
    core = SimpleNamespace(info=SimpleNamespace(cfg=SimpleNamespace(name="m"), tokenizer=None), clock=None)
    state = build_app(core, debug=debug).state.orca
    for i in range(HISTORY + 5):
        state.record(f"cmpl-{i}", HTTPRecord([i], 0.0))
    assert list(state.completions)[:1] == ([] if not debug else ["cmpl-5"])
    assert len(state.completions) == (HISTORY if debug else 0)
