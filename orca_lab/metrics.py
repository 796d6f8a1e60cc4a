"""Per-request and run-level metrics (ORCA §6: median normalized latency vs throughput).

Normalized latency = end-to-end latency / generated tokens. TTFT = first token - arrival.
TPOT = (finish - first token) / (generated - 1).
"""
from __future__ import annotations

import numpy as np
import pandas as pd


def per_request(result) -> pd.DataFrame:
    df = result.requests_df()
    df = df[df["t_finish"].notna()].copy()
    df["latency"] = df["t_finish"] - df["arrival"]
    df["norm_latency"] = df["latency"] / df["n_generated"]
    df["ttft"] = df["t_first_token"] - df["arrival"]
    df["queueing"] = df["t_scheduled"] - df["arrival"]
    steps = (df["n_generated"] - 1).where(df["n_generated"] > 1)
    df["tpot"] = (df["t_finish"] - df["t_first_token"]) / steps
    return df


def summarize(result, itl=None, slo_norm_latency_ms: float | None = None, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """One row of numbers for a run: the one reader of a per-request frame, for ``compare``, ``bench``,
    the simulator, the fidelity check and the notebooks. ``result`` is the engine's ``RunResult`` or a
    client's records (anything with ``requests_df()`` and ``duration``). Each quantity of
    ``QUANTITIES`` gets ``{name}_{mean,median,p90,p95,p99}_ms``; ITL too where the gaps between
    tokens are known (``itl``, seconds); throughput is over first arrival..last finish; goodput counts
    the requests that met every SLO given (all of them when none is)."""
    df = per_request(result)
    duration = max(result.duration, 1e-12)
    row = {"system": getattr(result, "system", None), "n_requests": int(len(df)),
           "duration_s": float(result.duration), "throughput_rps": len(df) / duration,
           "throughput_tok_s": float(df["n_generated"].sum()) / duration}
    for name, col in QUANTITIES.items():
        row.update(distribution(df[col], name))
    if itl is not None:
        row.update(distribution(itl, "itl"))
    if hasattr(result, "iterations_df"):
        it = result.iterations_df()
        last_stage = it[it["stage"] == it["stage"].max()] if len(it) else it
        row["n_iterations"] = int(len(last_stage))
        row.update(_rows_per_iteration(last_stage))
    if getattr(result, "config", {}).get("prefix_caching") and len(df):   # prompt tokens found cached
        row["prefix_hit_rate"] = float(df["prefix_hit_tokens"].sum() / df["prompt_len"].sum())
    row["goodput_rps"] = goodput(df, duration, slo_norm_latency_ms, slo_ttft_ms, slo_tpot_ms)
    return row


def _rows_per_iteration(it: pd.DataFrame) -> dict:
    """Mean rows of the ``[sum L, H]`` tensor per iteration: useful tokens (a prompt or generated
    token of an unfinished request) apart from the padded and held rows the baseline computes for
    requests already done."""
    if not len(it):
        return {"tokens_per_iteration": 0.0, "wasted_rows_per_iteration": 0.0}
    useful = [sum(q for q, ph in zip(qs, phs) if ph != "held") for qs, phs in zip(it["q_lens"], it["phases"])]
    return {"tokens_per_iteration": float(np.mean(useful)),
            "wasted_rows_per_iteration": float((it["n_tokens"] - useful).mean())}


def compare_table(results) -> pd.DataFrame:
    return pd.DataFrame([summarize(r) for r in results]).set_index("system")


# -- one vocabulary: {quantity}_{statistic}_ms ----------------------------------------------------
QUANTITIES = {"ttft": "ttft", "tpot": "tpot", "e2e": "latency", "norm_latency": "norm_latency",
              "queueing": "queueing"}          # name in a summary -> column of ``per_request``
PERCENTILES = (50, 90, 95, 99)                  # 50 is named "median"


def distribution(values, name: str, scale: float = 1e3, unit: str = "ms") -> dict:
    """``{name}_mean_{unit}``, ``_median_``, ``_p90_``, ``_p95_``, ``_p99_`` of ``values`` (seconds
    times ``scale``); NaN when there is no value."""
    v = np.asarray(pd.Series(values, dtype=float).dropna()) * scale
    stats = {"mean": float(v.mean()) if len(v) else float("nan")}
    for q in PERCENTILES:
        stats["median" if q == 50 else f"p{q}"] = float(np.percentile(v, q)) if len(v) else float("nan")
    return {f"{name}_{k}_{unit}": x for k, x in stats.items()}


def goodput(df: pd.DataFrame, duration: float, slo_norm_latency_ms: float | None = None,
            slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> float:
    """Requests/s that met every SLO given (as vLLM counts it: a one-token request has TPOT 0)."""
    ok = pd.Series(True, index=df.index)
    if slo_norm_latency_ms is not None:
        ok &= df["norm_latency"] * 1e3 <= slo_norm_latency_ms
    if slo_ttft_ms is not None:
        ok &= df["ttft"] * 1e3 <= slo_ttft_ms
    if slo_tpot_ms is not None:
        ok &= df["tpot"].fillna(0.0) * 1e3 <= slo_tpot_ms
    return float(ok.sum()) / max(duration, 1e-12)
