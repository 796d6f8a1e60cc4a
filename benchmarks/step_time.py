"""Where a step's time goes, for ORCA and for the FasterTransformer-style baseline, at Figure 9's points.

    python benchmarks/step_time.py [--preset tiny] [--device cpu] [--dtype float32] [--threads 1]
                                   [--batch-sizes 1 2 4 8 16 32] [--input 32] [--output 32]
                                   [--graphs on|off] [--out results/step_time.json]

For each batch size B, B requests of ``--input`` prompt tokens each generate ``--output`` tokens under
``orca(max_bs=B)`` and under ``ft(max_bs=B, mbs=B)`` (Figure 9: one device, no pipeline), after an
untimed copy of the same shape two tokens long (the first calls' costs, and on a GPU the capture of
the decode graphs, stay out). Both run 1 prefill step and ``output - 1`` one-token steps. Per step:

- **host**: from the step's start (``select``) to the forward's last launch, when the sampler is handed
  the logits: the Python and launch cost a CUDA graph removes. On the CPU ops run as they are called,
  so host time there includes the forward's compute.
- **device**: the executor's stage clock around the forward and the sampler: CUDA events on a GPU (the
  gaps between launches included: a launch-bound step shows device close to host); the wall clock on
  the CPU, where it is the same time as host's forward plus the sampler.
- **launches**: on a GPU, the host's kernel-launch calls (torch.profiler: ``cudaLaunchKernel`` and the
  like, and ``cudaGraphLaunch``: a replayed graph is one); the CPU launches nothing: n/a there. **ops**:
  aten operators dispatched (a TorchDispatchMode; a replayed graph dispatches none; Triton kernels are
  not aten ops), on both.
- **graph**: whether the step ran through the decode graphs: replayed on a GPU; on the CPU, where
  graphs do not exist, their static-buffer forward run eagerly (as the tests run it), so the count is
  the same as a GPU's.

The two systems' steps alternate (each on its own K/V pool over the same weights), so a busy host
slows both alike. Times and counts are taken in two passes (counting would slow the timed one); the
runs are greedy and seeded, so both passes run the same steps. The table shows each system's median
over its one-token steps and FT/ORCA (for times, the median of each FT step over the ORCA step just
before it); the JSON has the prefill step and the whole run too.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from orca_lab import LLM, EngineConfig, SamplingParams
from orca_lab.config import check_range, model_config, parsed_args
from orca_lab.model import executor as executor_mod
from orca_lab.model.cuda_graphs import DecodeGraphs
from orca_lab.results import write_report

SYSTEMS = ("orca", "ft")
SMOKE = {"batch_sizes": [1, 3], "input": 8, "output": 4}
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cuGraphLaunch")


class CountOps(TorchDispatchMode):
    """aten operators dispatched: each runs at least one kernel (none inside a replayed graph)."""
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(on_gpu: bool):
    """``{"ops", "launches"}`` of what runs inside; launches None on the CPU (it launches nothing)."""
    counts = {"ops": 0, "launches": None}
    prof = None
    if on_gpu:
        from torch.profiler import ProfilerActivity, profile
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    with prof if prof is not None else nullcontext(), CountOps() as ops:
        yield counts
    counts["ops"] = ops.n
    if prof is not None:
        counts["launches"] = sum(e.name in LAUNCH_CALLS for e in prof.events())


class Stepper:
    """One system serving ``prompts`` (all at time 0), stepped one batch at a time: a row per step
    with its host time (until the sampler is handed the logits: the forward's last launch), device
    time (the engine's trace), whether the decode graphs ran it, and its counts with ``count``."""
    def __init__(self, llm, system: str, prompts, output: int, graphs: bool, count: bool = False):
        self.engine = engine = llm.new_engine(system, len(prompts) if system == "ft" else None)
        kv = engine.scheduler.kv
        if graphs and engine.executor.graphs is None and kv.k is not None and not kv.k.is_cuda:
            # the CPU has no CUDA graphs: their static-buffer forward, eagerly, as the tests run it
            engine.executor.graphs = DecodeGraphs(llm.model, kv, llm.engine_config.max_bs, capture=False)
        self.graphs, self.count = engine.executor.graphs, count
        self.on_gpu = engine.executor.device.type == "cuda"
        self.reqs = [engine.add_request(p, SamplingParams(max_gen_tokens=output, ignore_eos=True)) for p in prompts]
        self.rows, self.launched, self.graph = [], None, False
        if self.graphs is not None:
            real_run = self.graphs.run

            def run(batch):
                logits = real_run(batch)
                self.graph = logits is not None
                return logits
            self.graphs.run = run

    def _sampled(self, logits, batch):
        self.launched = time.perf_counter()
        return self._sample(logits, batch)

    def step(self) -> bool:
        """Engine steps until one ran a batch (FT's batch end only delivers); False when done."""
        engine = self.engine
        while engine.has_work():
            self.launched, self.graph, n_records = None, False, len(engine.records)
            self._sample, executor_mod.sample = executor_mod.sample, self._sampled
            try:
                with counting(self.on_gpu) if self.count else nullcontext({}) as counts:
                    t0 = time.perf_counter()
                    engine.step()
                    t1 = time.perf_counter()
            finally:
                executor_mod.sample = self._sample
            new = engine.records[n_records:]
            if new:
                self.rows.append({"phase": "decode" if all(q == 1 for q in new[0].q_lens) else "prefill",
                                  "host_ms": 1e3 * ((self.launched or t1) - t0),
                                  "device_ms": 1e3 * sum(r.end - r.start for r in new),
                                  "wall_ms": 1e3 * (t1 - t0), "graph": self.graph, **counts})
                return True
        return False

    def close(self) -> list[list[int]]:
        """Each request's tokens; the engine closed, the graphs unwrapped."""
        if self.graphs is not None:
            vars(self.graphs).pop("run", None)
        self.engine.close()
        return [list(r.output) for r in self.reqs]


def side_by_side(llms: dict, prompts, output: int, graphs: bool, count: bool = False):
    """Both systems' steps, alternating (ORCA's first step, FT's first, ORCA's second, ...): a busy
    host slows both alike. ``{system: rows}`` and ``{system: tokens}``."""
    steppers = {s: Stepper(llm, s, prompts, output, graphs, count) for s, llm in llms.items()}
    try:
        while any([st.step() for st in steppers.values()]):
            pass
    finally:
        tokens = {s: st.close() for s, st in steppers.items()}
    return {s: st.rows for s, st in steppers.items()}, tokens


def summarize(timed: list[dict], counted: list[dict]) -> dict:
    """The prefill step, the one-token steps (medians) and the whole run of one system at one point."""
    assert [r["phase"] for r in timed] == [r["phase"] for r in counted], "the two passes ran other steps"
    steps = [{**t, "ops": c["ops"], "launches": c["launches"]} for t, c in zip(timed, counted)]
    decode = [s for s in steps if s["phase"] == "decode"]
    med = lambda key: None if decode[0][key] is None else statistics.median(s[key] for s in decode)
    first = steps[0]
    return {"prefill": {k: first[k] for k in ("host_ms", "device_ms", "ops", "launches", "graph")},
            "decode": {"steps": len(decode), "graph_steps": sum(s["graph"] for s in decode),
                       **{f"{k}_median": med(k) for k in ("host_ms", "device_ms", "ops", "launches")},
                       "host_ms_max": max(s["host_ms"] for s in decode)},
            "steps": len(steps), "graph_steps": sum(s["graph"] for s in steps),
            "total_ms": sum(s["wall_ms"] for s in steps)}


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def measure(llms: dict, batch_size: int, args) -> dict:
    rng = random.Random(args.seed + batch_size)
    vocab = next(iter(llms.values())).cfg.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.input)] for _ in range(batch_size)]
    graphs = args.graphs == "on"
    side_by_side(llms, prompts, min(args.output, 2), graphs)                     # untimed warm-up
    timed, tokens = side_by_side(llms, prompts, args.output, graphs)
    counted, _ = side_by_side(llms, prompts, args.output, graphs, count=True)
    point = {"batch_size": batch_size, **{s: summarize(timed[s], counted[s]) for s in SYSTEMS}}
    point["tokens_equal"] = tokens["ft"] == tokens["orca"]
    o, f = point["orca"], point["ft"]
    # times: the median of FT's step over ORCA's step run just before it (a drift of the host's
    # speed cancels); counts: of the medians
    pairs = list(zip(*[[r for r in timed[s] if r["phase"] == "decode"] for s in ("orca", "ft")]))
    point["ft_over_orca"] = {
        **{k: statistics.median(b[k] / a[k] for a, b in pairs) for k in ("host_ms", "device_ms")},
        **{k: ratio(f["decode"][f"{k}_median"], o["decode"][f"{k}_median"]) for k in ("ops", "launches")},
        "total_ms": ratio(f["total_ms"], o["total_ms"])}
    return point


