"""What serving over HTTP costs: the server against the engine in this process, on the same work.

    python benchmarks/serving.py [--model tiny] [--device cpu] [--dtype float32] [--n-requests 256] [--scale 0.25] [--max-bs 16] [--repeats 2]
                                 [--light-rates 1 4] [--light-output 64] [--threads 1]
                                 [--out docs/results/serving_cpu.json]

1. Saturation: one paper-shaped trace, every request at time 0, served by ``LLM.serve`` in this
   process and by ``orca-lab serve`` (a child process, same model, seed and engine settings) driven
   by ``orca-lab bench``. Tokens/s of each, side by side, ``--repeats`` times alternating (goal: the
   server reaches >= 90% of the in-process engine), the server's from its own records, the
   client's beside it.
2. Light load: short fixed-length requests from one client one at a time, then at low Poisson
   rates. The inter-token latency the client sees against the engine's iteration time (goal:
   p99 <= 1.5x), two ways: the p99 ITL over the run's median iteration, and token by token, each
   gap over the iteration that made that token. On a shared CPU the second is the one that
   measures the server: the same fixed work, repeated in this process, has a p99 1.3-2.0x its
   median (``host_jitter``, recorded beside it), so the first reads the host's tail whatever the
   server does. Beside them: the p99 gap between the same tokens as the engine made them (what
   HTTP adds at the tail), and the same trace served in process (the iteration itself varies with
   the host, and with another request's prefill in its batch).
Both runs use one intra-op thread per process (``--threads``), recorded with the results. The
server runs with ``--debug``: its own records come from ``GET /debug/run``, a page of what is new
since the previous read after each run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import numpy as np
import torch

from orca_lab import LLM, EngineConfig
from orca_lab.results import write_report
from orca_lab.metrics import summarize
from orca_lab.serving.bench import DebugRun, make_trace, run_load, server_records
from orca_lab.serving.launch import ServerProcess


def saturation(args, llm, server, pages: DebugRun) -> list[dict]:
    """Tokens/s in process, and of the server as it served them (its own records: arrival at the
    app to the last byte handed to the connection) and as the client saw them; the client's figure
    also holds its own start-up (encoding and opening ``n_requests`` requests at once: ~0.2-0.3 s
    on 2 cores, before the first reaches the server)."""
    trace = make_trace("paper", args.n_requests, None, llm.cfg.vocab_size, args.seed, scale=args.scale)
    rows = []
    for rep in range(args.repeats):
        local = summarize(llm.serve(trace))["throughput_tok_s"]
        pages.fetch()                           # what came before this run: skipped
        run = asyncio.run(run_load(server.url, trace, args.model))
        assert run.n_failed == 0, [r.error for r in run.requests if r.error][:3]
        ids, data = [r.completion_id for r in run.requests], pages.fetch()
        tok_s = {level: summarize(server_records(server.url, ids, level, data))["throughput_tok_s"]
                 for level in ("http", "engine")}
        client = run.summary()["throughput_tok_s"]
        rows.append({"repeat": rep, "in_process_tok_s": local, "server_tok_s": tok_s["http"],
                     "server_engine_tok_s": tok_s["engine"], "client_tok_s": client,
                     "ratio": tok_s["http"] / local, "client_ratio": client / local})
    return rows


def iterations_by_rid(iterations: list[dict]) -> dict[int, list[dict]]:
    """Each request's last-stage iterations in order: the k-th made its k-th token (ORCA gives every
    request in a batch one token per iteration)."""
    last = max(it["stage"] for it in iterations)
    held: dict[int, list[dict]] = {}
    for it in iterations:
        if it["stage"] == last:
            for rid in it["rids"]:
                held.setdefault(rid, []).append(it)
    return held


def engine_token_gaps(iterations: list[dict]) -> np.ndarray:
    """Each request's gaps between consecutive tokens as the engine made them, its first (the
    prompt's) excluded as the client's ITL excludes it."""
    return np.concatenate([np.diff([it["end"] for it in its])
                           for its in iterations_by_rid(iterations).values() if len(its) > 1])


def itl_over_own_iteration(run, data: dict, iterations: list[dict]) -> np.ndarray:
    """Each gap the client saw over the span of the engine iteration that made that token: what
    serving adds, token by token, with the host's speed of that moment in both (on a shared CPU
    the same work can take up to twice as long from one moment to the next)."""
    held = iterations_by_rid(iterations)
    ratios = []
    for r in run.requests:
        its = held[data["completions"][r.completion_id]["rids"][0]]
        assert len(its) == len(r.itl) + 1, "one chunk per token"
        ratios += [gap / (it["end"] - it["start"]) for gap, it in zip(r.itl, its[1:])]
    return np.array(ratios)


def host_jitter(seconds_each: float, n: int = 400) -> float:
    """p99 over median time of one fixed piece of work (a matmul chain and a Python loop, about one
    iteration long) repeated ``n`` times in this process: the host's own tail, with no engine."""
    a, w = torch.randn(1, 256), torch.randn(256, 256)
    def work(k):
        for _ in range(k):
            (a @ w).sum()
            sum(range(200))
    k, t = 1, 0.0
    while t < seconds_each:                     # size the work to about one iteration
        k *= 2
        t0 = time.perf_counter(); work(k); t = time.perf_counter() - t0
    times = []
    for _ in range(n):
        t0 = time.perf_counter(); work(k); times.append(time.perf_counter() - t0)
    return float(np.percentile(times, 99) / np.median(times))


