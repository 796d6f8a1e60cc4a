"""orca_lab against its peer on this machine: Hugging Face transformers, on the same weights and trace.

    python benchmarks/peer_hf.py [--presets tiny gpt2] [--rounds 3] [--threads 1] [--out results/peer_hf.json]
    python benchmarks/peer_hf.py --device cuda --dtype bfloat16 --presets gpt2 --n-requests 256 --max-bs 64

``--device``/``--dtype`` put both sides on the same device with the same weights in the same dtype
(on a GPU: bf16, orca_lab on its Triton kernels and CUDA graphs, HF on its default attention).
The continuous-batching peer needs transformers >= 4.56; its API is detected (``cb_manager``).

One process, one GPT-2-architecture model per preset (seeded random weights, saved once in the Hugging
Face layout and loaded by ``GPT2LMHeadModel.from_pretrained``), one paper-shaped trace scaled for a
CPU (all requests at time 0: an offline throughput run), greedy decoding, EOS ignored. Four systems,
alternated within each round so that a noisy neighbour hurts them alike:

- ``orca``: orca_lab's ORCA engine (iteration-level scheduling, selective batching);
- ``ft``: orca_lab's request-level baseline (FasterTransformer-style, padded batches);
- ``hf_generate``: HF ``generate`` on static batches of ``max_bs`` requests in arrival order, left
  padded, each batch run to its longest request (a request-level system, as ``ft``);
- ``hf_cb``: HF continuous batching: the manager behind ``generate_batch``, fed through its
  ``add_request`` so that each request gets its own ``max_new_tokens`` (``generate_batch`` takes one
  for all). Its set-up (cache allocation, warm-up) is left out of its time.

First every system's tokens are checked against ORCA's; then each round prints generated tokens/s,
requests/s and median normalized latency (latency / generated tokens), and the ratios to ``hf_cb``.
The JSON records the hardware, the versions and the thread setting. orca_lab never changes torch's
thread count; this script does (``--threads``, default 1): on a small shared CPU two OpenMP threads
stall on each other's barriers whenever another process holds a core. ``torch.set_num_threads`` binds
only the calling thread, and HF's continuous batching runs its model in a thread of its own, which
would get every core; so, run as a script, this sets ``OMP_NUM_THREADS`` before torch loads, and each
system's CPU seconds per wall second ("cores") are printed to show that all of them kept to the setting.

The matmul floor: the trace's linear layers (QKV, projections, MLP, and the LM head on the last token
of each request) timed bare with ``F.linear`` on this core, at the shapes of ORCA's iterations. Every
system multiplies the same matrices, so ``generated tokens / floor`` bounds the tokens/s of any of them
at this precision on this machine, and ``floor bound / hf_cb`` bounds the ratio any engine can reach.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

THREADS = 1

if __name__ == "__main__":   # OpenMP reads this once, for every thread it will ever start
    _pre = argparse.ArgumentParser(add_help=False)
    _pre.add_argument("--threads", default=str(THREADS))
    _threads = _pre.parse_known_args()[0].threads
    if _threads.isdecimal() and int(_threads) >= 1:   # else main refuses it (libgomp would only warn)
        os.environ["OMP_NUM_THREADS"] = _threads

import numpy as np
import torch
import torch.nn.functional as F

from orca_lab import LLM, EngineConfig
from orca_lab.config import check_device, check_range, parsed_args
from orca_lab.environment import environment
from orca_lab.workload import paper_trace

SYSTEMS = ("orca", "ft", "hf_generate", "hf_cb")
REFERENCE = "hf_cb"
# Lengths are the paper's U{32..512} inputs and U{1..128} generated tokens times this scale.
SCALES = {"tiny": 0.25, "gpt2": 0.125}
SMOKE = {"presets": ["tiny"], "rounds": 1, "n_requests": 4, "scale": 0.05}


# ------------------------------------------------------------------------------------ systems
def run_orca_lab(llm, trace, system):
    """One of orca_lab's engines; times from its own RunResult (first arrival to last finish).
    Its set-up (the K/V pool's allocation) is left out, as HF's is."""
    engine = llm.new_engine(system)
    try:
        cpu = time.process_time()
        result = engine.run(trace)
        cpu = time.process_time() - cpu
    finally:
        engine.close()
    outputs = [list(r.output) for r in sorted(result.requests, key=lambda r: r.rid)]
    latencies = [r.t_finish - r.arrival for r in sorted(result.requests, key=lambda r: r.rid)]
    return outputs, latencies, result.duration, cpu


def run_hf_generate(hf, trace, max_bs):
    """Static batches in arrival order: a batch leaves when its longest request is done."""
    outputs, latencies = [], []
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(trace), max_bs):
        items = trace[i:i + max_bs]
        ids, mask = (t.to(hf.device) for t in _left_padded([list(it.prompt) for it in items]))
        n_new = max(it.max_gen_tokens for it in items)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
        done = time.perf_counter() - start
        for row, it in zip(out[:, ids.shape[1]:].tolist(), items):
            outputs.append(row[:it.max_gen_tokens])
            latencies.append(done)
    return outputs, latencies, time.perf_counter() - start, time.process_time() - cpu


def _left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def run_hf_cb(hf, trace, max_bs):
    """HF continuous batching; latency from the manager's own finish time of each request."""
    from transformers import GenerationConfig
    gen = GenerationConfig(max_new_tokens=max(it.max_gen_tokens for it in trace), do_sample=False,
                           eos_token_id=-1, pad_token_id=0)
    page = 256   # tokens per cache page; every request gets its pages, twice over, plus a margin
    pages = sum(math.ceil(it.max_tokens / page) for it in trace)
    results = {}
    with cb_manager(hf, gen, page, 2 * pages + 16, max_bs) as manager:
        start, cpu = time.perf_counter(), time.process_time()
        for i, it in enumerate(trace):
            _call(manager.add_request, list(it.prompt), request_id=str(i), max_new_tokens=it.max_gen_tokens,
                  eos_token_id=-1)
        while len(results) < len(trace):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[int(res.request_id)] = res
            elif res is None and not manager.is_running():
                raise RuntimeError("HF's continuous batching loop stopped before finishing the trace")
        cpu = time.process_time() - cpu      # both threads, set-up and shut-down left out
    outs = [results[i] for i in range(len(trace))]
    latencies = [r.lifespan[1] - start for r in outs]
    return [list(r.generated_tokens) for r in outs], latencies, max(latencies), cpu


def cb_manager(hf, gen, page: int, num_blocks: int, max_bs: int):
    """HF's continuous-batching manager as a context manager, on whichever API this transformers has.

    - 5.x: a ``ContinuousBatchingConfig`` (its page size is ``page_size`` in some releases and
      ``block_size`` in others; each keyword is passed only where the installed class takes it);
    - 4.56-4.5x: the cache settings ride on the ``GenerationConfig`` (``block_size``, ``num_blocks``)
      and ``init_continuous_batching`` returns the manager.
    Older releases have no continuous batching: that is refused, naming the version.
    """
    import transformers
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        ContinuousBatchingConfig = None
    if ContinuousBatchingConfig is not None and hasattr(hf, "continuous_batching_context_manager"):
        import inspect
        page_key = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters \
            else "block_size"
        cb = _call(ContinuousBatchingConfig, **{page_key: page}, num_blocks=num_blocks,
                   max_requests_per_batch=max_bs, max_batch_size=max_bs)
        return hf.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                      block=True, timeout=30)
    if hasattr(hf, "init_continuous_batching"):
        gen.block_size, gen.num_blocks, gen.max_batch_tokens = page, num_blocks, max_bs * page
        return _started(hf.init_continuous_batching(generation_config=gen))
    raise RuntimeError(f"hf_cb needs transformers' continuous batching (generate_batch / "
                       f"init_continuous_batching, transformers >= 4.56); installed: {transformers.__version__}")


