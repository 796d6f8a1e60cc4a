"""How a scheduler's ``select`` scales with the requests waiting behind its batch (it should not).

    python benchmarks/select_scaling.py [--waiting 10 1000 100000] [--systems orca paged chunked ft]
                                        [--steps 50] [--out results/select_scaling.json]

For each system and queue length N: N requests wait (all at time 0, 24-token prompts, 150 tokens to
generate, so none finishes while measured) and a batch of ``max_bs`` runs. The engine loop runs on the
simulator's executor (a cost model, no GPT: only the scheduling is timed), warmed past the prompts,
then ``--steps`` steps are measured, the queue lengths side by side: ``select`` alone, the whole ``Engine.step`` (select, the batch's
return, the trace record) and ``Engine.stats()`` (what a server reads every iteration). Medians, in
microseconds. Flat: the largest N within 2x of the smallest, per column. "tight" runs paged and
chunked on a pool that makes them preempt while the queue waits.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from orca_lab import SamplingParams
from orca_lab.config import check_range, model_config, parsed_args
from orca_lab.engine.engine import Engine
from orca_lab.engine.policies import new_kv, new_scheduler
from orca_lab.results import write_report
from orca_lab.sim.cost import AnalyticalCost
from orca_lab.sim.executor import SimExecutor

CASES = {"orca": ("orca", 8192), "paged": ("paged", 8192), "chunked": ("chunked", 8192), "ft": ("ft", 8192),
         "paged-tight": ("paged", 256), "chunked-tight": ("chunked", 256)}
COLUMNS = ("select_us", "step_us", "stats_us")
SMOKE = {"waiting": [10, 1000], "steps": 5}


def engine_with(case: str, n_waiting: int, max_bs: int) -> Engine:
    system, n_slots = CASES[case]
    cfg = model_config("tiny")
    scheduler = new_scheduler(system, new_kv(system, n_slots, 16), max_bs, cfg.max_seq_len, None, 64)
    engine = Engine(scheduler, SimExecutor(AnalyticalCost(cfg)), cfg.vocab_size, cfg.max_seq_len)
    engine.add_requests([([1 + i % 7] * 24, SamplingParams(max_gen_tokens=150), 0.0)
                         for i in range(n_waiting + max_bs)])
    return engine


def measure(case: str, queue_lengths: list[int], max_bs: int, steps: int) -> list[dict]:
    """One engine per queue length, measured side by side: step k of each in turn (the order
    rotating), so a slow spell of the machine falls on every queue length alike."""
    engines = [engine_with(case, n, max_bs) for n in queue_lengths]
    times = [{c: [] for c in COLUMNS} for _ in engines]
    for engine, got in zip(engines, times):
        for _ in range(40):                 # past the prompts (and, tight, into preemption)
            engine.step()
        engine.scheduler.select = _timed(engine.scheduler.select, got["select_us"])
    for k in range(steps):
        for i in (k + j for j in range(len(engines))):
            engine, got = engines[i % len(engines)], times[i % len(engines)]
            t = time.perf_counter()
            engine.step()
            got["step_us"].append(time.perf_counter() - t)
            t = time.perf_counter()
            engine.stats()
            got["stats_us"].append(time.perf_counter() - t)
    return [{"case": case, "waiting": e.stats().waiting, **{c: 1e6 * statistics.median(got[c]) for c in COLUMNS},
             "preemptions": getattr(e.scheduler, "n_preemptions", 0)} for e, got in zip(engines, times)]


def _timed(select, spent: list):
    def timed(now=0.0):
        t = time.perf_counter()
        try:
            return select(now)
        finally:
            spent.append(time.perf_counter() - t)
    return timed


def check_args(args):
    """Every number where it enters: out of range, a ValueError names the flag, its value and the
    allowed range (check_range's words): exit 2 (``parsed_args``). No batch (--max-bs 0) schedules
    nothing; no step has no median."""
    for n in args.waiting:
        check_range("--waiting", n, 0, 10_000_000)
    check_range("--max-bs", args.max_bs, 1, 65536)      # EngineConfig's bound
    check_range("--steps", args.steps, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waiting", type=int, nargs="+", default=[10, 1000, 100_000])
    p.add_argument("--systems", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--max-bs", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--smoke", action="store_true", help="10 and 1,000 waiting, 5 steps, unless given")
    p.add_argument("--out", default="results/select_scaling.json")
    args = parsed_args(p, argv, check_args, SMOKE)    # --smoke: the toy size for what was not given
    rows = [row for case in args.systems for row in measure(case, args.waiting, args.max_bs, args.steps)]
    print(f"median of {args.steps} steps, max_bs={args.max_bs}, microseconds")
    print(f"{'system':>14s} {'waiting':>8s} " + " ".join(f"{c:>10s}" for c in COLUMNS) + f" {'preempted':>10s}")
    for r in rows:
        print(f"{r['case']:>14s} {r['waiting']:8d} " + " ".join(f"{r[c]:10.1f}" for c in COLUMNS)
              + f" {r['preemptions']:10d}")
    flat = {}
    for case in args.systems:
        mine = [r for r in rows if r["case"] == case]
        flat[case] = {c: max(r[c] for r in mine) / min(r[c] for r in mine) for c in COLUMNS}
    print("largest / smallest over the queue lengths (flat: <= 2): " + "; ".join(
        f"{case} " + ", ".join(f"{c.removesuffix('_us')} {v:.2f}" for c, v in f.items()) for case, f in flat.items()))
    write_report(args.out, args, {"rows": rows, "max_over_min": flat})
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
