"""The CPU benchmarks run end to end at a toy size and write the JSON they promise."""
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
        assert m["tokens_per_s"] > 0 and m["requests_per_s"] > 0 and m["norm_latency_median_ms"] > 0
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


def test_step_time_smoke(tmp_path):
    """ORCA and FT side by side per step: the same path (the decode graphs' static buffers, eager on
    the CPU) for every one-token step of both, the same ops, the same tokens."""
    out = tmp_path / "step_time.json"
    load("step_time").main(["--smoke", "--threads", threads(), "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["complete"] and report["device"] == "cpu" and report["launches"] == "n/a on the CPU"
    assert report["graphs"] == "static buffers, eager" and "torch_threads" in report["environment"]
    assert [p["batch_size"] for p in report["points"]] == [1, 3]
    for p in report["points"]:
        assert p["tokens_equal"], p["batch_size"]
        o, f = p["orca"], p["ft"]
        assert o["steps"] == f["steps"] == 4 and o["decode"]["steps"] == f["decode"]["steps"] == 3
        assert o["graph_steps"] == f["graph_steps"] == o["decode"]["graph_steps"] == 3
        assert not o["prefill"]["graph"] and not f["prefill"]["graph"]
        assert o["decode"]["ops_median"] == f["decode"]["ops_median"] > 0 and p["ft_over_orca"]["ops"] == 1
        assert o["prefill"]["ops"] == f["prefill"]["ops"] > 0
        assert o["decode"]["launches_median"] is None and p["ft_over_orca"]["launches"] is None
        assert set(p["ft_over_orca"]) == {"host_ms", "device_ms", "ops", "launches", "total_ms"}
        assert all(s["decode"]["host_ms_median"] > 0 and s["decode"]["device_ms_median"] > 0 for s in (o, f))


def test_a_step_time_run_cut_by_its_time_limit_keeps_the_points_it_measured(tmp_path):
    """The GPU check cuts a step at its limit (SIGINT): the JSON then holds the points measured."""
    bench, out = load("step_time"), tmp_path / "step_time.json"
    measured = bench.measure

    def cut_after_the_first(llms, b, args):
        if b > 1:
            raise KeyboardInterrupt
        return measured(llms, b, args)

    bench.measure = cut_after_the_first
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--smoke", "--threads", threads(), "--out", str(out)])
    report = json.loads(out.read_text())
    assert not report["complete"] and [p["batch_size"] for p in report["points"]] == [1]


def test_generate_overhead_smoke(tmp_path):
    out = tmp_path / "generate_overhead.json"
    load("generate_overhead").main(["--smoke", "--threads", threads(), "--out", str(out)])
    report = json.loads(out.read_text())
    assert set(report["rows"]) == {"reused", "allocated per call"} and "torch" in report["environment"]
    for r in report["rows"].values():          # the iteration is part of the call it is read from
        assert 0 < r["iteration_ms"] <= r["call_ms"] and r["overhead_ms"] >= 0


def test_select_scaling_smoke(tmp_path):
    out = tmp_path / "select_scaling.json"
    load("select_scaling").main(["--smoke", "--systems", "orca", "paged-tight", "--out", str(out)])
    report = json.loads(out.read_text())
    assert [(r["case"], r["waiting"] >= n) for r, n in zip(report["rows"], [10, 1000] * 2)] == \
        [("orca", True), ("orca", True), ("paged-tight", True), ("paged-tight", True)]
    assert all(r[c] > 0 for r in report["rows"] for c in ("select_us", "step_us", "stats_us"))
    assert report["rows"][-1]["preemptions"] > 0 and set(report["max_over_min"]) == {"orca", "paged-tight"}