def _call(fn, *args, **kwargs):
    """``fn`` with the keywords its signature takes (the continuous-batching API moves between
    releases); the rest are dropped."""
    import inspect
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


class _started:
    """start() on entry, stop() on exit, for managers without a context manager of their own."""
    def __init__(self, manager):
        self.manager = manager

    def __enter__(self):
        self.manager.start()
        return self.manager

    def __exit__(self, *exc):
        self.manager.stop(block=True, timeout=30)


def run(system, llm, hf, trace, max_bs):
    if system in ("orca", "ft"):
        return run_orca_lab(llm, trace, system)
    if system == "hf_generate":
        return run_hf_generate(hf, trace, max_bs)
    return run_hf_cb(hf, trace, max_bs)


# ---------------------------------------------------------------------------------- measuring
def timed_run(system, llm, hf, trace, max_bs):
    """Outputs and metrics of one run. CPU seconds (this process, every thread, over the same span
    as the wall clock) are recorded beside it: on a shared machine they show how much of the wall
    time was spent waiting, and their ratio ("cores") how many cores a system kept busy."""
    outputs, latencies, duration, cpu = run(system, llm, hf, trace, max_bs)
    n_gen = sum(len(o) for o in outputs)
    norm = [lat / len(o) for lat, o in zip(latencies, outputs)]
    return outputs, {"duration_s": duration, "cpu_s": cpu, "tokens_per_s": n_gen / duration,
                     "tokens_per_cpu_s": n_gen / cpu, "requests_per_s": len(trace) / duration,
                     "norm_latency_median_ms": 1e3 * statistics.median(norm)}


