"""How much of the reserved K/V memory holds real tokens (ORCA §4.2's reservation, and its cost).

ORCA reserves ``max_tokens`` slots when a request is first scheduled, so a running request never runs
out of memory. The price is memory reserved for tokens not generated yet, or never (a request that
stops at EOS before ``max_gen_tokens``). The vLLM paper (SOSP'23) measured 20-38% of K/V memory
holding real tokens under such reservation vs ~96% with paging. Here the same schedule is read four
ways: reserving ``max_seq_len`` (FasterTransformer), ``max_tokens`` (ORCA), the true final length (an
oracle), and pages of ``block_size`` tokens allocated as the request grows (vLLM).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.workload import TraceItem, paper_trace

SCHEMES = ("max_seq_len", "max_tokens", "true_length", "paged")


@dataclass(frozen=True)
class EarlyStopItem(TraceItem):
    """A request that declares ``max_gen_tokens`` but ends at EOS after ``n_real`` tokens."""
    n_real: int = 1
    eos_token_id: int = 0

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_gen_tokens=self.max_gen_tokens, ignore_eos=False, eos_token_id=self.eos_token_id)


def early_stop_trace(n: int, rate: float | None, seed: int = 0, declared_gen: int = 128,
                     vocab_size: int = 50257, **kw) -> list[EarlyStopItem]:
    """The paper's trace, but each request declares ``declared_gen`` tokens and really generates
    the paper's U{1..128} (its EOS comes first): what a client that cannot know the length sends."""
    base = paper_trace(n, rate, seed, vocab_size=vocab_size, **kw)
    if max(it.max_gen_tokens for it in base) > declared_gen:
        raise ValueError(f"declared_gen={declared_gen} is below the trace's longest output "
                         f"({max(it.max_gen_tokens for it in base)}): a request declares at least what it generates")
    return [EarlyStopItem(it.arrival, it.prompt, declared_gen, it.max_gen_tokens, vocab_size - 1) for it in base]


def eos_after(trace):
    """For ``SimExecutor``: each request's true length, by rid (the engine numbers requests in
    arrival order)."""
    real = [getattr(it, "n_real", it.max_gen_tokens) for it in sorted(trace, key=lambda it: it.arrival)]
    return lambda req: real[req.rid]


def kv_occupancy(result, trace, max_seq_len: int, block_size: int = 16) -> pd.DataFrame:
    """Per iteration (in submission order): slots holding real K/V after it, and slots reserved by
    every request holding memory then under each scheme. A request holds memory from its first
    iteration to its last (ORCA reserves at its first selection and frees after its last return)."""
    declared = [len(it.prompt) + it.max_gen_tokens for it in sorted(trace, key=lambda it: it.arrival)]
    reqs = {r.rid: r for r in result.requests}
    its = sorted((it for it in result.iterations if it.stage == 0), key=lambda it: it.iteration)
    last = {}
    for i, it in enumerate(its):
        for rid in it.rids:
            last[rid] = i
    held, rows = {}, []        # rid -> tokens of K/V it holds
    for i, it in enumerate(its):
        for rid, q in zip(it.rids, it.q_lens):
            held[rid] = held.get(rid, 0) + q
        true = {rid: reqs[rid].prompt_len + reqs[rid].n_generated for rid in held}
        rows.append({"iteration": it.iteration, "time": it.start, "n_holders": len(held),
                     "used": sum(min(h, true[r]) for r, h in held.items()),
                     "max_seq_len": max_seq_len * len(held),
                     "max_tokens": sum(declared[r] for r in held),
                     "true_length": sum(true.values()),
                     "paged": sum(block_size * math.ceil(min(h, true[r]) / block_size) for r, h in held.items()),
                     "kv_reserved_engine": it.kv_reserved})
        for rid in [r for r in held if last[r] == i]:
            del held[rid]
    df = pd.DataFrame(rows)
    # each sample stands for the time until the next iteration starts
    df["weight"] = np.diff(df["time"].to_numpy(), append=df["time"].iloc[-1]) if len(df) else []
    return df


