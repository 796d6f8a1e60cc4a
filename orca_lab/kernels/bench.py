"""Benchmark of the selective-batching kernels against their roofline and against the alternatives.

    python -m orca_lab.kernels.bench [--quick] [--out results/kernels_bench.json]

For each kernel: time, achieved GB/s and TFLOP/s, and the roofline floor ``max(bytes / bandwidth,
FLOPs / matmul rate)`` with both peaks measured in the same run (a large copy, a large matmul).
Attention is timed as the engine runs it (``triton``: the decode kernel for one-token requests,
the ragged kernel for the rest, fresh prompts reading the step's own keys contiguously, through the
Tensor Memory Accelerator where the GPU has one, with the iteration's plan built before timing as
the engine builds it once per iteration), with every key read through its slot id
(``triton-slots``), with the ragged kernel alone (``triton-ragged``), the FasterTransformer way
(requests padded to ``[B, L, H, D]``, one dense masked SDPA) and as a per-request SDPA loop (the torch
backend), in a decode phase (many requests, one new token each, long contexts) and a prefill phase
(whole prompts). The prefill phase adds PyTorch's fused causal SDPA over the padded batch
(``sdpa-causal``: on a CUDA GPU FlashAttention-2's kernel, the rate a vendor kernel reaches at this
shape). Every implementation's output is checked against the first's before timing (the padded
ones on their real rows), so a table never times a wrong answer. The first call of each is untimed:
it compiles, and on a GPU tunes the launch.

Two times per row. ``ms`` (the roofline's) is the device's: on a GPU, CUDA events around calls
queued back to back, so the host prepares the next launch while the device runs this one, as an
engine's layers are queued (a call's Python shows only where it outlasts its kernel); without a GPU,
the wall time. ``wall ms`` is one call waited for alone, host and launch latency included: what a
caller that synchronizes on every call sees. The peaks are timed the same way as the kernels.

Without a GPU the Triton kernels run in Triton's interpreter: sizes are small (``--quick`` is the
default there) and those timings say nothing about speed; the table marks them "interpreted".
"""
import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from orca_lab.kernels import _backend  # noqa: F401  (sets TRITON_INTERPRET before triton loads)
from orca_lab.kernels import bias_gelu, layer_norm, ragged_attention, write_kv
from orca_lab.kernels.attention import causal_mask, ragged_attention_triton, triton_plan, tuned_launches
from orca_lab.environment import environment

import triton  # noqa: E402

# Sizes per mode: GPT-3 13B shapes (40 heads of 128, hidden 5120) on a GPU; toys otherwise.
SIZES = {
    "full": dict(heads=40, head_size=128, decode_batch=64, decode_ctx=2048, prefill_batch=4,
                 prefill_len=2048, tokens=4096, hidden=5120, copy_mib=1024, matmul_n=8192),
    "quick": dict(heads=2, head_size=64, decode_batch=8, decode_ctx=128, prefill_batch=2,
                  prefill_len=48, tokens=64, hidden=256, copy_mib=64, matmul_n=1024),
    "tiny": dict(heads=1, head_size=16, decode_batch=2, decode_ctx=20, prefill_batch=1,
                 prefill_len=16, tokens=8, hidden=32, copy_mib=4, matmul_n=128),
}
GELU_FLOPS_PER_ELEMENT = 12  # bias add, cube, fma, scalings, sigmoid (exp, add, divide), product
LN_FLOPS_PER_ELEMENT = 8     # (residual add,) mean, centre, square-accumulate, normalize, scale, shift


# ------------------------------------------------------------------------------------- timing
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


QUEUED = 10   # calls per CUDA-event interval: enough to keep the device busy while the host queues
TIMING = {"cuda": f"time_ms: CUDA events around {QUEUED} calls queued back to back; wall_ms: one call "
                  "waited for alone", "cpu": "time_ms = wall_ms: one call's wall time"}


