"""``orca-lab``: the workbench's command line. ``orca-lab compare`` is the main job."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from orca_lab.config import PRESETS, EngineConfig
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
    args = p.parse_args(argv)
    try:
        {"compare": compare}[args.cmd](args)
    except ValueError as e:       # bad input: a clear message, no traceback
        p.exit(2, f"orca-lab: error: {e}\n")


if __name__ == "__main__":
    main()
