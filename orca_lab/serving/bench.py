"""``orca-lab bench``: a load generator for any OpenAI-compatible completions endpoint.

It sends a trace (the paper's lengths, or fixed ones) as token-id prompts with ``ignore_eos``, so
any server (this one, vLLM, SGLang) does the same work, at Poisson or gamma (bursty) arrivals,
optionally under a concurrency cap, streaming every answer. Each request's times are taken on the
client (send, every chunk, end); the summary (TTFT, TPOT, ITL, end-to-end and the paper's normalized
latency, throughput, goodput) comes from ``orca_lab.metrics``, the same code that summarizes the
engine's own ``RunResult``. ``--sweep-rates`` draws the latency-throughput curve of Figure 10.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from orca_lab.config import FieldError, check_choice, check_out_dir, check_range
from orca_lab.engine.engine import _progress
from orca_lab.engine.fields import check
from orca_lab.environment import environment
from orca_lab.metrics import summarize
from orca_lab.serving.auth import KEY_ENV, bearer
from orca_lab.workload import MAX_TRACE_REQUESTS, check_rate, few_shot_trace, homogeneous_trace, paper_trace

DATASETS = ("paper", "fixed", "few-shot")


@dataclass
class ClientRecord:
    """One request as the client saw it; times in seconds since the run's start."""
    index: int
    arrival: float                      # sent
    prompt_len: int
    max_tokens: int
    n_generated: int = 0
    t_first_token: float | None = None
    t_finish: float | None = None
    itl: list[float] = field(default_factory=list)   # gaps between chunks after the first
    completion_id: str | None = None
    error: str | None = None
    t_scheduled: float | None = None    # unknown to a client (metrics.per_request reads it)


@dataclass
class ClientRun:
    """A load run's records, in the shape ``orca_lab.metrics`` reads (``requests_df``, ``duration``)."""
    requests: list[ClientRecord]
    duration: float                     # first send to last finish

    def requests_df(self):
        import pandas as pd
        return pd.DataFrame([dataclasses.asdict(r) for r in self.requests])

    @property
    def itl(self) -> list[float]:
        return [g for r in self.requests if r.t_finish is not None for g in r.itl]

    @property
    def n_failed(self) -> int:
        return sum(r.error is not None for r in self.requests)

    def summary(self, slo_ttft_ms=None, slo_tpot_ms=None) -> dict:
        return {**summarize(self, self.itl, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms), "n_failed": self.n_failed}


MAX_CONCURRENCY = 1 << 20
# the trace's fields as its makers name them, and the options that set them
OPTION_OF = {"dataset": "--dataset", "burstiness": "--burstiness", "scale": "--scale", "input_len": "--input-len",
             "prefix_len": "--input-len", "gen_len": "--output-len"}


def make_trace(dataset: str, n: int, rate: float | None, vocab_size: int, seed: int = 0, burstiness: float = 1.0,
               scale: float = 1.0, input_len: int = 128, output_len: int = 128):
    """The requests to send. ``burstiness`` is the gamma shape of the gaps (vLLM's): 1 is Poisson,
    below 1 burstier; ``rate`` None sends everything at once."""
    check_choice("dataset", dataset, DATASETS)
    check_range("burstiness", burstiness, 1e-4, 1e6, kind=float)
    cv = 1.0 / math.sqrt(burstiness)
    if dataset == "paper":
        return paper_trace(n, rate, seed, scale=scale, vocab_size=vocab_size, cv=cv)
    if dataset == "few-shot":        # one shared prefix of input_len tokens, a question of 8-32 each
        return few_shot_trace(n, input_len, (8, 32), (output_len, output_len), rate, seed, vocab_size, cv)
    return homogeneous_trace(n, input_len, output_len, rate, seed, vocab_size=vocab_size, cv=cv)


def server_root(base_url: str) -> str:
    """The server's address without a trailing ``/v1``: what the ``openai`` client takes as its
    base URL works here too."""
    url = base_url.rstrip("/")
    return url[:-len("/v1")] if url.endswith("/v1") else url