def check_tokens(trace, runs) -> dict:
    """Each system's outputs against ORCA's (itself tested equal to each request run alone)."""
    ref = runs["orca"]
    report = {}
    for system, outs in runs.items():
        bad = [i for i, (a, b) in enumerate(zip(outs, ref)) if a != b]
        wrong_len = [i for i, (o, it) in enumerate(zip(outs, trace)) if len(o) != it.max_gen_tokens]
        report[system] = {"requests": len(trace), "equal_to_orca": len(trace) - len(bad),
                          "differ": bad, "wrong_length": wrong_len}
    return report


def bench_preset(preset, args, out_dir) -> dict:
    scale = args.scale or SCALES.get(preset, 0.125)
    engine = EngineConfig(max_bs=args.max_bs, n_slots=args.max_bs * 1024,   # ft reserves 1024 per request
                          device=args.device, dtype=args.dtype)
    llm = LLM(preset, seed=args.seed, engine=engine)
    trace = paper_trace(args.n_requests, rate=None, seed=args.seed, scale=scale, vocab_size=llm.cfg.vocab_size)
    hf = load_hf(llm, out_dir / f"{preset}_hf", args.device, args.dtype)
    print(f"\n== {preset}: {args.n_requests} requests, inputs {min(len(t.prompt) for t in trace)}.."
          f"{max(len(t.prompt) for t in trace)} (sum {sum(len(t.prompt) for t in trace)}), generated "
          f"{min(t.max_gen_tokens for t in trace)}..{max(t.max_gen_tokens for t in trace)} (sum "
          f"{sum(t.max_gen_tokens for t in trace)}), max_bs {args.max_bs}, {args.device} {args.dtype}, "
          f"{torch.get_num_threads()} thread(s)")
    for system in SYSTEMS:     # warm-up: first calls (kernel selection, allocations) out of the way
        run(system, llm, hf, trace[:2], args.max_bs)
    rounds = []
    for r in range(args.rounds):
        row, outputs = {}, {}
        for system in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):    # alternate the order too
            outputs[system], row[system] = timed_run(system, llm, hf, trace, args.max_bs)
        if r == 0:
            tokens = check_tokens(trace, outputs)
            print_tokens(tokens)
        rounds.append(row)
        print_round(r, row)
    floor = matmul_floor(llm, trace, args.device, getattr(torch, args.dtype))
    summary = {s: {k: statistics.median(rd[s][k] for rd in rounds) for k in rounds[0][s]} for s in SYSTEMS}
    ratios = {s: statistics.median(rd[s]["tokens_per_s"] / rd[REFERENCE]["tokens_per_s"] for rd in rounds)
              for s in SYSTEMS}
    cpu_ratios = {s: statistics.median(rd[s]["tokens_per_cpu_s"] / rd[REFERENCE]["tokens_per_cpu_s"]
                                       for rd in rounds) for s in SYSTEMS}
    floor["tokens_per_s_bound"] = sum(t.max_gen_tokens for t in trace) / floor["seconds"]
    floor["ratio_bound_to_hf_cb"] = floor["tokens_per_s_bound"] / summary[REFERENCE]["tokens_per_s"]
    print_summary(preset, summary, ratios, cpu_ratios, floor)
    return {"model": preset, "config": vars(llm.cfg), "scale": scale,
            "trace": {"n": len(trace), "prompt_tokens": sum(len(t.prompt) for t in trace),
                      "generated_tokens": sum(t.max_gen_tokens for t in trace)},
            "tokens": tokens, "rounds": rounds, "median": summary, "tokens_per_s_ratio_to_hf_cb": ratios,
            "tokens_per_cpu_s_ratio_to_hf_cb": cpu_ratios, "matmul_floor": floor}


