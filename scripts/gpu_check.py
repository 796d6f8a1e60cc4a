"""The steps of ``scripts/gpu_check.sh`` that are Python: the record of the machine, the smoke test of
the copy engine's path, the workers check, and Figure 9 measured beside the simulator's prediction
for the same GPU.

    python scripts/gpu_check.py slug                      # the device's directory name, e.g. h100_80gb_hbm3
    python scripts/gpu_check.py environment OUT "COMMAND" [NAME]
    python scripts/gpu_check.py smoke OUT                 # the TMA's prefill tiles, once each; tma_off if one fails
    python scripts/gpu_check.py workers OUT
    python scripts/gpu_check.py fig9-compare MEASURED_CSV SIMULATED_CSV OUT
    python scripts/gpu_check.py sim-device                # the simulator's model of this GPU, or "none"
    python scripts/gpu_check.py wheels [--download]       # the wheels to carry to the GPU machine (.whl/)
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def slug(name: str) -> str:
    """A directory name for a device: 'NVIDIA H100 80GB HBM3' -> 'h100_80gb_hbm3'."""
    s = re.sub(r"[^a-z0-9]+", "_", name.lower().replace("nvidia", "")).strip("_")
    return s or "unknown"


def sim_device(name: str) -> str | None:
    """The simulator's model (``orca_lab.sim.cost.DEVICES``) of a CUDA device name, if it has one."""
    from orca_lab.sim.cost import model_of_gpu
    return model_of_gpu(name)


def environment(out: Path, command: str, name: str = "environment.json") -> dict:
    """Device, driver, library versions, the command and the commit: ``environment.json`` (``name``)."""
    import torch
    import triton
    from orca_lab.environment import environment as env
    record = {**env(), "command": command, "torch_cuda": torch.version.cuda, "triton": triton.__version__,
              "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
              "commit": _run(["git", "rev-parse", "HEAD"]), "dirty": bool(_run(["git", "status", "--porcelain"])),
              "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                  "--format=csv,noheader"])}
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(record, indent=1))
    return record


def _run(cmd) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


# The smoke test's batch: two fresh prompts at GPT-3 13B's heads, ends that fill no tile (a box runs
# into the next prompt's rows, and past the tensor's end)
SMOKE_LENS = (389, 512)


def smoke(out: Path, size: str | None = None, dtype=None, tiles=None) -> bool:
    """Before any step relies on it, each prefill tile that reads fresh prompts through the Tensor
    Memory Accelerator (``tiles``: those ``prefill_candidates`` offers this GPU), launched once, forced,
    on ``SMOKE_LENS`` and checked against the PyTorch reference, each synchronized so an asynchronous
    fault is this tile's. It is the path no GPU has run yet: one that fails or answers wrongly writes
    ``tma_off``, and the steps after it read fresh prompts through pointers (``ORCA_LAB_TMA=0``)
    rather than crash or mismeasure. ``smoke.json``: a row per tile. Compiling here also warms the
    Triton cache the next steps read."""
    import torch
    from orca_lab.kernels import attention, bench, ragged_attention
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    size, dtype = size or ("full" if on_gpu else "tiny"), dtype or (torch.bfloat16 if on_gpu else torch.float32)
    heads, head_size = (bench.SIZES[size][k] for k in ("heads", "head_size"))
    lens = list(SMOKE_LENS) if size == "full" else [29, 32]       # (the interpreter's: small)
    args, (k, v), _ = bench.attention_case(lens, lens, heads, head_size, dtype, device)
    plan = attention.triton_plan(*(a.tolist() for a in args[4:]), device)
    scale = head_size ** -0.5
    if tiles is None:     # (the interpreter's one tile without a GPU)
        tiles = [c for c in attention.prefill_candidates(head_size, dtype.itemsize, attention.compute_capability(0),
                                                         fresh=True) if c.tma] if on_gpu \
            else [replace(attention.INTERPRETER_PREFILL, tma=True)]
    rows = []
    for tile in tiles:
        impls = {"reference": lambda: ragged_attention(*args, backend="torch"),
                 repr(tile): lambda: attention.ragged_attention_triton(*args, scale, plan, k=k, v=v, prefill=tile)}
        try:
            bench.check_agree(impls, lens, dtype)
            bench.sync(device)
            rows.append({"tile": repr(tile), "ok": True})
        except Exception as e:  # noqa: BLE001  (any failure of the tile is the finding: recorded, path off)
            rows.append({"tile": repr(tile), "ok": False, "error": f"{type(e).__name__}: {e}"[:500]})
        print(rows[-1])
    ok = all(r["ok"] for r in rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "smoke.json").write_text(json.dumps({"lens": lens, "heads": heads, "head_size": head_size,
                                               "dtype": str(dtype), "rows": rows, "tma": ok}, indent=1))
    if not ok:
        (out / "tma_off").write_text("".join(f"{r['tile']}: {r['error']}\n" for r in rows if not r["ok"]))
        print("the TMA path failed here: the steps after this one read fresh prompts through pointers")
    return ok