def kv_utilization(occ: pd.DataFrame) -> pd.DataFrame:
    """Time-weighted share of reserved slots that hold real K/V, per scheme."""
    w = occ["weight"].to_numpy()
    w = w if w.sum() > 0 else np.ones(len(occ))
    rows = [{"scheme": s, "utilization": float(np.average(occ["used"] / occ[s], weights=w)),
             "mean_reserved_slots": float(np.average(occ[s], weights=w)), "peak_reserved_slots": int(occ[s].max())}
            for s in SCHEMES]
    return pd.DataFrame(rows)


def kv_study(backend, curve, rates, n_requests: int, seed: int = 0, declared_gen: int | None = 128,
             block_size: int = 16, scale: float = 1.0, progress: bool = True):
    """Serve the trace at each rate and read its K/V occupancy under every scheme: (per-iteration
    occupancy, utilization per scheme and rate). With ``declared_gen`` (simulator only) requests
    declare that many tokens and stop at EOS at the paper's lengths; with None they never stop
    early, so ``max_tokens`` equals the true length."""
    from tqdm.auto import tqdm
    occs, utils = [], []
    for rate in tqdm(rates, desc="K/V occupancy", unit="rate", disable=not progress):
        if declared_gen is None:
            trace = paper_trace(n_requests, rate, seed, scale=scale, vocab_size=backend.cfg.vocab_size)
            result = backend.serve(curve, trace)
        else:
            trace = early_stop_trace(n_requests, rate, seed, declared_gen, backend.cfg.vocab_size, scale=scale)
            result = backend.serve(curve, trace, eos_after=eos_after(trace))
        occ = kv_occupancy(result, trace, backend.cfg.max_seq_len, block_size)
        occs.append(occ.assign(rate=rate))
        utils.append(kv_utilization(occ).assign(rate=rate))
    return pd.concat(occs, ignore_index=True), pd.concat(utils, ignore_index=True)


def reservation_table(models=("gpt3-175b", "llama3-70b"), device: str = "a100-80gb", tensor_parallel: int = 8,
                      pipeline_parallel: int = 1, max_bs: int = 256, n_requests: int = 512,
                      declared_gen: int = 128, block_size: int = 16, seed: int = 0) -> pd.DataFrame:
    """ORCA's ``max_tokens`` reservation against paged K/V, per model on the same GPUs: a slot's bytes
    (grouped-query attention shrinks it by ``n_heads / n_kv_heads``), the slots left after the weights,
    the requests that fit when each reserves the paper's longest ``max_tokens`` (512-token prompt plus
    ``declared_gen``), the share of reserved slots holding no real K/V in ORCA's schedule under each
    scheme, and the throughput of ``orca(max_bs)`` and ``paged(max_bs)`` serving the same early-stopping
    paper trace, all there at once (requests/s of the simulated GPUs, calibrated cost model)."""
    from orca_lab.metrics import summarize
    from orca_lab.sim.backends import SimBackend
    from orca_lab.sim.cost import DTYPE_BYTES, GiB
    from orca_lab.sim.sweep import Curve
    rows = []
    for model in models:
        sim = SimBackend(model, device, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                         block_size=block_size)
        cfg, trace = sim.cfg, early_stop_trace(n_requests, None, seed, declared_gen, sim.cfg.vocab_size)
        row = {"model": model, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
               "kv_bytes_per_token": cfg.kv_bytes_per_token(DTYPE_BYTES),
               "weights_gib_per_gpu": sim.cost.weight_bytes_per_gpu() / GiB, "n_slots": sim.n_slots,
               "requests_fit_max_tokens": sim.n_slots // (512 + declared_gen)}
        results = {system: sim.serve(Curve(system, max_bs), trace, eos_after=eos_after(trace))
                   for system in ("orca", "paged")}
        for system, result in results.items():
            row[f"{system}_batch"] = max(len(it.rids) for it in result.iterations)
            row[f"{system}_rps"] = summarize(result)["throughput_rps"]
        util = kv_utilization(kv_occupancy(results["orca"], trace, cfg.max_seq_len, block_size))
        waste = 1 - util.set_index("scheme")["utilization"]          # of ORCA's schedule, under each scheme
        row["waste_max_tokens"], row["waste_paged"] = waste["max_tokens"], waste["paged"]
        rows.append(row)
    return pd.DataFrame(rows)