def matmul_floor(llm, trace, device="cpu", dtype=torch.float32) -> dict:
    """Seconds the linear layers of ORCA's schedule of this trace take bare, on this core (or GPU)."""
    result = llm.serve(trace, system="orca")
    cfg, d = llm.cfg, llm.cfg.d_model
    shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]          # (out, in) per layer
    cache: dict[tuple[int, int, int], float] = {}

    def linear_s(m, n_out, n_in):
        if (m, n_out, n_in) not in cache:
            x, w, b = (torch.randn(*shape, device=device, dtype=dtype) for shape in ((m, n_in), (n_out, n_in), (n_out,)))
            F.linear(x, w, b)
            _sync(device)
            t = time.perf_counter()
            for _ in range(3):
                F.linear(x, w, b)
            _sync(device)
            cache[m, n_out, n_in] = (time.perf_counter() - t) / 3
        return cache[m, n_out, n_in]

    seconds = flops = 0.0
    for it in result.iterations:
        for m, layer_shapes, n_layers in ((it.n_tokens, shapes, cfg.n_layers),
                                          (len(it.rids), [(cfg.vocab_size, d)], 1)):
            seconds += n_layers * sum(linear_s(m, o, i) for o, i in layer_shapes)
            flops += n_layers * sum(2 * m * o * i for o, i in layer_shapes)
    return {"seconds": seconds, "gflops": flops / 1e9, "gflop_per_s": flops / 1e9 / seconds,
            "iterations": len(result.iterations)}


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def load_hf(llm, path, device="cpu", dtype="float32"):
    """orca_lab's weights in HF's GPT-2, on the same device and in the same dtype."""
    from transformers import GPT2LMHeadModel
    llm.save_pretrained(path)
    return GPT2LMHeadModel.from_pretrained(path).to(device=device, dtype=getattr(torch, dtype)).eval()


# ----------------------------------------------------------------------------------- printing
def print_tokens(report):
    for system, r in report.items():
        ok = not r["differ"] and not r["wrong_length"]
        note = "" if ok else (f"  DIFFER on requests {r['differ'][:8]}"
                              f"{' (left padding changes the float rounding of HF static batches)' if system == 'hf_generate' else ''}")
        print(f"  tokens {system:12s} {r['equal_to_orca']}/{r['requests']} equal to orca{note}")


def print_round(r, row):
    ref = row[REFERENCE]["tokens_per_s"]
    cells = "  ".join(f"{s} {m['tokens_per_s']:8.1f} tok/s ({m['tokens_per_s'] / ref:4.2f}x)" for s, m in row.items())
    print(f"  round {r}: {cells}")


def print_summary(preset, summary, ratios, cpu_ratios, floor):
    print(f"  median over rounds ({preset}); ratios are medians of per-round ratios:")
    print(f"  {'system':12s} {'tok/s':>9s} {'req/s':>8s} {'med norm lat ms':>16s} {'tok/s vs hf_cb':>15s} "
          f"{'tok/cpu-s vs hf_cb':>19s} {'cores':>6s}")
    for s in SYSTEMS:
        m = summary[s]
        print(f"  {s:12s} {m['tokens_per_s']:9.1f} {m['requests_per_s']:8.2f} "
              f"{m['norm_latency_median_ms']:16.1f} {ratios[s]:14.2f}x {cpu_ratios[s]:18.2f}x "
              f"{m['cpu_s'] / m['duration_s']:6.2f}")
    print(f"  matmul floor: {floor['gflops']:.1f} GFLOP of linear layers take {floor['seconds']:.2f} s bare "
          f"({floor['gflop_per_s']:.0f} GFLOP/s): at most {floor['tokens_per_s_bound']:.1f} tok/s for any "
          f"system, {floor['ratio_bound_to_hf_cb']:.2f}x hf_cb")


def check_args(args):
    """Every argument where it enters: out of range, a ValueError names the flag, its value and the
    allowed range (check_range's words): exit 2 (``parsed_args``), before a model is built."""
    check_device("--device", args.device)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device={args.device!r} but no CUDA device is available")
    check_range("--rounds", args.rounds, 1)                       # no round has no median
    check_range("--n-requests", args.n_requests, 1, 10_000_000)   # paper_trace's bound
    if args.scale is not None:                                    # (0 would read as "not given")
        check_range("--scale", args.scale, 1e-3, 1000.0, kind=float)
    check_range("--max-bs", args.max_bs, 1, 65536)                # EngineConfig's bound
    check_range("--seed", args.seed, 0)
    check_range("--threads", args.threads, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "gpt2"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n-requests", type=int, default=32)
    p.add_argument("--scale", type=float, default=None, help="lengths x scale (default per preset)")
    p.add_argument("--max-bs", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=THREADS, help="torch intra-op threads for every system")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both systems)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--smoke", action="store_true", help="tiny preset, 4 short requests, 1 round, unless given")
    p.add_argument("--out", default="results/peer_hf.json")
    args = parsed_args(p, argv, check_args, SMOKE)    # --smoke: the toy size for what was not given
    torch.set_num_threads(args.threads)
    _quiet_transformers()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "environment": {**environment(), **_versions()}, "presets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            report["presets"][preset] = bench_preset(preset, args, Path(tmp))
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    return report


def _versions():
    import transformers
    return {"transformers": transformers.__version__, "numpy": np.__version__,
            "torch_interop_threads": torch.get_num_interop_threads(),
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS")}


def _quiet_transformers():
    """HF's manager logs a psutil complaint per start on CPU; progress bars and warnings off."""
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)


if __name__ == "__main__":
    sys.exit(main() and 0)
