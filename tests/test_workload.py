"""Traces, their files, and the metrics."""
import math

import numpy as np
import pytest

from orca_lab.engine.engine import IterationRecord, RequestRecord, RunResult
from orca_lab.metrics import per_request, summarize
from orca_lab.workload import REAL_SHAPES, homogeneous_trace, load_trace, paper_trace, real_trace, save_trace


def test_paper_trace_follows_the_paper():
    tr = paper_trace(2000, rate=5.0, seed=1)
    ins = np.array([len(t.prompt) for t in tr])
    gens = np.array([t.max_gen_tokens for t in tr])
    assert ins.min() >= 32 and ins.max() <= 512 and gens.min() >= 1 and gens.max() <= 128
    assert abs(ins.mean() - 272) < 10 and abs(gens.mean() - 64.5) < 4
    gaps = np.diff([t.arrival for t in tr])
    assert abs(gaps.mean() - 0.2) < 0.02 and abs(gaps.std() / gaps.mean() - 1) < 0.1   # Poisson
    assert tr == paper_trace(2000, rate=5.0, seed=1) and tr != paper_trace(2000, rate=5.0, seed=2)


def test_scale_and_offline_and_homogeneous():
    tr = paper_trace(50, rate=None, scale=0.25, vocab_size=257)
    assert all(t.arrival == 0 for t in tr) and max(len(t.prompt) for t in tr) <= 128
    assert max(max(t.prompt) for t in tr) < 257
    h = homogeneous_trace(10, 256, 256, rate=2.0)
    assert {(len(t.prompt), t.max_gen_tokens) for t in h} == {(256, 256)}


@pytest.mark.parametrize("rate", [float("inf"), float("nan"), -1.0, 0.0])
def test_bad_rate_is_refused(rate):
    with pytest.raises(ValueError, match="rate="):
        paper_trace(5, rate=rate)


def test_trace_file_round_trip(tmp_path):
    tr = paper_trace(20, rate=3.0, seed=4, scale=0.1)
    save_trace(tr, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == tr


@pytest.mark.parametrize("line,match", [
    ('{"arrival": 0, "prompt": [1, 2]}', "max_gen_tokens"),
    ('{"arrival": -1, "prompt": [1], "max_gen_tokens": 2}', "arrival=-1"),
    ('{"arrival": 0, "prompt": [], "max_gen_tokens": 2}', "prompt must be"),
    ('{"arrival": 0, "prompt": [1], "max_gen_tokens": 0}', "max_gen_tokens=0"),
    ('[1, 2, 3]', "JSON object"),
    ('{"arrival": 0, "prompt"', "malformed"),
])
def test_malformed_trace_line_is_named(tmp_path, line, match):
    good = '{"arrival": 0, "prompt": [3], "max_gen_tokens": 1}'
    (tmp_path / "t.jsonl").write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match) as e:
        load_trace(tmp_path / "t.jsonl")
    assert "t.jsonl:2" in str(e.value)


def test_metrics_on_a_hand_made_run():
    reqs = [RequestRecord(0, 0.0, 10, 4, 0.0, 0.1, 0.4, 4, (1, 2, 3, 4)),
            RequestRecord(1, 0.2, 10, 2, 0.2, 0.3, 1.0, 2, (1, 2))]
    its = [IterationRecord(0, 0, 0.0, 0.1, (0,), ("prefill",), (10,), 10, 1, 14, 0)]
    run = RunResult("orca", reqs, its, duration=1.0)
    df = per_request(run)
    assert df["norm_latency"].tolist() == pytest.approx([0.1, 0.4])
    assert df["ttft"].tolist() == pytest.approx([0.1, 0.1]) and df["tpot"].tolist() == pytest.approx([0.1, 0.7])
    s = summarize(run, slo_norm_latency_ms=200)
    assert s["norm_latency_median_ms"] == pytest.approx(250.0) and s["throughput_rps"] == 2.0
    assert s["goodput_rps"] == 1.0 and s["throughput_tok_s"] == 6.0 and not math.isnan(s["tpot_median_ms"])


@pytest.mark.parametrize("shape", sorted(REAL_SHAPES))
def test_real_shaped_traces_follow_their_published_medians_and_fit_the_context(shape):
    s = REAL_SHAPES[shape]
    trace = real_trace(shape, 4000, seed=1, max_len=1 << 16)
    ins = np.array([len(t.prompt) for t in trace])
    outs = np.array([t.max_gen_tokens for t in trace])
    assert np.median(ins) == pytest.approx(s.in_median, rel=0.1)
    assert np.median(outs) == pytest.approx(s.out_median, rel=0.1)
    small = real_trace(shape, 500, seed=1, max_len=512, scale=0.5)
    assert max(t.max_tokens for t in small) <= 512 and min(len(t.prompt) for t in small) >= 1


def test_bursty_arrivals_and_bad_shapes():
    gaps = lambda cv: np.diff([t.arrival for t in real_trace("sharegpt", 3000, rate=10.0, seed=2, cv=cv)])
    assert np.std(gaps(1.0)) / np.mean(gaps(1.0)) == pytest.approx(1.0, rel=0.1)
    assert np.std(gaps(3.0)) / np.mean(gaps(3.0)) == pytest.approx(3.0, rel=0.2)
    with pytest.raises(ValueError, match="shape='lmsys' is not allowed"):
        real_trace("lmsys", 4)
