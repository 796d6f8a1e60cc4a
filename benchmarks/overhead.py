"""Where one iteration of the ORCA engine goes: select, batch metadata, forward, sampling, bookkeeping.

    python benchmarks/overhead.py [--preset tiny] [--batch-sizes 1 8 32 64] [--threads 1]
                                  [--out results/overhead.json]

For each batch size B: B paper-shaped prompts are prefilled in one iteration, then ``--iters``
increment-phase iterations (one new token per request) run through ``Engine.step`` with a timer
around each part of it. The parts are timed where the engine calls them, so the sum is the engine's
real work; "bookkeeping" is the rest of the step (Algorithm 1's loop, ``on_batch_return``, the trace record).
The bare model forward on the same flat batch (metadata built beforehand) is timed alone next to it.
Engine overhead = everything but the model forward, as a share of the iteration.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from orca_lab import LLM, EngineConfig, SamplingParams
from orca_lab.config import check_range, parsed_args
from orca_lab.engine.batch import Batch
from orca_lab.results import write_report
from orca_lab.model import executor as executor_mod
from orca_lab.model import gpt as model_mod
from orca_lab.workload import paper_trace

PARTS = ("select", "metadata", "forward", "sampling", "bookkeeping")
SMOKE = {"batch_sizes": [1, 4], "iters": 3, "scale": 0.05}


class Timers:
    """Seconds spent in each wrapped function during the current step. On a GPU a part returns once
    its kernels are queued, and its time would show up in whichever later part waits for them (the
    sampler's read-back): ``sync`` (``torch.cuda.synchronize``) is called on both sides of every
    part, so each part is charged its own GPU time. That serializes host and GPU, as a profiler does;
    the step's unsynchronized time is ``bare_forward``'s and the engine benchmarks' business."""
    def __init__(self, sync=lambda: None):
        self.now, self.sync = defaultdict(float), sync

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            self.sync()
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.now[name] += time.perf_counter() - t
        return timed


@contextmanager
def instrumented(engine, timers: Timers):
    """Timers around the engine's parts, where it calls them; everything restored afterwards."""
    model, sched = engine.executor.model, engine.scheduler
    patches = [(sched, "select"), (Batch, "tensors"), (model_mod, "_plan"), (executor_mod, "sample"),
               (model, "embed"), (model, "run_layers"), (model, "head")]
    names = {"select": "select", "tensors": "metadata", "_plan": "plan", "sample": "sampling",
             "embed": "model", "run_layers": "model", "head": "model"}
    saved = [(obj, attr, obj.__dict__.get(attr, None), attr in obj.__dict__) for obj, attr in patches]
    for obj, attr in patches:
        setattr(obj, attr, timers.wrap(names[attr], getattr(obj, attr)))
    try:
        yield
    finally:
        for obj, attr, old, had in saved:
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)


def measure(llm, batch_size: int, iters: int, scale: float, seed: int) -> dict:
    engine = llm.new_engine("orca")
    trace = paper_trace(batch_size, rate=None, seed=seed, scale=scale, vocab_size=llm.cfg.vocab_size)
    for it in trace:      # long enough that no request finishes while it is measured
        engine.add_request(list(it.prompt), SamplingParams(max_gen_tokens=iters + 4))
    engine.step()         # the initiation phase of every request
    engine.step()         # one increment, untimed: first-call costs out of the way
    on_gpu = torch.device(llm.engine_config.device).type == "cuda"
    timers, rows = Timers(torch.cuda.synchronize if on_gpu else (lambda: None)), []
    with instrumented(engine, timers):
        for _ in range(iters):
            timers.now.clear()
            t = time.perf_counter()
            returned = engine.step()
            step = time.perf_counter() - t
            assert len(returned) == batch_size, "every request must run in every measured iteration"
            rows.append(split(timers.now, step))
    bare = bare_forward(engine, iters)
    engine.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    ctx = [r.context_len for r in engine.requests]
    return {"batch_size": batch_size, "mean_context": sum(ctx) / len(ctx),
            **{f"{k}_ms": 1e3 * v for k, v in med.items()}, "bare_forward_ms": 1e3 * bare,
            "overhead_pct": 100 * statistics.median((r["step"] - r["forward"]) / r["step"] for r in rows)}


def split(now, step) -> dict:
    """The step cut into PARTS; the attention plan is metadata, built lazily inside the forward."""
    forward = now["model"] - now["plan"]
    parts = {"select": now["select"], "metadata": now["metadata"] + now["plan"], "forward": forward,
             "sampling": now["sampling"]}
    parts["bookkeeping"] = step - sum(parts.values())
    return {"step": step, **parts}


def bare_forward(engine, iters: int) -> float:
    """The model alone on a flat decode batch of the same requests, its metadata built beforehand."""
    batch = Batch.selective([r for r in engine.requests if not r.finished])
    model, kv = engine.executor.model, engine.scheduler.kv
    bt = batch.tensors(engine.executor.device)
    times = []
    sync = torch.cuda.synchronize if bt.input_ids.is_cuda else (lambda: None)   # clocks read after the GPU
    with torch.inference_mode():
        model(bt, kv)     # builds the attention plan once, as the first layer of a step does
        for _ in range(iters):
            sync()
            t = time.perf_counter()
            model(bt, kv)
            sync()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def print_table(rows):
    cols = ["step", *PARTS]
    print(f"{'B':>4s} {'ctx':>6s} " + " ".join(f"{c + ' ms':>14s}" for c in cols)
          + f" {'bare fwd ms':>12s} {'overhead':>9s}")
    for r in rows:
        print(f"{r['batch_size']:4d} {r['mean_context']:6.0f} " + " ".join(f"{r[c + '_ms']:14.3f}" for c in cols)
              + f" {r['bare_forward_ms']:12.3f} {r['overhead_pct']:8.1f}%")


def check_args(args):
    """Every number where it enters: out of range, a ValueError names the flag, its value and the
    allowed range (check_range's words): exit 2 (``parsed_args``), before a model is built."""
    for b in args.batch_sizes:
        check_range("--batch-sizes", b, 1, 65536)             # EngineConfig's max_bs
    check_range("--iters", args.iters, 1)                      # no iteration has no median
    check_range("--scale", args.scale, 1e-3, 1000.0, kind=float)   # paper_trace's bound
    check_range("--seed", args.seed, 0)
    check_range("--threads", args.threads, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--scale", type=float, default=0.25, help="the paper's lengths x scale")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--smoke", action="store_true", help="batch sizes 1 and 4, 3 iterations, scale 0.05, unless given")
    p.add_argument("--out", default="results/overhead.json")
    args = parsed_args(p, argv, check_args, SMOKE)    # --smoke: the toy size for what was not given
    torch.set_num_threads(args.threads)
    llm = LLM(args.preset, seed=args.seed, engine=EngineConfig(max_bs=max(args.batch_sizes), n_slots=65536))
    print(f"ORCA engine, {args.preset}, increment phase, {torch.get_num_threads()} thread(s); median of "
          f"{args.iters} iterations")
    rows = [measure(llm, b, args.iters, args.scale, args.seed) for b in args.batch_sizes]
    print_table(rows)
    write_report(args.out, args, {"rows": rows})
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