async def run_load(base_url: str, trace, model: str | None = None, max_concurrency: int | None = None,
                   progress: bool = False, timeout_s: float = 600.0) -> ClientRun:
    """Send ``trace`` at its arrival times (streaming, greedy, ``ignore_eos``) and record each answer."""
    if max_concurrency is not None:
        check_range("max_concurrency", max_concurrency, 1, MAX_CONCURRENCY)
    limit = asyncio.Semaphore(max_concurrency or len(trace))
    bar = _progress(len(trace), progress)
    limits = httpx.Limits(max_connections=max_concurrency or len(trace), max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=server_root(base_url), timeout=timeout_s, limits=limits,
                                 headers=bearer()) as client:
        start = time.perf_counter()

        async def one(i, item):
            await asyncio.sleep(max(0.0, start + item.arrival - time.perf_counter()))
            async with limit:
                rec = await _send(client, model, i, item, start)
            if bar is not None:
                bar.update()
            return rec

        records = await asyncio.gather(*(one(i, it) for i, it in enumerate(trace)))
    if bar is not None:
        bar.close()
    done = [r for r in records if r.t_finish is not None]
    duration = max((r.t_finish for r in done), default=0.0) - min((r.arrival for r in done), default=0.0)
    return ClientRun(list(records), duration)


