"""scripts/gpu_check.sh without a GPU: it parses, plans the issue's steps, and refuses cleanly; its
Python helpers on small inputs. The script itself runs on a CUDA machine (docs/results/README.md)."""
import importlib.util
import json
import re
import shutil
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


def test_the_dry_run_plans_the_lent_window_by_value_each_step_under_a_limit():
    """Figure 9, the step times and Figure 10 first, then kernels, workers, then the CUDA tests with aot
    beside them; each limit at least its prediction; each part one call of at most 10 minutes, 12.5
    minutes in all (15 are lent, the machine's start and the transfers included)."""
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = [re.match(r"\[(\w+)\] part (\d): predicted (\d+) s, limit (\d+) s, ends by (\d+) s", line)
            for line in proc.stdout.splitlines() if line.startswith("[")]
    assert all(rows), proc.stdout
    steps = [(r[1], int(r[2])) for r in rows]
    assert steps == [("setup", 1), ("smoke", 1), ("fig9", 1), ("step_time", 1), ("fig10", 1), ("bench", 1),
                     ("workers", 1), ("setup_part2", 2), ("tests", 2)]
    predicted, limits, ends = ([int(r[i]) for r in rows] for i in (3, 4, 5))
    assert all(p <= lim for p, lim in zip(predicted, limits)) and ends[-1] <= 750
    part1 = sum(lim for (_, part), lim in zip(steps, limits) if part == 1)
    assert part1 <= ends[6] <= 600 and ends[-1] - ends[6] <= 600
    assert f"total: predicted {sum(predicted)} s, limits {sum(limits)} s" in proc.stdout and sum(limits) <= 750
    out = proc.stdout
    assert "-m pytest" in out and "-n 8" in out and "kernels.aot --full" in out and "-m orca_lab.kernels.bench" in out
    assert "gpu_check.py workers" in out and "fig9-compare" in out and "benchmarks/step_time.py --model gpt3-13b" in out
    assert "gpu_check.py smoke" in out and '[ -f "$OUT/tma_off" ] && [ "$PART" != 2 ] && export ORCA_LAB_TMA=0' in \
        SCRIPT.read_text()
    assert "reproduce/fig_e2e.ipynb" in out and "-p mode measure" in out and '-p budget_s "$FIG10_BUDGET"' in out
    assert "--device cuda --dtype bfloat16 --out docs/results/gpu_example_gpu/step_time.json" in out
    for bad in (["--bogus"], ["--part", "3"]):
        assert subprocess.run(["bash", str(SCRIPT), *bad], capture_output=True).returncode == 2


@pytest.mark.skipif(ON_GPU, reason="the fake python stands in for a CUDA machine's")
def test_the_two_parts_packs_unpack_into_one_folder_with_no_file_of_an_earlier_run(tmp_path):
    """The script's bookkeeping, its steps run by a python that answers yes to everything: part 2 adds
    to part 1's folder only where part 1's files still are; where the device tool's copy of the
    working tree put the committed folder back between the calls, part 2 empties it, and its pack holds
    its own files, named apart from part 1's (steps_part2.txt, setup_part2.log)."""
    import tarfile
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$*" in *slug*) echo fake ;; *sim-device*) echo none ;; esac\nexit 0\n')
    fake.chmod(0o755)
    out, pack = tmp_path / "gpu_fake", tmp_path / "pack"
    pack.mkdir()
    run_id = Path("/tmp/gpu_check_run_id")
    saved = run_id.read_bytes() if run_id.exists() else None
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "OUT_DIR": str(out), "PACK_TO": str(pack)}

    def part(n, steps):
        proc = subprocess.run(["bash", str(SCRIPT), "--part", n], capture_output=True, text=True, timeout=120,
                              env={**env, "STEPS": steps}, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        with tarfile.open(pack / "gpu_results.tgz") as tar:
            return {Path(m).name for m in tar.getnames() if m != str(out).lstrip("/")}

    try:
        out.mkdir()
        (out / "stale.json").write_text("{}")                  # a committed run's file
        first = {"setup.log", "nvidia_smi.txt", "bench.log", "steps.txt"}
        second = {"setup_part2.log", "nvidia_smi_part2.txt", "steps_part2.txt"}
        assert part("1", "setup bench") == first
        assert part("2", "setup_part2") == first | second
        shutil.rmtree(out)                                      # the tree copied anew between the calls
        out.mkdir()
        (out / "stale.json").write_text("{}")
        assert part("2", "setup_part2") == second
        assert [line.split()[0] for line in (pack / "steps_part2.txt").read_text().splitlines()] == ["setup_part2"]
    finally:
        run_id.write_bytes(saved) if saved is not None else run_id.unlink(missing_ok=True)


def test_the_wheels_to_carry_are_what_the_gpu_image_lacks_at_the_locks_versions(capsys):
    h = load_helpers()
    lock = dict(line.split("==") for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines()
                if re.match(r"^[a-z0-9]", line, re.I))
    got = dict(w.split("==") for w in h.wheels())
    for name in ("papermill", "ipykernel", "plotly", "fastapi", "opentelemetry-api", "pyzmq", "nbclient", "jupyter-client"):
        assert got[name] == lock[name], name
    assert not {"torch", "triton", "numpy", "pandas", "scipy", "transformers", "pytest"} & set(got)
    assert h.main(["wheels"]) == 0
    cmd = capsys.readouterr().out
    assert "pip download --no-deps --only-binary=:all: --python-version 3.12" in cmd and "papermill==" in cmd


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


def test_the_smoke_step_runs_each_tma_tile_against_the_reference_and_turns_the_path_off_if_one_fails(
        tmp_path, monkeypatch):
    """A tile that answers like the reference keeps the TMA on; one that answers otherwise (or
    raises) is recorded with its symptom, and ``tma_off`` tells the steps after to read through pointers."""
    import torch
    from dataclasses import replace
    from orca_lab.kernels import attention
    h, tile = load_helpers(), replace(attention.INTERPRETER_PREFILL, tma=True)
    assert h.smoke(tmp_path / "ok", "tiny", torch.float32, [tile])
    assert not (tmp_path / "ok" / "tma_off").exists()
    launched = attention.ragged_attention_triton
    monkeypatch.setattr(attention, "ragged_attention_triton", lambda *a, **kw: launched(*a, **kw) + 1)
    assert not h.smoke(tmp_path / "wrong", "tiny", torch.float32, [tile])
    assert "differs from reference" in (tmp_path / "wrong" / "tma_off").read_text()
    monkeypatch.setattr(attention, "ragged_attention_triton", launched)
    assert h.main(["smoke", str(tmp_path / "here")]) == 0        # this machine's tiles: the interpreter's here
    assert json.loads((tmp_path / "here" / "smoke.json").read_text())["tma"]
