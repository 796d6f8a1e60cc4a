"""An HTTP soak: many mixed requests against ``orca-lab serve``, every answer checked, the engine
process's memory sampled as it goes.

    python benchmarks/soak.py [--n-requests 20000] [--concurrency 32] [--max-bs 16] [--n-slots 4096]
                              [--system orca] [--sample-every 500] [--out docs/results/soak_cpu.json]

The requests (seeded): completions and chats, streamed and whole, with logprobs (0-5), echo,
``prompt_logprobs``, ``return_tokens_as_token_ids``, n=2, presence/frequency/repetition penalties,
``logit_bias``, seeds, stop strings and stop token ids; a tenth of the streams are dropped by their
client after the first chunk. Each answer is checked: status 200, ``n`` choices per prompt, each
with ``max_tokens`` tokens (``ignore_eos``; at most that with a stop), the usage counts, ``k`` or
``k + 1`` distinct keys in each ``top_logprobs``, a stream's ``[DONE]``. At the end the server's
gauges must be back at zero (nothing waiting, running or reserved). The engine process's RSS is
read every ``--sample-every`` requests; the bar: flat after the first 2,000 (its growth from then
to the end is reported). The server runs without ``--debug``, as in production. Exits 1 on any
failed check.

One request in fifty (``--hostile-every``) is hostile: a mask that leaves no token to sample
(every token id a stop token, with ``min_tokens``), a lone surrogate in a prompt, a stop string or a
chat message, a token id out of the vocabulary (prompt, ``logit_bias``, ``stop_token_ids``), or a
stream its client drops after the first chunk. Each must be answered with its error (a 400 naming
its field; a dropped stream's slots freed), every other request right, and the engine process the
same one from start to end (never restarted).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from orca_lab.results import write_report
from orca_lab.serving.launch import ServerProcess
from orca_lab.serving.metrics import parse_metrics

CHATML = Path(__file__).resolve().parent.parent / "tests" / "chat" / "chatml.jinja"
WARM = 2000                     # requests after which the engine's RSS must be flat
VOCAB = 257                     # the tiny preset's


@dataclass
class Tally:
    statuses: dict = field(default_factory=dict)
    kinds: dict = field(default_factory=dict)
    wrong: list = field(default_factory=list)          # (request, what was wrong), the first 20
    n_wrong: int = 0
    dropped: int = 0
    done: int = 0
    hostile: dict = field(default_factory=dict)        # hostile requests answered, by the field refused

    def count(self, status: int, kind: str):
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.done += 1

    def check(self, ok: bool, body: dict, what: str):
        if not ok:
            self.n_wrong += 1
            if len(self.wrong) < 20:
                self.wrong.append((body, what))


def make_request(rng: random.Random) -> tuple[str, dict]:
    """One mixed request: its route and body."""
    max_tokens = rng.randint(1, 12)
    body = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True, "stream": rng.random() < 0.5,
            "temperature": rng.choice([0.0, 0.7, 1.0]), "n": rng.choice([1, 1, 2])}
    if rng.random() < 0.3:
        body["logit_bias"] = {str(rng.randrange(256)): rng.uniform(-5, 5) for _ in range(rng.randint(1, 3))}
    if rng.random() < 0.3:
        body.update(presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1),
                    repetition_penalty=rng.uniform(0.8, 1.3))
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(2 ** 63)
    if rng.random() < 0.1:
        body["stop"] = [chr(rng.randrange(32, 127))]
    elif rng.random() < 0.1:
        body["stop_token_ids"] = [rng.randrange(256)]
    if rng.random() < 0.15:
        body["return_tokens_as_token_ids"] = True
    if rng.random() < 0.2:
        body["messages"] = [{"role": "user", "content": "".join(chr(rng.randrange(32, 127)) for _ in range(8))}]
        if rng.random() < 0.5:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        return "/v1/chat/completions", body
    body["prompt"] = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
    if rng.random() < 0.4:
        body["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.2:
        body["echo"] = True
    if rng.random() < 0.1:
        body["prompt_logprobs"] = rng.randint(0, 3)
    return "/v1/completions", body


def make_hostile(rng: random.Random) -> tuple[str, dict, str | None]:
    """One hostile request: its route, its body, and the field its 400 must name (None: a stream
    its client drops, which must be answered like any other until it leaves)."""
    base = {"model": "tiny", "max_tokens": 3, "prompt": [rng.randrange(256) for _ in range(5)]}
    kind = rng.randrange(8)
    if kind == 0:
        return "/v1/completions", {**base, "stop_token_ids": list(range(VOCAB)), "min_tokens": 2,
                                   "temperature": 1.0}, "stop_token_ids"
    if kind == 1:
        return "/v1/completions", {**base, "prompt": "x\ud800y"}, "prompt"
    if kind == 2:
        return "/v1/completions", {**base, "stop": ["a\udfffb"]}, "stop"
    if kind == 3:
        return "/v1/chat/completions", {"model": "tiny", "max_tokens": 3,
                                        "messages": [{"role": "user", "content": "hi \ud83d"}]}, "messages"
    if kind == 4:
        return "/v1/completions", {**base, "prompt": [1, VOCAB + rng.randrange(10 ** 6)]}, "prompt"
    if kind == 5:
        return "/v1/completions", {**base, "logit_bias": {str(VOCAB + rng.randrange(10 ** 6)): 1.0}}, "logit_bias"
    if kind == 6:
        return "/v1/completions", {**base, "stop_token_ids": [VOCAB + rng.randrange(10 ** 6)]}, "stop_token_ids"
    return "/v1/completions", {**base, "max_tokens": 50, "ignore_eos": True, "stream": True, "n": 1}, None


async def hostile(http: httpx.AsyncClient, t: Tally, route: str, body: dict, param: str | None):
    """Sent as JSON text written here: a lone surrogate is valid JSON (an escape) that httpx's own
    encoder would refuse to send."""
    if param is None:
        await streamed(http, t, route, body, drop=True)
        t.hostile["dropped stream"] = t.hostile.get("dropped stream", 0) + 1
        return
    r = await http.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
    t.count(r.status_code, route + " (hostile)")
    got = r.json().get("error", {}).get("param") if r.headers.get("content-type") == "application/json" else None
    t.check(r.status_code == 400 and got == param, body, f"hostile: {r.status_code} param={got!r}, want 400 "
                                                         f"param={param!r}: {r.text[:200]}")
    t.hostile[param] = t.hostile.get(param, 0) + 1


def n_of(body: dict, choice: dict) -> tuple[int, int | None]:
    """A choice's tokens, and the ``k`` of its logprobs (None: not asked), from what it carries."""
    lp = choice.get("logprobs")
    if "messages" in body:
        return (len(lp["content"]) if lp else None), body.get("top_logprobs")
    return (len(lp["tokens"]) if lp else None), body.get("logprobs")