def time_ms(fn, device, reps, warmup=1):
    """``(device ms, wall ms)`` of ``fn()``, medians over ``reps``: the wall time of one call waited
    for alone, and on a GPU the device's time per call over ``QUEUED`` calls queued back to back
    between two CUDA events (without a GPU the two are the same)."""
    for _ in range(warmup):
        fn()
    walls, queued = [], []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        walls.append((time.perf_counter() - start) * 1e3)
        if device.type == "cuda":
            queued.append(_queued_ms(fn))
    wall = statistics.median(walls)
    return (statistics.median(queued) if queued else wall), wall


def _queued_ms(fn):
    """Device ms per call of ``fn`` over ``QUEUED`` calls issued without waiting, between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(QUEUED):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / QUEUED


def measure_peaks(device, dtype, size, reps):
    """Memory bandwidth from a large copy (read + write) and the matmul rate of a large matmul."""
    src = torch.randn(size["copy_mib"] * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    copy_ms, _ = time_ms(lambda: dst.copy_(src), device, reps)
    n = size["matmul_n"]
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    mm_ms, _ = time_ms(lambda: torch.matmul(a, b), device, reps)
    return {"bandwidth_GBps": 2 * src.numel() * 4 / copy_ms / 1e6,
            "matmul_TFLOPs": 2 * n**3 / mm_ms / 1e9, "matmul_dtype": str(dtype).replace("torch.", ""),
            "copy_MiB": size["copy_mib"], "matmul_n": n}


# ------------------------------------------------------------------------------------ attention
def attention_case(q_lens, kv_lens, heads, head_size, dtype, device):
    """A ragged batch in a shuffled slot pool; the step's new keys and values as the engine has them
    (views of a fused ``[T, 3, H, D]`` projection, equal to the last ``q_len`` keys of each request);
    and the same batch padded as FasterTransformer keeps it."""
    n_keys = sum(kv_lens)
    q = torch.randn(sum(q_lens), heads, head_size, device=device, dtype=dtype)
    k_pool, v_pool = (torch.randn(n_keys, heads, head_size, device=device, dtype=dtype) for _ in range(2))
    slot_ids = torch.randperm(n_keys, device=device).int()
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device=device)
    args = (q, k_pool, v_pool, slot_ids, cu(q_lens), cu(kv_lens))
    new = torch.cat([slot_ids[end - lq:end] for lq, end in zip(q_lens, args[5].tolist()[1:])]).long()
    proj = torch.stack([q, k_pool[new], v_pool[new]], dim=1)
    return args, (proj[:, 1], proj[:, 2]), padded_case(args, q_lens, kv_lens)


def padded_case(args, q_lens, kv_lens):
    """FasterTransformer's layout: every request padded to the longest, K/V in a dense per-request
    cache, one mask for padding and causality. Built outside the timed region (favours FT)."""
    q, k_pool, v_pool, slot_ids, cu_q, cu_k = args
    B, Lq, Lk = len(q_lens), max(q_lens), max(kv_lens)
    H, D = q.shape[1:]
    qp = q.new_zeros(B, H, Lq, D)
    kp, vp = q.new_zeros(B, H, Lk, D), q.new_zeros(B, H, Lk, D)
    mask = torch.zeros(B, 1, Lq, Lk, dtype=torch.bool, device=q.device)
    for b, (lq, lk) in enumerate(zip(q_lens, kv_lens)):
        slots = slot_ids[cu_k[b]:cu_k[b + 1]].long()
        qp[b, :, :lq] = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
        kp[b, :, :lk], vp[b, :, :lk] = k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1)
        mask[b, 0, :lq, :lk] = causal_mask(lq, lk, q.device)
    mask[:, :, :, 0] = True  # padded query rows see key 0, so no row is all -inf (NaN)
    return qp, kp, vp, mask


def attention_cost(q_lens, kv_lens, heads, head_size, elem):
    """Useful work only: visible (query, key) pairs, and each tensor moved once."""
    pairs = sum(q * (k - q) + q * (q + 1) // 2 for q, k in zip(q_lens, kv_lens))
    flops = 4 * pairs * heads * head_size                        # QK^T and PV, 2 FLOPs per MAC
    bytes_ = (2 * sum(q_lens) + 2 * sum(kv_lens)) * heads * head_size * elem + 4 * sum(kv_lens)
    return bytes_, flops


def bench_attention(phase, q_lens, kv_lens, size, dtype, device):
    H, D = size["heads"], size["head_size"]
    args, new, (qp, kp, vp, mask) = attention_case(q_lens, kv_lens, H, D, dtype, device)
    step = dict(zip("kv", new))
    cu_q, cu_k = (args[i].tolist() for i in (4, 5))
    plans = {decode: triton_plan(cu_q, cu_k, device, decode=decode) for decode in (True, False)}
    scale = 1 / math.sqrt(D)
    impls = {   # triton: as the engine calls it (fresh prompts read the step's k, v contiguously)
        "triton": lambda: ragged_attention_triton(*args, scale, plans[True], **step),
        "triton-slots": lambda: ragged_attention_triton(*args, scale, plans[True]),   # every key by slot id
        "triton-ragged": lambda: ragged_attention_triton(*args, scale, plans[False], **step),
        "sdpa-loop": lambda: ragged_attention(*args, backend="torch"),
        "padded-ft": lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask),
    }
    if q_lens == kv_lens:    # whole prompts: a causal mask is each request's own, its padding trailing
        impls["sdpa-causal"] = lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
    check_agree(impls, q_lens, dtype)
    bytes_, flops = attention_cost(q_lens, kv_lens, H, D, dtype.itemsize)
    sizes = dict(phase=phase, batch=len(q_lens), q_len=max(q_lens), kv_len=max(kv_lens), heads=H,
                 head_size=D)
    return [("ragged_attention", phase, impl, fn, bytes_, flops, sizes) for impl, fn in impls.items()]


def check_agree(impls, q_lens, dtype):
    """Each implementation's output against the first's (``[T, H, D]``; a padded ``[B, H, L, D]`` one
    on its real rows), within what the dtype's rounding allows (a few units in the last place of
    16-bit outputs, relative to their size: a wrong answer misses by far more, and a spurious failure
    would cost a GPU window its table); raises naming the one that differs and by how much."""
    tol = 1e-4 if dtype == torch.float32 else 5e-2     # bf16 keeps 8 significant bits: 2^-7 = 0.008
    ref = None
    for name, fn in impls.items():
        out = fn().float()
        if out.dim() == 4:
            out = torch.cat([out[b, :, :n].transpose(0, 1) for b, n in enumerate(q_lens)])
        if ref is None:
            ref, ref_name = out, name
            continue
        excess = ((out - ref).abs() - tol * (1 + ref.abs())).max().item()
        if not excess <= 0:
            raise AssertionError(f"bench: {name} differs from {ref_name} by {excess:.3g} more than "
                                 f"{tol:g} x (1 + |{ref_name}|) allows")


# ----------------------------------------------------------------------------- token-wise ops
def bench_token_ops(size, dtype, device):
    T, N, H, D = size["tokens"], size["hidden"], size["heads"], size["head_size"]
    e = dtype.itemsize
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)
    x, r, w, b = rand(T, N), rand(T, N), rand(N), rand(N)
    h, hb = rand(T, 4 * N), rand(4 * N)
    k, v = rand(T, H, D), rand(T, H, D)
    k_pool, v_pool = rand(2 * T, H, D), rand(2 * T, H, D)
    slots = torch.randperm(2 * T, device=device)[:T].int()
    ops = [
        ("write_kv", "decode+prefill", lambda impl: write_kv(k, v, k_pool, v_pool, slots, backend=impl),
         4 * T * H * D * e + 4 * T, 0, dict(tokens=T, heads=H, head_size=D)),
        ("layer_norm", "residual", lambda impl: layer_norm(x, w, b, residual=r, backend=impl),
         4 * T * N * e + 2 * N * e, LN_FLOPS_PER_ELEMENT * T * N, dict(tokens=T, hidden=N)),
        ("bias_gelu", "mlp", lambda impl: bias_gelu(h, hb, backend=impl),
         2 * T * 4 * N * e + 4 * N * e, GELU_FLOPS_PER_ELEMENT * T * 4 * N, dict(tokens=T, width=4 * N)),
    ]
    cases = []
    for kernel, case, op, bytes_, flops, sizes in ops:
        for impl in ("triton", "torch"):
            cases.append((kernel, case, impl, lambda op=op, impl=impl: op(impl), bytes_, flops, sizes))
    return cases


# ---------------------------------------------------------------------------------------- main
def run(mode, reps, device, each=None):
    """The peaks and a row per timed case; ``each(peaks, rows)`` after every row (a run cut by a time
    limit keeps the rows it timed)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = SIZES[mode]
    peaks = measure_peaks(device, dtype, size, reps)
    B, L = size["decode_batch"], size["decode_ctx"]
    P, Lp = size["prefill_batch"], size["prefill_len"]
    cases = (bench_attention("decode", [1] * B, [L - 37 * i % (L // 2) for i in range(B)], size,
                             dtype, device)
             + bench_attention("prefill", [Lp - 5 * i for i in range(P)], [Lp - 5 * i for i in range(P)],
                               size, dtype, device)
             + bench_token_ops(size, dtype, device))
    rows = []
    for kernel, case, impl, fn, bytes_, flops, sizes in cases:
        ms, wall = time_ms(fn, device, reps)
        floor = max(bytes_ / peaks["bandwidth_GBps"] / 1e6, flops / peaks["matmul_TFLOPs"] / 1e9)
        rows.append(dict(kernel=kernel, case=case, impl=impl, sizes=sizes, dtype=str(dtype)[6:],
                         bytes=bytes_, flops=flops, time_ms=ms, wall_ms=wall, GBps=bytes_ / ms / 1e6,
                         TFLOPs=flops / ms / 1e9, floor_ms=floor, roofline_frac=floor / ms,
                         interpreted=impl.startswith("triton") and device.type != "cuda"))
        if each is not None:
            each(peaks, rows)
    return peaks, rows


def print_table(peaks, rows, device_name):
    print(f"device: {device_name}   measured peaks: {peaks['bandwidth_GBps']:.1f} GB/s copy, "
          f"{peaks['matmul_TFLOPs']:.2f} TFLOP/s {peaks['matmul_dtype']} matmul")
    print(f"{'kernel':<17}{'case':<15}{'impl':<14}{'ms':>10} {'wall ms':>10} {'GB/s':>10} {'TFLOP/s':>10} "
          f"{'floor ms':>10} {'% roof':>9}")
    for r in rows:
        note = "  interpreted: not a speed" if r["interpreted"] else ""
        print(f"{r['kernel']:<17}{r['case']:<15}{r['impl']:<14}{r['time_ms']:>10.4g} {r['wall_ms']:>10.4g} "
              f"{r['GBps']:>10.3g} {r['TFLOPs']:>10.3g} {r['floor_ms']:>10.3g} {100 * r['roofline_frac']:>8.3g}%{note}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (the default without a GPU)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes, for a smoke test")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    parser.add_argument("--out", default="results/kernels_bench.json", help="JSON output path")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default 1 without a GPU: at these small sizes "
                             "thread start-up dominates, and on a busy machine it costs 100x)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = args.threads or (1 if device.type == "cpu" else torch.get_num_threads())
    if threads < 1:
        parser.error(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    mode = "tiny" if args.tiny else "quick" if args.quick or device.type != "cuda" else "full"
    env = environment()
    device_name = env["cuda"] or f"{env['processor']} CPU ({env['cpu_count']} cores)"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def report(peaks, rows, complete=False):
        result = dict(device=device_name, device_type=device.type, torch=torch.__version__,
                      triton=triton.__version__, interpreted=device.type != "cuda", mode=mode,
                      cpu_threads=threads, complete=complete, environment=env, timing=TIMING[device.type],
                      sizes=SIZES[mode], peaks=peaks, results=rows, tuned=tuned_launches())
        out.write_text(json.dumps(result, indent=2))
        return result

    peaks, rows = run(mode, args.reps, device, each=report)
    print_table(peaks, rows, device_name)
    result = report(peaks, rows, complete=True)
    for t in result["tuned"]:
        print(f"tuned {t['kernel']} {' '.join(t['bucket'])}: {t['config']}"
              + (" (timed by an earlier process on this GPU)" if t["recalled"] else ""))
        for cfg, ms in sorted(t["timed_ms"].items(), key=lambda kv: kv[1]):
            print(f"    {ms:9.4f} ms  {cfg}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
