"""The README's main job, at a tiny size."""
import json

import pytest

from orca_lab.cli import main


def test_compare_prints_a_table_and_writes_json_and_html(tmp_path, capsys):
    main(["compare", "--n-requests", "6", "--rate", "50", "--scale", "0.05", "--max-bs", "4",
          "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "orca" in out and "ft" in out and "median_norm_latency_ms" in out
    report = json.loads((tmp_path / "compare.json").read_text())
    assert {r["system"] for r in report["summary"]} == {"orca", "ft"}
    assert report["environment"]["torch"] and (tmp_path / "compare.html").stat().st_size > 10_000


def test_compare_refuses_bad_input_with_a_message(capsys):
    with pytest.raises(SystemExit) as e:
        main(["compare", "--rate", "-3"])
    assert e.value.code == 2 and "rate=-3.0" in capsys.readouterr().err
