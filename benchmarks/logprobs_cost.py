"""What logprobs, echo and the sampling fields cost, and that a request asking for none of them pays
nothing: generated tokens per second of one batch, in process, for

    before            the sampler of the code before this change (``orca_lab/engine/sampler.py`` at
                      ``--base``, read with ``git show``), with no prompt-logprob check in the executor
    after             this code, the requests asking for nothing
    logprobs=5        every request asking for its tokens' top-5 logprobs
    echo              every request asking for its prompt's top-5 logprobs too (prompt_logprobs=5)
    penalties         every request with frequency/presence/repetition penalties and a logit bias

    python benchmarks/logprobs_cost.py [--preset tiny] [--batch 16] [--prompt-len 64] [--gen 64]
                                       [--rounds 12] [--device cpu] [--out docs/results/logprobs_cost_cpu.json]

Everything else (model, engine, batch, prompts) is the same object; the modes run interleaved round
by round, the order alternating, and the table gives each one's median over the rounds and its ratio
to "before", measured side by side in one run.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from orca_lab import LLM, EngineConfig, SamplingParams
from orca_lab.model import executor, logprobs
from orca_lab.results import write_report

ROOT = Path(__file__).resolve().parents[1]
MODES = ("before", "after", "logprobs=5", "echo", "penalties")


def old_sampler(base: str):
    """The sampler module of commit ``base``, loaded apart from the package."""
    src = subprocess.run(["git", "show", f"{base}:orca_lab/engine/sampler.py"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    mod = types.ModuleType("sampler_before")
    exec(compile(src, f"{base}:orca_lab/engine/sampler.py", "exec"), mod.__dict__)
    return mod


def params_of(mode: str, gen: int) -> SamplingParams:
    extra = {"logprobs=5": dict(logprobs=5), "echo": dict(logprobs=5, prompt_logprobs=5),
             "penalties": dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2,
                               logit_bias={5: 2.0, 7: -3.0})}.get(mode, {})
    return SamplingParams(max_gen_tokens=gen, **extra)


def one_run(llm, prompts, mode: str, gen: int, before) -> tuple[float, float]:
    """Generated tokens per second of one ``generate`` of the batch: per wall second, and per second
    of this process's CPU time (one thread: what it computed, less what the neighbours' load adds)."""
    new_sample, new_wants = executor.sample, logprobs.wants_prompt
    if mode == "before":                    # the code before: its sampler, no prompt-logprob check
        executor.sample, logprobs.wants_prompt = before.sample, lambda batch: False
    try:
        sync(llm)
        t, c = time.perf_counter(), time.process_time()
        out = llm.generate(prompts, sampling_params=params_of(mode, gen))
        sync(llm)
        elapsed, cpu = time.perf_counter() - t, time.process_time() - c
    finally:
        executor.sample, logprobs.wants_prompt = new_sample, new_wants
    assert all(len(o) == gen for o in out)
    n = sum(map(len, out))
    return n / elapsed, n / cpu


def sync(llm):
    if llm.engine_config.device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--base", default="144c74f", help="the commit whose sampler is 'before'")
    p.add_argument("--out", default="docs/results/logprobs_cost_cpu.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(args.preset, seed=0, engine=EngineConfig(max_bs=args.batch, n_slots=args.batch * 256,
                                                       device=args.device))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, llm.cfg.vocab_size - 1, (args.batch, args.prompt_len), generator=g).tolist()
    before = old_sampler(args.base)
    for mode in MODES:                      # warm-up
        one_run(llm, prompts, mode, 4, before)
    got = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            got[mode].append(one_run(llm, prompts, mode, args.gen, before))
    # each round's ratio to "before" of the same round (paired: a neighbour's load moves both), median
    ratio = lambda m, k: statistics.median(a[k] / b[k] for a, b in zip(got[m], got["before"]))
    rows = {m: {"tokens_per_s": statistics.median(x[0] for x in v), "tokens_per_cpu_s": statistics.median(x[1] for x in v),
                "ratio_to_before": ratio(m, 0), "cpu_ratio_to_before": ratio(m, 1),
                "rounds": [{"tokens_per_s": a, "tokens_per_cpu_s": b} for a, b in v]} for m, v in got.items()}
    print(f"{args.preset} on {args.device}, batch {args.batch}, prompt {args.prompt_len}, {args.gen} tokens each, "
          f"{torch.get_num_threads()} thread(s); medians of {args.rounds} interleaved rounds, ratios paired by round")
    print(f"{'mode':>12s} {'tokens/s':>10s} {'vs before':>10s} {'tokens/cpu-s':>13s} {'vs before':>10s}")
    for m, row in rows.items():
        print(f"{m:>12s} {row['tokens_per_s']:10.1f} {row['ratio_to_before']:10.3f} {row['tokens_per_cpu_s']:13.1f} "
              f"{row['cpu_ratio_to_before']:10.3f}")
    write_report(ROOT / args.out, args, {"rows": rows})
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
