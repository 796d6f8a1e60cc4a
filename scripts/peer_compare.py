"""One table from runs of `orca-lab bench`, AIPerf and GuideLLM against the same server: each tool's
own figures, and the same figures recomputed from its per-request records with `orca-lab bench`'s
definitions (TTFT: send to the first token chunk, empty text or not; ITL: every gap between token
chunks; TPOT: (last byte - first token chunk) / (tokens - 1); e2e: send to last byte; tok/s: tokens
over first send .. last byte).

    python scripts/peer_compare.py [--server URL] RUN_DIR...   # each: bench.json, aiperf/ or guidellm.json

With ``--server`` (an `orca-lab serve --debug` that served the runs), each run also gets the server's own
times of the same completions (``GET /debug/run``: arrival at the app, first token chunk out, last
byte out): ``srv_ttft_p50``/``srv_e2e_p50`` are their medians, ``+ttft``/``+e2e`` the medians of client minus
server per completion, what the client adds to what the server did.

AIPerf's and GuideLLM's own TTFT start at the first chunk with non-empty text, and their ITL is a
per-request mean, (end - that chunk) / (tokens - 1) for AIPerf, (last text chunk - first text chunk)
/ (tokens - 1) for GuideLLM. GuideLLM keeps no per-chunk times, so its pooled ITL is left out.
"""
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

COLS = ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "tpot_p50", "e2e_p50", "tok_s")
SRV_COLS = ("srv_ttft_p50", "srv_e2e_p50", "+ttft", "+e2e")


class Req(NamedTuple):
    """One request as a client saw it, in seconds on the client's clock."""
    start: float            # sent
    first: float            # first token chunk (empty text or not)
    end: float              # last byte
    n: int                  # tokens generated (the server's usage)
    gaps: list | None       # between token chunks, where the tool keeps them
    cid: str                # completion id


def pct(values, q):
    return float(np.percentile(values, q)) if len(values) else float("nan")


def common(reqs: list[Req]) -> dict:
    ttft = [r.first - r.start for r in reqs]
    tpot = [(r.end - r.first) / (r.n - 1) for r in reqs]
    gaps = [g for r in reqs if r.gaps is not None for g in r.gaps]
    span = max(r.end for r in reqs) - min(r.start for r in reqs)
    ms = 1e3
    return {"ttft_p50": pct(ttft, 50) * ms, "ttft_p90": pct(ttft, 90) * ms, "itl_p50": pct(gaps, 50) * ms,
            "itl_p90": pct(gaps, 90) * ms, "tpot_p50": pct(tpot, 50) * ms,
            "e2e_p50": pct([r.end - r.start for r in reqs], 50) * ms, "tok_s": sum(r.n for r in reqs) / span}


def versus_server(reqs: list[Req], completions: dict) -> dict:
    """The server's own times of these completions, and the client's excess over them."""
    srv = [completions[r.cid] for r in reqs]
    s_ttft = [c["first_token"] - c["arrival"] for c in srv]
    s_e2e = [c["finish"] - c["arrival"] for c in srv]
    return {"srv_ttft_p50": pct(s_ttft, 50) * 1e3, "srv_e2e_p50": pct(s_e2e, 50) * 1e3,
            "+ttft": pct([r.first - r.start - t for r, t in zip(reqs, s_ttft)], 50) * 1e3,
            "+e2e": pct([r.end - r.start - t for r, t in zip(reqs, s_e2e)], 50) * 1e3}


def bench(d: Path):
    rep = json.loads((d / "bench.json").read_text())
    s = rep["summary"][0]
    own = {"ttft_p50": s["ttft_median_ms"], "ttft_p90": s["ttft_p90_ms"], "itl_p50": s["itl_median_ms"],
           "itl_p90": s["itl_p90_ms"], "tpot_p50": s["tpot_median_ms"], "e2e_p50": s["e2e_median_ms"],
           "tok_s": s["throughput_tok_s"]}
    reqs = [Req(r["arrival"], r["t_first_token"], r["t_finish"], r["n_generated"], r["itl"], r["completion_id"])
            for r in rep["requests"][0]]
    return own, reqs, None                         # bench keeps no text: unknown


