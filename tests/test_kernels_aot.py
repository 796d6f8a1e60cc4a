"""Every Triton kernel compiles for an A100 (sm_80) and an H100 (sm_90), on a machine with neither.

The kernel tests run here in Triton's interpreter, which accepts code the GPU compiler refuses and
knows nothing of shared memory. ``python -m orca_lab.kernels.aot`` compiles every launch the
wrappers can make (each kernel module declares them in ``aot_launches()``) to a cubin and compares
its shared memory with the device's limit per block. It runs in a subprocess with
``TRITON_INTERPRET=0``: interpreted kernels cannot be compiled. Triton's on-disk cache makes a second
run on the same machine fast.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from orca_lab.kernels.aot import DEFAULT_TARGETS, SHARED_LIMITS  # noqa: E402
from orca_lab.kernels.attention import MERGE_CHUNK, prefill_candidates  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "aot_fixtures"
KERNELS = {"orca_lab.kernels.attention._ragged_attention_kernel", "orca_lab.kernels.kv_write._write_kv_kernel",
           "orca_lab.kernels.layernorm._layer_norm_kernel", "orca_lab.kernels.gelu._bias_gelu_kernel",
           "orca_lab.kernels.rmsnorm._rms_norm_kernel", "orca_lab.kernels.activation._silu_and_mul_kernel",
           "orca_lab.kernels.rotary._rotary_kernel"}


def run(args, interpret="0", timeout=900):
    env = {**os.environ, "TRITON_INTERPRET": interpret, "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(FIXTURES), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    proc = run(["-m", "orca_lab.kernels.aot", "--json", str(out)])
    return proc, (json.loads(out.read_text()) if out.exists() else [])


def test_every_kernel_compiles_for_a100_and_h100_within_shared_memory(compiled):
    proc, rows = compiled
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert {r["kernel"] for r in rows} >= KERNELS
    assert {r["arch"] for r in rows} == set(DEFAULT_TARGETS) == {80, 90}
    for r in rows:
        assert "error" not in r and r["cubin_bytes"] > 0, r
        assert 0 <= r["shared"] <= SHARED_LIMITS[r["arch"]], r
    # the same launches for both GPUs, but the TMA's (an H100's and later only)
    per_arch = [sorted((r["kernel"], r["what"]) for r in rows if r["arch"] == a) for a in (80, 90)]
    tma = sorted((r["kernel"], r["what"]) for r in rows if r["constexprs"].get("TMA") == "True")
    assert tma and per_arch[0] == sorted(set(per_arch[1]) - set(tma))
    attention = [r for r in rows if r["kernel"].endswith("_ragged_attention_kernel")]
    assert max(r["shared"] for r in attention) > 0     # its dots stage tiles in shared memory


def test_grouped_query_launches_compile_for_a100_and_h100(compiled):
    """Llama's attention at head size 128 and groups 1, 4 and 8 (CI's subset, bf16): the decode kernel
    holding a K/V head's whole group (GROUPED, BLOCK_H = group), and the ragged kernel with the group
    a runtime argument (groups 4 and 8 type the same and share one cubin; group 1 is a constant, as
    in GPT's launches)."""
    _, rows = compiled
    for arch in (80, 90):
        decode = [r for r in rows if r["arch"] == arch and r["kernel"].endswith("_decode_attention_kernel")
                  and r["signature"]["q_ptr"] == "*bf16" and r["constexprs"]["BLOCK_D"] == "128"]
        grouped = {(r["constexprs"]["GROUPED"], r["constexprs"]["BLOCK_H"]) for r in decode}
        assert {("True", "4"), ("True", "8"), ("False", "2")} <= grouped, grouped
        assert any("32 heads of 128" in r["what"] for r in decode)                      # group 1
        prefill = [r for r in rows if r["arch"] == arch and r["kernel"].endswith("_ragged_attention_kernel")
                   and r["signature"]["q_ptr"] == "*bf16" and r["constexprs"]["BLOCK_D"] == "128"]
        assert {r["signature"]["group"] for r in prefill} == {"i32", "constexpr"}
        assert all(r["shared"] <= SHARED_LIMITS[arch] and "error" not in r for r in decode + prefill)


def test_prefill_prefetches_kv_and_the_h100_default_does_not_spill(compiled):
    """The ragged kernel's K/V tiles are copied into shared memory ahead of their step: at 3 stages or
    more a wait leaves the next block's K and V copies in flight (the slots of a block are loaded a
    step earlier; loaded in the same step, every copy was waited for at once; the TMA's copies too).
    H100's default tile at GPT-3's bf16 head size fits its registers (nothing spilled to the stack),
    and so do the TMA tiles for fresh prompts, FlashAttention's 128 x 128 at 3 stages included, in
    fewer registers than the same tiles read through pointers."""
    _, rows = compiled
    default = prefill_candidates(128, 2, arch=90)[0]
    for arch in (80, 90):
        prefill = [r for r in rows if r["arch"] == arch and r["kernel"].endswith("_ragged_attention_kernel")
                   and r["signature"]["q_ptr"] == "*bf16"]
        staged = [r for r in prefill if r["num_stages"] >= 3]
        assert staged and all(r["in_flight"] >= 2 for r in staged), [(r["what"], r["in_flight"]) for r in prefill]
    h100 = [r for r in rows if r["arch"] == 90 and r["kernel"].endswith("_ragged_attention_kernel")
            and r["signature"]["q_ptr"] == "*bf16" and r["constexprs"]["BLOCK_D"] == "128"
            and (int(r["constexprs"]["BLOCK_M"]), int(r["constexprs"]["BLOCK_N"]), r["num_warps"],
                 r["num_stages"]) == (default.block_m, default.block_n, default.num_warps, default.num_stages)]
    assert h100 and all(r.get("stack_bytes", 0) == 0 for r in h100), h100
    fresh = {(r["constexprs"]["TMA"], r["constexprs"]["BLOCK_M"], r["constexprs"]["BLOCK_N"], r["num_stages"]): r
             for r in rows if r["arch"] == 90 and r["kernel"].endswith("_ragged_attention_kernel")
             and r["constexprs"]["FRESH"] == "True" and r["signature"]["q_ptr"] == "*bf16"}
    boxes = {k: r for k, r in fresh.items() if k[0] == "True"}
    assert {k[1:] for k in boxes} == {("128", "64", 3), ("128", "128", 3)}, fresh.keys()   # CI's: default, widest
    for (_, m, n, stages), r in boxes.items():
        assert r["stack_bytes"] == 0 and r["in_flight"] >= 2 and r["shared"] <= SHARED_LIMITS[90], r
    pointers = fresh[("False", "128", "64", 3)]
    assert boxes[("True", "128", "64", 3)]["registers"] < pointers["registers"]


@pytest.fixture(scope="module")
def declared(tmp_path_factory):
    """Every declared launch (what ``--full`` compiles), typed, and whether CI's subset compiles it."""
    out = tmp_path_factory.mktemp("aot") / "declared.json"
    proc = run(["-m", "orca_lab.kernels.aot", "--list", "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_every_prefill_candidate_at_gpt3_shapes_is_declared_and_ci_compiles_the_widest(declared):
    """Every configuration the tuner may pick for head size 128 in bf16 (GPT-3's) is a declared
    launch (``--full`` compiles them all); CI's subset compiles some of each dtype."""
    rows = [r for r in declared if r["kernel"].endswith("_ragged_attention_kernel")]
    paper = [r for r in rows if r["what"].endswith("torch.bfloat16") and r["constexprs"]["BLOCK_D"] == "128"]
    seen = {(int(r["constexprs"]["BLOCK_M"]), int(r["constexprs"]["BLOCK_N"]), r["num_warps"], r["num_stages"],
             r["constexprs"]["TMA"] == "True") for r in paper}
    assert seen == {(c.block_m, c.block_n, c.num_warps, c.num_stages, c.tma)
                    for fresh in (False, True) for c in prefill_candidates(128, 2, fresh=fresh)}
    assert all(r["min_arch"] == (90 if r["constexprs"]["TMA"] == "True" else 0) for r in rows)
    # fresh prompts (keys read from the step's k, v) compile apart, and CI compiles some at GPT-3's shape,
    # through pointers and through the TMA
    assert {(r["constexprs"]["FRESH"], r["constexprs"]["TMA"]) for r in paper if r["ci"]} == {
        ("False", "False"), ("True", "False"), ("True", "True")}
    ci = [r for r in rows if r["ci"]]
    assert {r["what"].split(", ")[-1] for r in ci} == {"torch.float32", "torch.float16", "torch.bfloat16"}
    assert len(rows) > 10 * len(ci)


def test_one_merge_compile_serves_any_split_count(declared):
    """The FlashDecoding merge reads MERGE_CHUNK splits a step, so the 4096 splits of a 1M-token
    context compile as few do: as GPT-3's heads type (bf16, 128 wide, several heads), two merges (a
    split count that is a multiple of 16 and one that is not), both at the most splits a context has."""
    merges = [r for r in declared if r["kernel"].endswith("_decode_reduce_kernel")]
    assert {r["constexprs"]["BLOCK_S"] for r in merges} == {str(MERGE_CHUNK)}
    paper = [r for r in merges if r["signature"]["out_ptr"] == "*bf16" and r["constexprs"]["BLOCK_D"] == "128"
             and r["signature"]["n_heads"] == "i32" and "n_heads" not in r["divisible_by_16"]   # GPT-3's 40
             and {"head_size", "stride_ot"} <= set(r["divisible_by_16"])]
    assert sorted(r["what"].split()[2] for r in paper) == ["4095", "4096"]
    assert sorted("n_splits" in r["divisible_by_16"] for r in paper) == [False, True]
    # it reads fp32 partials whatever the model's dtype: CI compiles it writing each dtype
    assert {r["signature"]["out_ptr"] for r in merges if r["ci"]} == {"*fp32", "*fp16", "*bf16"}


def _torch_name(dtype):
    return {"fp32": "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16"}[dtype]


def test_a_dot_with_inner_dimension_8_fails_the_check_but_runs_in_the_interpreter():
    """The interpreter's tests would pass this kernel; the GPU compiler refuses it, and so does the check."""
    proc = run(["-m", "orca_lab.kernels.aot", "--modules", "broken_kernels", "--jobs", "1"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.count("FAILED broken_kernels._dot_k8") == 2            # sm_80 and sm_90
    assert "K >= 16" in proc.stdout
    interp = run(["-c", "import broken_kernels as b; print(b.interpreted_error())"], interpret="1")
    assert interp.returncode == 0, interp.stderr[-3000:]
    assert float(interp.stdout.split()[-1]) < 1e-2                             # and gets a @ b right


def test_a_kernel_without_declared_launches_is_refused():
    """A kernel added later without ``aot_launches()`` cannot slip past the check; its helper (called
    by another @triton.jit) is not a launched kernel and needs none."""
    proc = run(["-m", "orca_lab.kernels.aot", "--modules", "undeclared_kernels", "--jobs", "1"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "undeclared_kernels._undeclared_kernel" in proc.stdout and "_scaled" not in proc.stdout


def test_the_check_refuses_to_run_interpreted():
    proc = run(["-m", "orca_lab.kernels.aot", "--modules", "broken_kernels"], interpret="1")
    assert proc.returncode == 2 and "TRITON_INTERPRET=0" in proc.stderr


def test_launches_are_typed_as_the_launcher_types_them(declared):
    """Pointers by dtype, 16-divisible ints and pointers marked, an int equal to 1 made a constant:
    what a launch on a GPU would compile, not a looser or stricter variant."""
    attention = [r for r in declared if r["kernel"].endswith("_ragged_attention_kernel")]
    aligned = next(r for r in attention if r["what"].endswith("bfloat16") and r["constexprs"]["BLOCK_D"] == "128"
                   and r["signature"]["head_size"] == "i32" and "head_size" in r["divisible_by_16"])   # 128
    odd = next(r for r in attention if r["what"].endswith("float16") and r["signature"]["head_size"] == "i32"
               and "head_size" not in r["divisible_by_16"])
    assert aligned["signature"]["q_ptr"] == "*bf16" and odd["signature"]["slot_ptr"] == "*i64"
    assert aligned["signature"]["stride_qd"] == "constexpr" and aligned["constexprs"]["stride_qd"] == "1"
    assert {"q_ptr", "head_size", "stride_qh"} <= set(aligned["divisible_by_16"])
    assert "q_ptr" in odd["divisible_by_16"] and not {"head_size", "stride_qh"} & set(odd["divisible_by_16"])