def fmt(x, spec=".2f"):
    return "n/a" if x is None else format(x, spec)


def print_table(points, on_gpu: bool):
    print(f"median over the one-token steps; FT/ORCA ratios; device: {'CUDA events' if on_gpu else 'wall (CPU)'}")
    head = ["B", "host ORCA", "host FT", "FT/ORCA", "dev ORCA", "dev FT", "FT/ORCA", "ops ORCA", "ops FT",
            "launch ORCA", "launch FT", "graph ORCA", "graph FT", "run FT/ORCA"]
    print(" ".join(f"{h:>11s}" for h in head))
    for p in points:
        o, f, r = p["orca"]["decode"], p["ft"]["decode"], p["ft_over_orca"]
        cells = [str(p["batch_size"]), fmt(o["host_ms_median"]), fmt(f["host_ms_median"]), fmt(r["host_ms"]),
                 fmt(o["device_ms_median"]), fmt(f["device_ms_median"]), fmt(r["device_ms"]),
                 fmt(o["ops_median"], ".0f"), fmt(f["ops_median"], ".0f"),
                 fmt(o["launches_median"], ".0f"), fmt(f["launches_median"], ".0f"),
                 f"{o['graph_steps']}/{o['steps']}", f"{f['graph_steps']}/{f['steps']}", fmt(r["total_ms"])]
        print(" ".join(f"{c:>11s}" for c in cells))
    print("host and dev in ms per step; graph: one-token steps through the decode graphs / all of them")