def check_logprobs(t: Tally, body: dict, lp: dict | None, k: int | None):
    if lp is None or k is None:
        return
    if "content" in lp:
        t.check(all(len({x["token"] for x in c["top_logprobs"]}) == k for c in lp["content"]), body, "chat top k")
    else:
        t.check(all(top is None or len(top) in (k, k + 1) for top in lp["top_logprobs"]), body, "top_logprobs k")


def check_count(t: Tally, body: dict, n_tokens: int, reason: str):
    stops = "stop" in body or "stop_token_ids" in body
    if stops:
        t.check(n_tokens <= body["max_tokens"] and reason in ("stop", "length"), body, f"{n_tokens} tokens, {reason}")
    else:
        t.check(n_tokens == body["max_tokens"] and reason == "length", body, f"{n_tokens} tokens, {reason}")


async def whole(http: httpx.AsyncClient, t: Tally, route: str, body: dict):
    r = await http.post(route, json=body)
    t.count(r.status_code, route)
    if r.status_code != 200:
        t.check(False, body, r.text[:300])
        return
    out = r.json()
    t.check(len(out["choices"]) == body["n"], body, f"{len(out['choices'])} choices")
    for c in out["choices"]:
        n_lp, k = n_of(body, c)
        if n_lp is not None and "messages" not in body:
            prompt_len = len(body["prompt"]) if body.get("echo") else 0
            n_lp -= prompt_len
        check_logprobs(t, body, c.get("logprobs"), k)
        if n_lp is not None:
            check_count(t, body, n_lp, c["finish_reason"])
        if body.get("prompt_logprobs") is not None:
            plp = c.get("prompt_logprobs") or [0]
            t.check(plp[0] is None and len(plp) == len(body["prompt"]), body, f"prompt_logprobs {plp}")
    usage = out["usage"]
    if "stop" not in body and "stop_token_ids" not in body:
        t.check(usage["completion_tokens"] == body["n"] * body["max_tokens"], body, f"usage {usage}")


async def streamed(http: httpx.AsyncClient, t: Tally, route: str, body: dict, drop: bool):
    tokens, reasons, lps, done = {}, {}, {}, False
    async with http.stream("POST", route, json=body) as r:
        t.count(r.status_code, route + " (stream)")
        if r.status_code != 200:
            t.check(False, body, (await r.aread()).decode()[:300])
            return
        async for line in r.aiter_lines():
            if drop:                              # the client leaves after its first chunk
                t.dropped += 1
                return
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for c in json.loads(line[6:])["choices"]:
                    i = c["index"]
                    lp = c.get("logprobs")
                    n_lp, k = n_of(body, c)
                    check_logprobs(t, body, lp, k)
                    if n_lp is not None:
                        lps[i] = lps.get(i, 0) + n_lp
                    if c.get("finish_reason"):
                        reasons[i] = c["finish_reason"]
    t.check(done and len(reasons) == body["n"], body, f"[DONE] {done}, {len(reasons)} choices ended")
    for i, n in lps.items():
        prompt_len = len(body["prompt"]) if body.get("echo") else 0
        check_count(t, body, n - prompt_len, reasons.get(i))


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1]) / 1024