async def _send(client: httpx.AsyncClient, model, i: int, item, start: float) -> ClientRecord:
    payload = {"prompt": list(item.prompt), "max_tokens": item.max_gen_tokens, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        payload["model"] = model
    rec = ClientRecord(i, time.perf_counter() - start, len(item.prompt), item.max_gen_tokens)
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter() - start
                if chunk.get("choices"):           # a token (vLLM's bench counts chunks the same way)
                    if last is None:
                        rec.t_first_token = now
                    else:
                        rec.itl.append(now - last)
                    last = now
                    rec.n_generated += 1
                    rec.completion_id = chunk.get("id")
                if chunk.get("usage"):
                    rec.n_generated = chunk["usage"]["completion_tokens"]
        rec.t_finish = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


def server_card(base_url: str) -> dict:
    """The first model of ``GET /v1/models`` (this server adds vocab_size, system, max_bs); a server
    that cannot be reached or answers no model list is a ValueError saying which."""
    url = server_root(base_url) + "/v1/models"
    try:
        resp = httpx.get(url, timeout=30, headers=bearer())
        resp.raise_for_status()
        models = resp.json()["data"]
    except httpx.HTTPStatusError as e:
        hint = f": set {KEY_ENV} to the server's key" if e.response.status_code == 401 else ""
        raise ValueError(f"--base-url {base_url}: GET {url} answered {e.response.status_code}{hint}") from None
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:     # (httpx.InvalidURL is a ValueError)
        raise ValueError(f"--base-url {base_url}: GET {url} failed ({type(e).__name__}: {e})") from None
    if not isinstance(models, list) or not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ValueError(f"--base-url {base_url}: GET {url} lists no model")
    return models[0]


def check_args(args):
    """The seed, the SLOs, ``--vocab-size``, every rate and ``--out``, each named with its range, before
    the server is asked anything (the trace's own fields are checked when the first trace is made)."""
    check("seed", args.seed)
    if args.vocab_size is not None:
        check_range("vocab_size", args.vocab_size, 2, 1 << 24)
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        if getattr(args, name) is not None:
            check_range(name, getattr(args, name), 0.0, 1e9, kind=float, open_lo=True)
    for rate in args.sweep_rates or [args.rate]:        # every rate before the first run (inf: all at once)
        check_rate(None if rate == math.inf else rate, "sweep_rates" if args.sweep_rates else "rate", offline="inf")
    check_range("n_requests", args.n_requests, 1, MAX_TRACE_REQUESTS)
    if args.max_concurrency is not None:
        check_range("max_concurrency", args.max_concurrency, 1, MAX_CONCURRENCY)
    try:                     # the trace's own fields: its first request made here, named by option
        make_trace(args.dataset, 1, None, args.vocab_size or 2, args.seed, args.burstiness, args.scale,
                   args.input_len, args.output_len)
    except FieldError as e:
        raise FieldError(f"{OPTION_OF.get(e.field, e.field)}: {e}", e.field) from None
    check_out_dir("out", args.out)


def run(args) -> dict:
    """The CLI's bench: one run, or one per rate of ``--sweep-rates``; a table on stdout, JSON
    (and with a sweep, the curve as HTML) under ``--out``. A run (a rate of a sweep) in which every
    request failed ends it in a ValueError with the first error, after the JSON is written."""
    check_args(args)
    card = server_card(args.base_url)
    vocab = args.vocab_size or card.get("vocab_size")
    if vocab is None:
        raise ValueError("the server does not report vocab_size: pass --vocab-size")
    rates = args.sweep_rates or [args.rate]
    rows, runs = [], []
    for rate in rates:
        trace = make_trace(args.dataset, args.n_requests, None if math.isinf(rate) else rate, vocab, args.seed,
                           args.burstiness, args.scale, args.input_len, args.output_len)
        before = prefix_cache_counts(args.base_url)
        res = asyncio.run(run_load(args.base_url, trace, card["id"], args.max_concurrency, progress=True))
        rows.append({"rate": rate, **res.summary(args.slo_ttft_ms, args.slo_tpot_ms),
                     "prefix_hit_rate": prefix_hit_rate(before, prefix_cache_counts(args.base_url))})
        runs.append(res)
        print(format_summary(rows[-1], f"{card['id']} at {rate:g} req/s"))
    report = {"args": vars(args), "environment": environment(), "server": card, "summary": rows,
              "requests": [[dataclasses.asdict(r) for r in res.requests] for res in runs]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out / 'bench.json'}")
    if args.sweep_rates:
        path = out / "bench_sweep.html"
        from orca_lab.viz import export
        export(sweep_figure(rows, card), path)
        print(f"wrote {path}")
    for rate, res in zip(rates, runs):
        if res.requests and res.n_failed == len(res.requests):
            raise ValueError(f"every request failed ({res.n_failed}) at {rate:g} req/s; the first: "
                             f"{res.requests[0].error}")
    return report


def sweep_figure(rows: list[dict], card: dict):
    """Figure 10's shape, measured over HTTP: throughput vs median normalized latency, per rate."""
    import pandas as pd
    from orca_lab.viz.curves import latency_throughput_figure
    df = pd.DataFrame(rows).assign(system=card.get("system", card["id"]), max_bs=card.get("max_bs", 0),
                                   mbs=float("nan"), model=card["id"])
    return latency_throughput_figure(df, "norm_latency_median_ms",
                                     title="latency vs throughput over HTTP (orca-lab bench)")


PREFIX_COUNTERS = ("orca_lab_prefix_cache_hit_tokens_total", "orca_lab_prefix_cache_query_tokens_total")


def prefix_cache_counts(base_url: str) -> tuple[float, float] | None:
    """The server's prefix cache counters (hit, query tokens) from its ``/metrics``; None where it has
    none (another server, or a page that does not answer)."""
    from orca_lab.serving.metrics import parse_metrics
    try:
        resp = httpx.get(server_root(base_url) + "/metrics", timeout=30)
        m = parse_metrics(resp.text) if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return None
    return (m[PREFIX_COUNTERS[0]], m[PREFIX_COUNTERS[1]]) if all(k in m for k in PREFIX_COUNTERS) else None


def prefix_hit_rate(before, after) -> float:
    """Prompt tokens found cached over those looked up during the run; NaN when unknown or none."""
    if before is None or after is None or after[1] <= before[1]:
        return float("nan")
    return (after[0] - before[0]) / (after[1] - before[1])


def format_summary(row: dict, title: str) -> str:
    lines = [f"== {title} =="]
    for k in ("n_requests", "n_failed", "duration_s", "throughput_rps", "throughput_tok_s", "goodput_rps",
              "prefix_hit_rate"):
        if k in row:
            lines.append(f"{k:<28}{row[k]:>12,.2f}")
    lines.append(f"{'(ms)':<16}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for m in ("ttft", "tpot", "itl", "e2e", "norm_latency"):
        lines.append(f"{m:<16}" + "".join(f"{row[f'{m}_{s}_ms']:>10.2f}" for s in ("mean", "median", "p90", "p99")))
    return "\n".join(lines)


def add_arguments(p):
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, with or without /v1")
    p.add_argument("--n-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=float("inf"), help="Poisson arrivals, req/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson, <1 bursty")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--dataset", default="paper", choices=DATASETS,
                   help="paper: U{32..512} inputs, U{1..128} outputs (x --scale); fixed: --input-len/--output-len; "
                        "few-shot: a shared prefix of --input-len tokens and a question of 8-32 each")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the paper dataset's lengths")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=None, help="for servers that do not report it")
    p.add_argument("--sweep-rates", type=float, nargs="+", default=None, help="one run per rate: the curve")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results")


class DebugRun:
    """Pages of a server's ``GET /debug/run`` (``orca-lab serve --debug``): each ``fetch`` returns
    the records new since the previous one (the first: all the server keeps)."""

    def __init__(self, base_url: str):
        self.url, self.since = server_root(base_url) + "/debug/run", 0.0

    def fetch(self) -> dict:
        resp = httpx.get(self.url, params={"since": self.since}, timeout=60)
        resp.raise_for_status()
        data = resp.json()
        self.since = data["now"]
        return data


def fetch_run(base_url: str, data: dict | None = None):
    """The server's engine ``RunResult`` (``GET /debug/run``: all it keeps, or the page ``data``),
    iterations included: what ``orca_lab.viz.timeline_figure`` draws."""
    from orca_lab.engine.engine import IterationRecord, RequestRecord, RunResult
    data = data or DebugRun(base_url).fetch()
    lists = lambda d: {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return RunResult(data["system"], [RequestRecord(**lists(r)) for r in data["requests"]],
                     [IterationRecord(**lists(it)) for it in data["iterations"]], data["config"], data["duration"])


def server_records(base_url: str, completion_ids=None, level: str = "http", data: dict | None = None):
    """This server's own records (``GET /debug/run``: all it keeps, or the page ``data``) as a
    ``RunResult``, only the requests that served ``completion_ids`` if given. ``level="engine"``:
    the engine's per-request records (arrival at the endpoint to each token leaving the engine);
    ``"http"``: one record per completion, from its arrival at the app to its first token chunk and
    its last byte handed to the connection."""
    from orca_lab.engine.engine import RunResult
    check_choice("level", level, ("http", "engine"))
    data = data or DebugRun(base_url).fetch()
    cids = list(data["completions"]) if completion_ids is None else list(completion_ids)
    engine = {r.rid: r for r in fetch_run(base_url, data).requests}
    if level == "engine":
        reqs = [engine[rid] for c in cids for rid in data["completions"][c]["rids"]]
    else:
        reqs = [_http_record(data["completions"][c], engine) for c in cids]
    done = [r for r in reqs if r.t_finish is not None]
    duration = max((r.t_finish for r in done), default=0.0) - min((r.arrival for r in done), default=0.0)
    return RunResult(data["system"], reqs, [], data["config"], duration)


def _http_record(c: dict, engine: dict):
    """A completion's HTTP times over its (first) engine request's record."""
    first = engine[c["rids"][0]]
    n = sum(engine[rid].n_generated for rid in c["rids"])
    return dataclasses.replace(first, arrival=c["arrival"], t_first_token=c["first_token"], t_finish=c["finish"],
                               n_generated=n)
