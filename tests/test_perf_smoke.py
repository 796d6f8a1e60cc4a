"""The two CPU benchmarks run end to end at a toy size and write the JSON they promise."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def threads():
    return str(torch.get_num_threads())   # leave the process's setting as it is


def test_peer_hf_smoke(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "peer_hf.json"
    load("peer_hf").main(["--smoke", "--threads", threads(), "--out", str(out)])
    report = json.loads(out.read_text())
    for field in ("python", "torch", "transformers", "torch_threads", "cpu_count"):
        assert field in report["environment"]
    tiny = report["presets"]["tiny"]
    systems = {"orca", "ft", "hf_generate", "hf_cb"}
    assert set(tiny["median"]) == systems == set(tiny["tokens_per_s_ratio_to_hf_cb"])
    for system, check in tiny["tokens"].items():   # same weights, greedy: the same tokens everywhere
        assert check["equal_to_orca"] == check["requests"] and not check["wrong_length"], system
    for m in tiny["median"].values():
        assert m["tokens_per_s"] > 0 and m["requests_per_s"] > 0 and m["median_norm_latency_ms"] > 0
    assert tiny["tokens_per_s_ratio_to_hf_cb"]["hf_cb"] == pytest.approx(1.0)
    floor = tiny["matmul_floor"]   # the linear layers alone bound every system's tokens/s
    assert floor["seconds"] > 0 and floor["gflops"] > 0 and floor["iterations"] >= 1
    assert floor["tokens_per_s_bound"] == pytest.approx(tiny["trace"]["generated_tokens"] / floor["seconds"])
    for m in tiny["median"].values():
        assert 0 < m["cpu_s"] and 0 < m["duration_s"]


def test_overhead_smoke(tmp_path):
    out = tmp_path / "overhead.json"
    load("overhead").main(["--smoke", "--threads", threads(), "--out", str(out)])
    report = json.loads(out.read_text())
    assert "torch_threads" in report["environment"]
    rows = report["rows"]
    assert [r["batch_size"] for r in rows] == [1, 4]
    for r in rows:   # every part is timed inside the step; bookkeeping is the rest of it
        assert all(r[f"{p}_ms"] >= 0 for p in ("select", "metadata", "sampling", "bookkeeping"))
        assert r["forward_ms"] > 0 and r["bare_forward_ms"] > 0 and 0 <= r["overhead_pct"] < 100