async def soak(args, url: str, engine_pid: int) -> tuple[Tally, list[dict]]:
    rng, t, samples = random.Random(args.seed), Tally(), []
    queue = asyncio.Queue()
    for i in range(args.n_requests):
        queue.put_nowait(make_hostile(rng) if (i + 1) % args.hostile_every == 0 else make_request(rng))
    t0 = time.perf_counter()
    samples.append({"requests": 0, "seconds": 0.0, "engine_rss_mib": rss_mib(engine_pid)})
    next_at = [args.sample_every]

    async def client(http):
        while not queue.empty():
            route, body, *hostile_field = queue.get_nowait()
            try:
                if hostile_field:
                    await hostile(http, t, route, body, hostile_field[0])
                elif body["stream"]:
                    await streamed(http, t, route, body, drop=rng.random() < 0.1)
                else:
                    await whole(http, t, route, body)
            except httpx.TransportError as e:         # counted, named, and the soak goes on
                t.count(type(e).__name__, route)
                t.check(False, body, f"{type(e).__name__}: {e}")
            if t.done >= next_at[0]:
                next_at[0] += args.sample_every
                samples.append({"requests": t.done, "seconds": time.perf_counter() - t0,
                                "engine_rss_mib": rss_mib(engine_pid)})
                print(f"{t.done:>7} requests  {samples[-1]['seconds']:7.0f} s  engine RSS "
                      f"{samples[-1]['engine_rss_mib']:.0f} MiB", flush=True)

    # below uvicorn's keep-alive (5 s): httpx's default expiry equals it, so a pooled connection the
    # server is closing could be reused, and that request fail with a ReadError the server never saw
    limits = httpx.Limits(max_connections=args.concurrency, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
    return t, samples


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-bs", type=int, default=16)
    p.add_argument("--n-slots", type=int, default=4096)
    p.add_argument("--system", default="orca")
    p.add_argument("--sample-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hostile-every", type=int, default=50, help="one request in this many is hostile")
    p.add_argument("--out", default="docs/results/soak_cpu.json")
    args = p.parse_args(argv)
    with ServerProcess("--model", "tiny", "--seed", "0", "--max-bs", args.max_bs, "--n-slots", args.n_slots,
                       "--system", args.system, "--chat-template", CHATML) as server:
        pid = server.engine_pid()
        t, samples = asyncio.run(soak(args, server.url, pid))
        time.sleep(0.5)                               # the dropped streams' aborts reach the engine
        gauges = parse_metrics(httpx.get(server.url + "/metrics").text)
        same_engine = server.engine_pid() == pid and httpx.get(server.url + "/health").status_code == 200
    left = {g: gauges[f"orca_lab_{g}"] for g in ("requests_waiting", "requests_running", "kv_slots_reserved")}
    warm = next((s for s in samples if s["requests"] >= WARM), samples[0])
    growth = samples[-1]["engine_rss_mib"] - warm["engine_rss_mib"]
    server_errors = sum(v for k, v in t.statuses.items() if not isinstance(k, int) or k >= 500)
    print(f"\n{'requests':>9} {'seconds':>8} {'engine RSS MiB':>15}")
    for s in samples:
        print(f"{s['requests']:>9} {s['seconds']:>8.0f} {s['engine_rss_mib']:>15.1f}")
    print(f"\nhostile requests answered with their error, by field: {t.hostile}; the engine process the same "
          f"from start to end and healthy: {same_engine}")
    print(f"statuses {t.statuses}; kinds {t.kinds}; streams dropped {t.dropped}; wrong answers {t.n_wrong}; "
          f"gauges at the end {left}; engine RSS after {warm['requests']} requests "
          f"{warm['engine_rss_mib']:.0f} MiB, at the end {samples[-1]['engine_rss_mib']:.0f} MiB ({growth:+.1f})")
    for body, what in t.wrong[:5]:
        print("wrong:", what, json.dumps(body)[:300])
    write_report(args.out, args, {"statuses": {str(k): v for k, v in t.statuses.items()}, "kinds": t.kinds,
                                  "dropped_streams": t.dropped, "wrong_answers": t.n_wrong,
                                  "hostile_answered": t.hostile, "same_engine_process": same_engine,
                                  "first_wrong": t.wrong, "gauges_at_end": left, "rss_samples": samples,
                                  "rss_growth_after_warmup_mib": growth})
    return int(server_errors > 0 or t.n_wrong > 0 or any(left.values()) or not same_engine)


if __name__ == "__main__":
    sys.exit(main())