def build_llms(args) -> dict:
    """``{system: LLM}`` over one model, each with its own K/V pool (so their steps can alternate),
    FT's static context bound at ``--max-seq-len`` (default input + output: every point's reservations
    fit a device); ``max_bs`` is the largest point's, which behaves as ``max_bs`` = B here (every
    request of a point is present from the start: each system's batch is all of them)."""
    cfg = model_config(args.preset)
    cfg = dataclasses.replace(cfg, max_seq_len=args.max_seq_len or args.input + args.output)
    bs = max(args.batch_sizes)
    ec = EngineConfig(max_bs=bs, n_slots=bs * cfg.max_seq_len + 8, device=args.device, dtype=args.dtype,
                      cuda_graphs=args.graphs == "on")
    first = LLM(cfg, seed=args.seed, engine=ec)
    return {s: first if s == SYSTEMS[0] else LLM(gpt=first.model, engine=ec) for s in SYSTEMS}


def check_args(args):
    """Every number where it enters: out of range, a ValueError names the flag, its value and the
    allowed range (check_range's words): exit 2 (``parsed_args``), before a model is built."""
    if args.output < 2:
        raise ValueError(f"--output={args.output}: allowed >= 2 (a prefill step and at least one one-token step)")
    for b in args.batch_sizes:
        check_range("--batch-sizes", b, 1, 65536)                  # EngineConfig's max_bs
    check_range("--input", args.input, 1, 1 << 19)                   # input + output: a model's
    check_range("--output", args.output, 2, 1 << 19)                 # max_seq_len, at most 2^20
    if args.max_seq_len is not None:                                # FT's bound holds every request
        check_range("--max-seq-len", args.max_seq_len, args.input + args.output, 1 << 20)
    check_range("--seed", args.seed, 0)
    check_range("--threads", args.threads, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "--preset", dest="preset", default="tiny", help="tiny on a CPU, gpt3-13b on a GPU")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--input", type=int, default=32, help="prompt tokens of every request")
    p.add_argument("--output", type=int, default=32, help="generated tokens of every request")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="FT's static context bound (its K/V reservation); default input + output")
    p.add_argument("--graphs", choices=("on", "off"), default="on", help="decode graphs for both systems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--smoke", action="store_true", help="batch sizes 1 and 3, input 8, output 4, unless given")
    p.add_argument("--out", default="results/step_time.json")
    args = parsed_args(p, argv, check_args, SMOKE)    # --smoke: the toy size for what was not given
    torch.set_num_threads(args.threads)
    llms = build_llms(args)
    llm = llms["orca"]
    on_gpu = llm.engine_config.device.startswith("cuda")
    print(f"ORCA and FT per step, {llm.cfg.name} {args.dtype} on {args.device}, input {args.input}, "
          f"output {args.output}, {torch.get_num_threads()} thread(s), graphs {args.graphs}")
    t, load_before = time.perf_counter(), os.getloadavg()
    points = []

    def report(complete: bool):
        write_report(args.out, args, {"device": "cuda" if on_gpu else "cpu",
                                      "device_time": "CUDA events" if on_gpu else "wall clock (CPU)",
                                      "launches": "torch.profiler" if on_gpu else "n/a on the CPU",
                                      "graphs": ("replayed" if on_gpu else "static buffers, eager") if args.graphs == "on" else "off",
                                      "seconds": time.perf_counter() - t,
                                      "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
                                      "points": points}, complete)

    for b in args.batch_sizes:      # written as each point ends: a run cut by a time limit keeps them
        points.append(measure(llms, b, args))
        report(complete=False)
    print_table(points, on_gpu)
    report(complete=True)
    return points


if __name__ == "__main__":
    sys.exit(main() and 0)
