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
    assert "orca" in out and "ft" in out and "norm_latency_median_ms" in out
    report = json.loads((tmp_path / "compare.json").read_text())
    rows = {r["system"]: r for r in report["summary"]}
    assert set(rows) == {"orca", "ft"} and all(r["rate"] == 50 for r in rows.values())
    assert rows["orca"]["wasted_rows_per_iteration"] == 0
    ft = next(run for run in report["runs"] if run["system"] == "ft")
    held = [sum(q for q, ph in zip(it["q_lens"], it["phases"]) if ph == "held") for it in ft["iterations"]]
    assert rows["ft"]["wasted_rows_per_iteration"] == pytest.approx(sum(held) / len(held))   # held rows, apart
    assert all(r["t_first_token"] == r["t_finish"] for r in ft["requests"])
    assert report["environment"]["torch"] and (tmp_path / "compare.html").stat().st_size > 10_000
    # no capacity was measured, so no line says where 50 req/s lies against it
    assert "at the rate given (50.00 req/s offered)" in out and "capacity" not in out.split("kept up")[1]
    assert report["capacity_rps"] == {} and report["capacity_probe"] == "none: --rate given"


def test_compare_measures_a_curve_from_a_capacity_probe(tmp_path, capsys):
    """Default mode: loads from light to past the baseline's capacity, set by a probe of each system;
    one summary row per (system, rate), and the mini Figure 10 in the HTML."""
    main(["compare", "--n-requests", "6", "--probe-requests", "4", "--scale", "0.04", "--max-bs", "4",
          "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "capacity (offline probe)" in out and "past the baseline's capacity" in out
    report = json.loads((tmp_path / "compare.json").read_text())
    cap = report["capacity_rps"]
    assert report["capacity_probe"].startswith("offline") and set(report["kept_up_rps"]) == {"orca", "ft"}
    assert report["wall_s"] > 0 and report["cpu_s"] > 0 and "kept up" in out
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
    for flags, words in {("--threads", "0"): "threads=0 is out of range", ("--seed", "-1"): "seed=-1 is out of range",
                         ("--out", "/proc/nope"): "out='/proc/nope': cannot make that folder",
                         ("--rate", "1e-6"): "32 requests would arrive over about 32,000,000 s; allowed >= 0.00889",
                         ("--device", "cpu:foo"): "device='cpu:foo' is not allowed: use 'cpu', 'cuda' or 'cuda:N'",
                         ("--scale", "5000"): "scale=5000.0 is out of range"}.items():
        with pytest.raises(SystemExit) as e:       # before a model is built
            main(["compare", *flags])
        assert e.value.code == 2 and words in capsys.readouterr().err, flags
    with pytest.raises(SystemExit) as e:           # once the model says how long a request may be
        main(["compare", "--scale", "1000"])
    assert e.value.code == 2 and "more than tiny's max length 1024: use a smaller --scale" in capsys.readouterr().err


def test_every_command_refuses_what_it_cannot_use_before_it_runs(tmp_path, capsys):
    """serve's seed, bench's trace options (named as options, before the server is asked anything),
    course build's folders, and a checkpoint whose weights file is no safetensors."""
    from orca_lab import LLM
    bad = tmp_path / "ck"
    LLM("tiny").model.save_pretrained(bad)
    (bad / "model.safetensors").write_bytes(b"")
    unreachable = ["--base-url", "http://127.0.0.1:9", "--out", str(tmp_path)]
    for argv, words in [(["serve", "--seed", "-1"], "seed=-1 is out of range"),
                        (["bench", "--n-requests", "0", *unreachable], "n_requests=0 is out of range"),
                        (["bench", "--dataset", "fixed", "--output-len", "0", *unreachable], "--output-len: gen_len=0"),
                        (["bench", "--rate", "0", *unreachable], "or inf for an offline trace"),
                        (["course", "build", "--executed", str(tmp_path / "none")], "no such folder"),
                        (["course", "build", "--executed", str(tmp_path)], "none of the chosen chapters"),
                        (["compare", "--checkpoint", str(bad)], "model.safetensors is not a safetensors file")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err, argv


def test_serve_refuses_an_address_it_cannot_take_and_a_folder_that_is_no_checkpoint(tmp_path, capsys):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, words in {("--port", "70000"): "port=70000 is out of range: allowed [0, 65535]",
                             ("--port", str(port)): f"--port {port}: cannot listen there (Address already in use)",
                             ("--model", str(tmp_path)): f"--model {tmp_path}: {tmp_path} is not a checkpoint"}.items():
            with pytest.raises(SystemExit) as e:
                main(["serve", *flags])
            assert e.value.code == 2 and words in capsys.readouterr().err, flags


def test_the_baseline_delivers_at_batch_end_and_its_held_rows_are_not_useful_tokens():
    """ft: request A (1 token) is held while B (5 tokens) runs; both reach the client when the batch
    ends. Useful tokens per iteration are the same for both systems; only ft computes held rows."""
    from orca_lab import LLM, EngineConfig
    from orca_lab.metrics import summarize
    from orca_lab.workload import TraceItem

    llm = LLM("tiny", engine=EngineConfig(max_bs=4, n_slots=4096))
    trace = [TraceItem(0.0, (1, 2, 3), 1), TraceItem(0.0, (4, 5, 6), 5)]
    runs = {s: llm.serve(trace, system=s) for s in ("orca", "ft")}
    rows = {s: summarize(r) for s, r in runs.items()}
    assert rows["orca"]["tokens_per_iteration"] == rows["ft"]["tokens_per_iteration"] == (6 + 4) / 5
    assert rows["orca"]["wasted_rows_per_iteration"] == 0 and rows["ft"]["wasted_rows_per_iteration"] == 4 / 5
    ft_a, ft_b = runs["ft"].requests
    assert ft_a.t_first_token == ft_a.t_finish == ft_b.t_first_token == ft_b.t_finish
    orca_a, orca_b = runs["orca"].requests
    assert orca_a.t_first_token == orca_a.t_finish < orca_b.t_finish and orca_b.t_first_token < orca_b.t_finish
    assert [r.output for r in runs["ft"].requests] == [r.output for r in runs["orca"].requests]