def aiperf(d: Path):
    a = d / "aiperf"
    s = json.loads((a / "profile_export_aiperf.json").read_text())
    own = {"ttft_p50": s["time_to_first_token"]["p50"], "ttft_p90": s["time_to_first_token"]["p90"],
           "itl_p50": s["inter_token_latency"]["p50"], "itl_p90": s["inter_token_latency"]["p90"],
           "tpot_p50": float("nan"), "e2e_p50": s["request_latency"]["p50"],
           "tok_s": s["output_token_throughput"]["avg"]}
    reqs, late = [], 0
    for line in (a / "profile_export_raw.jsonl").read_text().splitlines():
        r = json.loads(line)
        m, t0 = r["metadata"], r["start_perf_ns"]
        chunks, n, cid = [], 0, None               # (time, has text) of each token chunk
        for resp in r["responses"]:
            for p in resp["packets"]:
                if p["name"] != "data" or p["value"].strip() == "[DONE]":
                    continue
                c = json.loads(p["value"])
                cid = c["id"]
                if c.get("choices"):
                    chunks.append(((resp["perf_ns"] - t0) / 1e9, bool(c["choices"][0]["text"])))
                if c.get("usage"):
                    n = c["usage"]["completion_tokens"]
        times = [t for t, _ in chunks]
        late += not chunks[0][1]                   # the first token chunk carried no text
        start = m["request_start_ns"] / 1e9       # wall clock, taken with start_perf_ns
        reqs.append(Req(start, start + times[0], m["request_end_ns"] / 1e9, n, list(np.diff(times)), cid))
    return own, reqs, late


def guidellm(d: Path):
    b = json.loads((d / "guidellm.json").read_text())["benchmarks"][0]
    m = b["metrics"]
    g = lambda k, q: m[k]["successful"]["percentiles"][q]
    own = {"ttft_p50": g("time_to_first_token_ms", "p50"), "ttft_p90": g("time_to_first_token_ms", "p90"),
           "itl_p50": g("inter_token_latency_ms", "p50"), "itl_p90": g("inter_token_latency_ms", "p90"),
           "tpot_p50": float("nan"), "e2e_p50": g("request_latency", "p50") * 1e3,
           "tok_s": m["output_tokens_per_second"]["successful"]["mean"]}
    reqs, late = [], 0
    for r in b["requests"]["successful"]:
        t = r["info"]["timings"]
        # the server's first event is a token chunk: first_request_iteration is bench's first token
        late += t["first_token_iteration"] > t["first_request_iteration"]
        reqs.append(Req(t["request_start"], t["first_request_iteration"], t["request_end"],
                     r["output_metrics"]["text_tokens"], None, r["response_id"]))
    return own, reqs, late


def rows(d: Path):
    kind = "bench" if (d / "bench.json").exists() else "aiperf" if (d / "aiperf").exists() else "guidellm"
    own, reqs, late = {"bench": bench, "aiperf": aiperf, "guidellm": guidellm}[kind](d)
    return kind, own, reqs, late


def main(argv):
    completions = None
    if argv[:1] == ["--server"]:
        from orca_lab.serving.bench import DebugRun
        completions = DebugRun(argv[1]).fetch()["completions"]
        argv = argv[2:]
    cols = COLS + (SRV_COLS if completions else ())
    fmt = lambda row: " | ".join("-" if row.get(c, math.nan) != row.get(c, math.nan) else f"{row[c]:,.1f}"
                                 for c in cols)
    print("| run | tool | figures | n | first chunk empty | " + " | ".join(cols) + " |")
    print("|---|---|---|---:|---:|" + "---:|" * len(cols))
    for d in map(Path, argv):
        kind, own, reqs, late = rows(d)
        com = common(reqs) | (versus_server(reqs, completions) if completions else {})
        late = "-" if late is None else late
        if kind == "bench":
            print(f"| {d.name} | {kind} | own | {len(reqs)} | {late} | {fmt(own | com)} |")
        else:
            print(f"| {d.name} | {kind} | own | {len(reqs)} | {late} | {fmt(own)} |")
            print(f"| {d.name} | {kind} | bench's definitions | {len(reqs)} | {late} | {fmt(com)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