def light_load(args, llm, server, pages: DebugRun, rate: float | None) -> dict:
    """At ``rate`` req/s (Poisson), or with ``rate`` None one client sending its requests one after
    the other (no two requests share an iteration, so no prefill lengthens another's)."""
    trace = make_trace("fixed", args.light_requests, rate, llm.cfg.vocab_size, args.seed,
                       input_len=16, output_len=args.light_output)
    pages.fetch()                               # what came before this run: skipped
    run = asyncio.run(run_load(server.url, trace, args.model, max_concurrency=1 if rate is None else None))
    assert run.n_failed == 0
    data = pages.fetch()
    iters = data["iterations"]
    span = np.array([it["end"] - it["start"] for it in iters])
    itl, gaps = np.array(run.itl), engine_token_gaps(iters)
    own = itl_over_own_iteration(run, data, iters)
    p99 = lambda a: float(np.percentile(a, 99))
    # the same trace in this process: how much the engine's own iterations vary, with no server
    alone = [llm.serve(part).to_json()["iterations"] for part in ([trace] if rate else [[item] for item in trace])]
    alone_span = np.array([it["end"] - it["start"] for its in alone for it in its])
    alone_gaps = np.concatenate([engine_token_gaps(its) for its in alone])   # each run its own rids and clock
    return {"model": args.model, "rate": rate, "n_requests": args.light_requests,
            "output_len": args.light_output, "n_iterations": len(span),
            "itl_median_ms": float(np.median(itl) * 1e3), "itl_p99_ms": p99(itl) * 1e3,
            "iteration_median_ms": float(np.median(span) * 1e3), "iteration_p99_ms": p99(span) * 1e3,
            "engine_token_gap_p99_ms": p99(gaps) * 1e3,
            "in_process_iteration_median_ms": float(np.median(alone_span) * 1e3),
            "in_process_iteration_p99_ms": p99(alone_span) * 1e3,
            "in_process_token_gap_p99_ms": p99(alone_gaps) * 1e3,
            "p99_itl_over_median_iteration": p99(itl) / float(np.median(span)),
            "p99_itl_over_engine_p99_gap": p99(itl) / p99(gaps),
            "p99_itl_over_own_iteration": p99(own), "median_itl_over_own_iteration": float(np.median(own)),
            "host_p99_over_median": host_jitter(float(np.median(span)))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-requests", type=int, default=256, help="long enough (~4 s on tiny) that connection set-up does not count")
    p.add_argument("--scale", type=float, default=0.25, help="multiplies the paper's lengths")
    p.add_argument("--max-bs", type=int, default=16)
    p.add_argument("--n-slots", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--light-rates", type=float, nargs="+", default=[1.0, 4.0],
                   help="req/s: 1 keeps about one request in flight, 4 overlaps their prefills")
    p.add_argument("--light-requests", type=int, default=16)
    p.add_argument("--light-output", type=int, default=64)
    p.add_argument("--model", default="tiny", help="a preset (random weights of seed 0)")
    p.add_argument("--device", default="cpu", help="cpu or cuda: both sides run there")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="docs/results/serving_cpu.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = EngineConfig(max_bs=args.max_bs, n_slots=args.n_slots, device=args.device, dtype=args.dtype)
    llm = LLM(args.model, seed=0, engine=engine)
    flags = ["--model", args.model, "--max-bs", args.max_bs, "--n-slots", args.n_slots, "--threads", args.threads,
             "--device", args.device, "--dtype", args.dtype, "--debug"]
    load_before = os.getloadavg()      # a busy machine moves these figures by tens of percent
    with ServerProcess(*flags) as server:
        pages = DebugRun(server.url)
        sat = saturation(args, llm, server, pages)
        light = [light_load(args, llm, server, pages, rate) for rate in [None, *args.light_rates]]
    load = {"before": load_before, "after": os.getloadavg()}
    print("saturation (tokens/s, same trace, all requests at t=0):")
    print(f"{'repeat':>6}{'in-process':>12}{'server':>9}{'its engine':>12}{'client':>9}{'ratio':>8}{'client ratio':>14}")
    for r in sat:
        print(f"{r['repeat']:>6}{r['in_process_tok_s']:>12.1f}{r['server_tok_s']:>9.1f}{r['server_engine_tok_s']:>12.1f}"
              f"{r['client_tok_s']:>9.1f}{r['ratio']:>8.3f}{r['client_ratio']:>14.3f}")
    ratio = statistics.median(r["ratio"] for r in sat)
    print(f"median ratio {ratio:.3f} (goal >= 0.90); as the client saw it "
          f"{statistics.median(r['client_ratio'] for r in sat):.3f}")
    for ll in light:
        how = "one client, one request at a time" if ll["rate"] is None else f"{ll['rate']:g} req/s"
        print(f"\nlight load ({how}, 16-token prompts, {args.light_output} tokens each): p99 ITL "
              f"{ll['itl_p99_ms']:.2f} ms, engine iteration median {ll['iteration_median_ms']:.2f} ms "
              f"(p99 {ll['iteration_p99_ms']:.2f}): ratio {ll['p99_itl_over_median_iteration']:.2f} (goal <= 1.5)")
        print(f"  the same tokens' p99 gap as the engine made them: {ll['engine_token_gap_p99_ms']:.2f} ms; "
              f"the client's p99 ITL over it {ll['p99_itl_over_engine_p99_gap']:.2f} (what HTTP adds at the tail)")
        print(f"  the same trace in process, no server: iteration median {ll['in_process_iteration_median_ms']:.2f} ms, "
              f"p99 {ll['in_process_iteration_p99_ms']:.2f}; p99 token gap {ll['in_process_token_gap_p99_ms']:.2f} ms")
        print(f"  token by token, the client's gap over the iteration that made it: median "
              f"{ll['median_itl_over_own_iteration']:.2f}, p99 {ll['p99_itl_over_own_iteration']:.2f} (goal <= 1.5); "
              f"the host's own p99/median on fixed work of one iteration: {ll['host_p99_over_median']:.2f}")
    write_report(args.out, args, {"saturation": sat, "saturation_median_ratio": ratio, "light_load": light, "load_average_1_5_15min": load})


if __name__ == "__main__":
    main()
