"""Pipeline bubbles: ORCA's in-flight batches keep every stage busy; ``ft(max_bs, mbs)`` leaves gaps.

    OMP_NUM_THREADS=1 python benchmarks/pipeline.py [--model tiny --layers 8 --d-model 512] [--pp 2]
                        [--tp 1] [--max-bs 8] [--mbs 8 4] [--n-requests 16] [--out results/pipeline.json]

Real worker processes on this machine (gloo on CPU, one torch thread each): ``--pp`` stages x ``--tp``
tensor ranks serve one offline trace (every request at time 0, paper-shaped lengths times
``--scale``) with ``orca(max_bs)`` (ORCA §4.2: the scheduler keeps ``n_workers = pp`` batches in flight)
and with ``ft(max_bs, mbs)`` for each ``--mbs`` (a request-level batch split into micro-batches that
follow one another through the stages). ``orca, 1 stage`` runs the same model in one worker as a
reference. Per stage, utilisation = busy time / span of the run, read from ``RunResult.iterations``
(each stage's start and end, stamped by the workers); throughput = completed requests / duration.
The default model is the byte-level ``tiny`` preset widened to 8 layers of 512: equal stages (GPT-2's
50257-row LM head would double the last stage's work) and iterations long enough (~10 ms) that the
engine's own overhead does not hide the pipeline. The table is printed; the rows, the hardware and
the versions go to ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses

from orca_lab import LLM, EngineConfig
from orca_lab.config import model_config
from orca_lab.distributed.pool import WorkerPool
from orca_lab.results import write_report
from orca_lab.metrics import summarize
from orca_lab.viz.timeline import busy_fraction
from orca_lab.workload import paper_trace


def run(llm, trace, label, system, mbs=None) -> dict:
    llm.serve(trace[:llm.engine_config.max_bs], system=system, mbs=mbs)   # warm-up: this system's shapes
    result = llm.serve(trace, system=system, mbs=mbs)
    busy = busy_fraction(result)
    s = summarize(result)
    return {"run": label, "system": system, "stages": len(busy), "tp": llm.engine_config.tensor_parallel,
            "mbs": mbs, "throughput_rps": s["throughput_rps"], "throughput_tok_s": s["throughput_tok_s"],
            "norm_latency_median_ms": s["norm_latency_median_ms"], "n_iterations": s["n_iterations"],
            "max_in_flight": max(it.in_flight for it in result.iterations),
            "stage_utilisation": busy, "mean_utilisation": sum(busy) / len(busy)}


def engine_for(model, args, pp: int) -> LLM:
    ec = EngineConfig(max_bs=args.max_bs, n_slots=args.n_slots, executor="workers",
                      tensor_parallel=args.tp, pipeline_parallel=pp)
    return LLM(gpt=model, engine=ec)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a preset, reshaped by --layers / --d-model")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-bs", type=int, default=8)
    p.add_argument("--mbs", type=int, nargs="+", default=[8, 4])
    p.add_argument("--n-requests", type=int, default=16)
    p.add_argument("--scale", type=float, default=0.25, help="multiplies the paper's lengths")
    p.add_argument("--n-slots", type=int, default=16384)
    p.add_argument("--out", default="results/pipeline.json")
    args = p.parse_args(argv)
    cfg = model_config(args.model)
    cfg = dataclasses.replace(cfg, name=f"{cfg.name}-{args.layers}x{args.d_model}", n_layers=args.layers,
                              d_model=args.d_model)
    model = LLM(cfg, seed=args.seed).model
    trace = paper_trace(args.n_requests, rate=None, seed=args.seed, scale=args.scale,
                        vocab_size=model.cfg.vocab_size)
    rows = []
    for pp in ([1] if args.pp > 1 else []) + [args.pp]:
        llm = engine_for(model, args, pp)
        with WorkerPool(llm):
            if pp == 1:
                rows.append(run(llm, trace, f"orca({args.max_bs}), 1 stage", "orca"))
                continue
            rows.append(run(llm, trace, f"orca({args.max_bs})", "orca"))
            rows += [run(llm, trace, f"ft({args.max_bs},{mbs})", "ft", mbs) for mbs in args.mbs]
    print_table(rows, args)
    write_report(args.out, args, {"rows": rows})


def print_table(rows, args):
    print(f"\nmodel {args.model} ({args.layers} layers x {args.d_model}), {args.n_requests} requests at t=0 (lengths x{args.scale}), "
          f"tp={args.tp}, one torch thread per worker")
    head = f"{'run':<22}{'stages':>7}{'in flight':>10}{'req/s':>8}{'tok/s':>9}{'ms/token':>10}  utilisation per stage"
    print(head + "\n" + "-" * (len(head) + 10))
    for r in rows:
        util = " ".join(f"{u:5.0%}" for u in r["stage_utilisation"])
        print(f"{r['run']:<22}{r['stages']:>7}{r['max_in_flight']:>10}{r['throughput_rps']:>8.2f}"
              f"{r['throughput_tok_s']:>9.1f}{r['norm_latency_median_ms']:>10.1f}  {util}  (mean {r['mean_utilisation']:.0%})")


if __name__ == "__main__":
    main()
