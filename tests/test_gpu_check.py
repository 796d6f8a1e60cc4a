"""scripts/gpu_check.sh without a GPU: it parses, plans the issue's steps, and refuses cleanly; its
Python helpers on small inputs. The script itself runs on a CUDA machine (docs/results/README.md)."""
import importlib.util
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from helpers import ON_GPU

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def load_helpers():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


@pytest.mark.skipif(ON_GPU, reason="on a CUDA machine the script would run its whole check")
def test_without_cuda_it_refuses_cleanly_and_writes_nothing(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "OUT_DIR": str(tmp_path / "out"),
                               "PYTHON": str(Path(__import__("sys").executable))})
    assert proc.returncode == 2
    assert "no CUDA GPU here" in proc.stderr and "bash scripts/test.sh" in proc.stderr
    assert not (tmp_path / "out").exists() and "Traceback" not in proc.stderr


def test_the_dry_run_plans_every_step_at_the_papers_shapes():
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    steps = [line.split("]")[0][1:] for line in proc.stdout.splitlines() if line.startswith("[")]
    assert steps == ["tests", "bench", "aot", "workers", "fig9", "fig10"]
    out = proc.stdout
    assert "-m pytest" in out and "-m orca_lab.kernels.bench" in out and "gpu_check.py workers" in out
    assert "fig9-compare" in out and "reproduce/fig_e2e.ipynb" in out and "-p mode measure" in out
    assert subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True).returncode == 2


def test_the_fig9_arguments_are_the_papers():
    text = SCRIPT.read_text()
    assert "-p preset gpt3-13b" in text and "batch_sizes: [1, 2, 4, 8, 16, 32]" in text
    assert "input_lens: [32, 128]" in text and "-p gen_len 32" in text


def test_device_names_map_to_directories_and_simulated_devices():
    h = load_helpers()
    assert h.slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3" and h.slug("NVIDIA A100-SXM4-40GB") == "a100_sxm4_40gb"
    assert h.sim_device("NVIDIA H100 80GB HBM3") == "h100" and h.sim_device("NVIDIA H200") == "h200"
    assert h.sim_device("NVIDIA A100-SXM4-80GB") == "a100-40gb" and h.sim_device("NVIDIA L4") is None


def test_fig9_compare_puts_measured_beside_simulated(tmp_path):
    rows = lambda t: pd.DataFrame({"system": ["orca", "ft"], "input_len": [32, 32], "batch_size": [8, 8],
                                   "time_ms": t, "oom": [False, False]})
    rows([100.0, 120.0]).to_csv(tmp_path / "m.csv", index=False)
    rows([90.0, 150.0]).to_csv(tmp_path / "s.csv", index=False)
    df = load_helpers().fig9_compare(tmp_path / "m.csv", tmp_path / "s.csv", tmp_path / "out.csv")
    got = pd.read_csv(tmp_path / "out.csv").set_index("system")
    assert got.loc["orca", "simulated_over_measured"] == pytest.approx(0.9) and len(df) == 2
    assert got.loc["ft", "measured_ms"] == 120.0 and got.loc["ft", "simulated_ms"] == 150.0