def workers(out: Path) -> dict:
    """``executor="workers"`` on one GPU (a worker process, NCCL) gives the in-process engine's tokens;
    so does tensor parallelism over two GPUs where there are two. Untuned (``ORCA_LAB_TUNE=0``): every
    process then runs the same first tile of each kernel, and none spends the step's limit timing tiles."""
    os.environ["ORCA_LAB_TUNE"] = "0"
    import torch
    from orca_lab import LLM, EngineConfig
    from orca_lab.workload import paper_trace
    base = EngineConfig(max_bs=8, n_slots=8192, device="cuda", dtype="float32")
    local = LLM("gpt2", seed=0, engine=base)
    trace = paper_trace(12, rate=None, seed=0, scale=0.2, vocab_size=local.cfg.vocab_size)
    expected = [list(r.output) for r in local.serve(trace).requests]
    runs = [dict(executor="workers", tensor_parallel=1, pipeline_parallel=1)]
    if torch.cuda.device_count() >= 2:
        runs.append(dict(executor="workers", tensor_parallel=2, pipeline_parallel=1))
    rows = []
    for r in runs:
        t = time.perf_counter()
        llm = LLM(gpt=local.model, engine=base.replace(**r))
        got = [list(q.output) for q in llm.serve(trace).requests]
        rows.append({**r, "requests": len(got), "equal_to_in_process": sum(a == b for a, b in zip(got, expected)),
                     "seconds": round(time.perf_counter() - t, 2)})
        print(rows[-1])
        (out / "workers.json").write_text(json.dumps({"model": "gpt2", "dtype": "float32", "rows": rows,
                                                      "complete": len(rows) == len(runs)}, indent=1))
    return {"ok": all(r["equal_to_in_process"] == r["requests"] for r in rows), "rows": rows}


def fig9_compare(measured_csv: Path, simulated_csv: Path, out: Path):
    """Measured and simulated time per batch side by side: ``fig9_vs_sim.csv`` and a printed table."""
    import pandas as pd
    keys = ["system", "input_len", "batch_size"]
    m = pd.read_csv(measured_csv)[keys + ["time_ms", "oom"]].rename(columns={"time_ms": "measured_ms", "oom": "measured_oom"})
    s = pd.read_csv(simulated_csv)[keys + ["time_ms", "oom"]].rename(columns={"time_ms": "simulated_ms", "oom": "simulated_oom"})
    df = m.merge(s, on=keys, how="outer").sort_values(keys)
    df["simulated_over_measured"] = df["simulated_ms"] / df["measured_ms"]
    df.to_csv(out, index=False)
    print(df.round(3).to_string(index=False))
    return df


# The wheels the GPU check needs beyond the GPU machine's image: what the notebooks (papermill, a
# kernel, plotly) and the serving tests import, at the lock's versions, for its Python 3.12.
CARRY_ROOTS = ("papermill", "ipykernel", "plotly", "fastapi", "uvicorn", "pydantic", "openai", "opentelemetry-api")
# What the image already holds (its package list as read on 2026-11-17): never carried.
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize
hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader
lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnxruntime opencv-python-headless optax
opt-einsum packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pytest pytest-benchmark
pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests
rich sacrebleu safetensors scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchvision tqdm transformers triton typer typing-extensions
typing-inspect urllib3 uvloop werkzeug wheel wrapt xarray xxhash yarl zipp huggingface-hub
""".split())
PIP_DOWNLOAD = ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                "--implementation", "cp", *[f"--platform={p}" for p in (
                    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                    "manylinux1_x86_64")]]


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def lock_graph(lock: Path) -> dict:
    """``requirements/lock.txt`` as {name: (version, the names that need it)} (pip-compile's "# via")."""
    graph, name = {}, None
    for line in lock.read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9][\w.\-]*)==(\S+)", line):
            name = _name(m.group(1))
            graph[name] = (m.group(2), [])
        elif name and (m := re.match(r"^\s+#\s+(?:via\s+)?([A-Za-z0-9][\w.\-]*)\s*$", line)) and m.group(1) != "via":
            graph[name][1].append(_name(m.group(1)))
    return graph


def wheels(lock: Path = ROOT / "requirements" / "lock.txt") -> list[str]:
    """``name==version`` of ``CARRY_ROOTS`` and everything they need in the lock, less the image's."""
    graph = lock_graph(lock)
    carry = {r for r in map(_name, CARRY_ROOTS) if r in graph}
    grew = True
    while grew:
        more = {n for n, (_, parents) in graph.items() if n not in carry and n not in IMAGE and carry & set(parents)}
        carry |= more
        grew = bool(more)
    return sorted(f"{n}=={graph[n][0]}" for n in carry)


def main(argv) -> int:
    cmd, *args = argv or ["help"]
    if cmd == "slug":
        import torch
        print(slug(torch.cuda.get_device_name(0)))
    elif cmd == "sim-device":
        import torch
        print(sim_device(torch.cuda.get_device_name(0)) or "none")
    elif cmd == "environment":
        environment(Path(args[0]), *args[1:3])
    elif cmd == "smoke":
        return 0 if smoke(Path(args[0])) else 1
    elif cmd == "workers":
        return 0 if workers(Path(args[0]))["ok"] else 1
    elif cmd == "wheels":     # run here, where a registry is: the GPU machine has none
        cmd = [sys.executable, *PIP_DOWNLOAD, "-d", str(ROOT / ".whl"), *wheels()]
        print(" ".join(cmd))
        if args[:1] == ["--download"]:
            return subprocess.run(cmd).returncode
    elif cmd == "fig9-compare":
        fig9_compare(Path(args[0]), Path(args[1]), Path(args[2]))
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
