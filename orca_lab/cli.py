"""``orca-lab``: the workbench's command line. ``orca-lab compare`` is the main job."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from orca_lab.config import PRESETS, EngineConfig, check_range
from orca_lab.environment import environment


def compare(args) -> dict:
    """Serve one paper-shaped trace with ORCA and with the request-level baseline; same model."""
    from orca_lab.llm import LLM
    from orca_lab.metrics import compare_table
    from orca_lab.viz import compare_figure, export
    from orca_lab.workload import paper_trace

    import torch
    torch.set_num_threads(args.threads)   # this process is ours; small ops stall with 2+ threads on a busy CPU
    engine = EngineConfig(max_bs=args.max_bs, n_slots=args.n_slots)
    llm = LLM(args.model, seed=args.seed, engine=engine)
    trace = paper_trace(args.n_requests, rate=args.rate, seed=args.seed, scale=args.scale,
                        vocab_size=llm.cfg.vocab_size)
    print(f"model {args.model}, {args.n_requests} requests at {args.rate} req/s (lengths x{args.scale}), "
          f"max_bs {args.max_bs}, n_slots {args.n_slots}", file=sys.stderr)
    results = [llm.serve(trace, system=s, progress=True) for s in ("orca", "ft")]
    table = compare_table(results)
    cols = ["throughput_rps", "throughput_tok_s", "median_norm_latency_ms", "median_ttft_ms",
            "p90_norm_latency_ms", "tokens_per_iteration", "n_iterations"]
    print(table[cols].to_string(float_format=lambda v: f"{v:,.2f}"))
    ratio = table.loc["orca", "throughput_rps"] / table.loc["ft", "throughput_rps"]
    print(f"\nORCA / baseline throughput: {ratio:.2f}x; median normalized latency "
          f"{table.loc['orca', 'median_norm_latency_ms']:.1f} vs {table.loc['ft', 'median_norm_latency_ms']:.1f} ms/token")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "environment": environment(), "summary": table.reset_index().to_dict("records"),
              "runs": [r.to_json() for r in results]}
    (out / "compare.json").write_text(json.dumps(report, indent=1, default=str))
    export(compare_figure(results), out / "compare.html")
    print(f"wrote {out / 'compare.json'} and {out / 'compare.html'}")
    return report


def serve(args):
    """``orca-lab serve``: the OpenAI-compatible endpoint (orca_lab.serving.server)."""
    import torch
    from orca_lab.llm import LLM
    from orca_lab.serving.server import serve as run
    check_range("max_queue", args.max_queue, 1, 1 << 20)
    check_range("drain_s", args.drain_s, 0.0, 3600.0, kind=float)
    torch.set_num_threads(args.threads)
    engine = EngineConfig(max_bs=args.max_bs, n_slots=args.n_slots, tensor_parallel=args.tp,
                          pipeline_parallel=args.pp, device=args.device, dtype=args.dtype)
    if Path(args.model).is_dir():
        llm = LLM.from_pretrained(args.model, engine=engine)
    else:
        llm = LLM(args.model, seed=args.seed, engine=engine)
    run(llm, args.system, args.host, args.port, args.max_queue, args.drain_s, model_name=args.model)


def bench(args) -> dict:
    """``orca-lab bench``: the load generator (orca_lab.serving.bench)."""
    from orca_lab.serving.bench import run
    return run(args)


def main(argv=None):
    p = argparse.ArgumentParser(prog="orca-lab", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="ORCA vs the request-level baseline on one trace")
    c.add_argument("--model", default="tiny", choices=list(PRESETS))
    c.add_argument("--n-requests", type=int, default=64)
    c.add_argument("--rate", type=float, default=12.0, help="Poisson arrival rate, req/s")
    c.add_argument("--scale", type=float, default=0.5, help="multiplies the paper's lengths")
    c.add_argument("--max-bs", type=int, default=16)
    c.add_argument("--n-slots", type=int, default=16384)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--threads", type=int, default=1, help="torch intra-op threads (recorded)")
    c.add_argument("--out", default="results")
    _serve_args(sub.add_parser("serve", help="an OpenAI-compatible completions server over the engine"))
    from orca_lab.serving.bench import add_arguments
    add_arguments(sub.add_parser("bench", help="load generator for any OpenAI-compatible completions endpoint"))
    args = p.parse_args(argv)
    try:
        {"compare": compare, "serve": serve, "bench": bench}[args.cmd](args)
    except ValueError as e:       # bad input: a clear message, no traceback
        p.exit(2, f"orca-lab: error: {e}\n")


def _serve_args(s):
    s.add_argument("--model", default="tiny", help=f"a preset ({', '.join(PRESETS)}) or a checkpoint directory")
    s.add_argument("--seed", type=int, default=0, help="random weights of a preset: those of LLM(model, seed)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0: the OS chooses (printed at start)")
    s.add_argument("--system", default="orca", choices=["orca", "ft"])
    s.add_argument("--max-bs", type=int, default=32)
    s.add_argument("--n-slots", type=int, default=16384)
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel workers")
    s.add_argument("--pp", type=int, default=1, help="pipeline-parallel workers (the paper's n_workers)")
    s.add_argument("--max-queue", type=int, default=1024, help="waiting requests before 503")
    s.add_argument("--drain-s", type=float, default=5.0, help="on SIGINT/SIGTERM, time left to requests in flight")
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--threads", type=int, default=1, help="torch intra-op threads")


if __name__ == "__main__":
    main()
