"""The README's main job, at a tiny size."""
import json

import pytest

from orca_lab.cli import main


def test_compare_prints_a_table_and_writes_json_and_html(tmp_path, capsys):
    """Single-point mode (``--rate``): one row per system, the baseline's tokens delivered at the end of
    its batch (TTFT = latency), useful tokens apart from the rows spent on held requests."""
    main(["compare", "--n-requests", "6", "--rate", "50", "--scale", "0.05", "--max-bs", "4",
          "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "orca" in out and "ft" in out and "median_norm_latency_ms" in out
    report = json.loads((tmp_path / "compare.json").read_text())
    rows = {r["system"]: r for r in report["summary"]}
    assert set(rows) == {"orca", "ft"} and all(r["rate"] == 50 for r in rows.values())
    assert rows["orca"]["wasted_rows_per_iteration"] == 0 < rows["ft"]["wasted_rows_per_iteration"]
    ft = next(run for run in report["runs"] if run["system"] == "ft")
    assert all(r["t_first_token"] == r["t_finish"] for r in ft["requests"])
    assert report["environment"]["torch"] and (tmp_path / "compare.html").stat().st_size > 10_000


def test_compare_measures_a_curve_from_a_capacity_probe(tmp_path, capsys):
    """Default mode: loads from light to past the baseline's capacity, set by a probe of each system;
    one summary row per (system, rate), and the mini Figure 10 in the HTML."""
    main(["compare", "--n-requests", "6", "--probe-requests", "4", "--scale", "0.04", "--max-bs", "4",
          "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "capacity (offline probe)" in out and "past the baseline's capacity" in out
    report = json.loads((tmp_path / "compare.json").read_text())
    cap = report["capacity_rps"]
    rates = sorted({r["rate"] for r in report["summary"]})
    assert 3 <= len(rates) <= 4 and rates[0] < cap["ft"] < rates[-1]
    assert sorted((r["system"], r["rate"]) for r in report["summary"]) == \
        sorted((s, rate) for s in ("orca", "ft") for rate in rates)
    assert "latency vs throughput (measured)" in (tmp_path / "compare.html").read_text()


def test_compare_refuses_bad_input_with_a_message(capsys):
    with pytest.raises(SystemExit) as e:
        main(["compare", "--rate", "-3"])
    assert e.value.code == 2 and "rate=-3.0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["compare", "--tp", "0"])
    assert e.value.code == 2 and "tp=0 is out of range" in capsys.readouterr().err
