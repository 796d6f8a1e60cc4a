"""The Llama family's kernels: grouped-query attention, RMSNorm, SiLU-and-multiply, rotary embeddings.

Each PyTorch reference is checked against transformers' own Llama modules (the math a checkpoint was
trained with), then each Triton kernel against a float64 oracle by FlashAttention's rule (no worse
than twice PyTorch's error in the same dtype; ``test_kernels.assert_close_as_torch``). Inputs are
random (never zeros), with odd sizes: head size 80 in a 128 block and 13 in a 16 one, token counts
1, 7 and 33, a group of 3 query heads (not a power of two). Without a GPU the kernels run in Triton's
interpreter at small sizes; on one, fp16 and bf16 for real.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from orca_lab.kernels import (activation, apply_rotary, attention, cos_sin_cache, layernorm, ragged_attention,
                              rms_norm, rmsnorm, rope_inv_freq, rotary, silu_and_mul, write_kv)
from orca_lab import LLM
from orca_lab.config import ModelConfig
from orca_lab.kernels.attention import ragged_attention_triton, triton_plan
from helpers import DEVICE, engine_config, first_iteration_logits, random_prompts
from test_decode_attention import make_batch, oracle
from test_kernels import assert_close_as_torch, poison  # noqa: F401  (a fixture)

transformers_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
from transformers import LlamaConfig  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ------------------------------------------------------------------------- grouped-query attention
def grouped_batch(q_lens, kv_lens, heads, n_kv, head_size, dtype, seed=0):
    """``make_batch``'s ragged batch (shuffled slots) with pools of ``n_kv`` heads, and the float64
    oracle's answer, which reads K/V head ``h // group`` for query head h (transformers' repeat_kv)."""
    (q, k_pool, v_pool, *rest), cu_q, cu_k = make_batch(q_lens, kv_lens, heads, head_size, dtype, seed=seed)
    k_pool, v_pool = k_pool[:, :n_kv].contiguous(), v_pool[:, -n_kv:].contiguous()
    group = heads // n_kv
    expected = oracle(q, k_pool.repeat_interleave(group, 1), v_pool.repeat_interleave(group, 1), *rest,
                      1 / math.sqrt(head_size))
    return (q, k_pool, v_pool, *rest), cu_q, cu_k, expected


# token counts 1, 7 and 33 (prefill, partial prompt, decode over 1, 33 and 70 keys: across the
# interpreter's 32-key split)
MIXED = ([7, 1, 33, 1, 1, 5], [7, 33, 33, 1, 70, 12])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,n_kv,head_size", [(4, 2, 80), (6, 2, 13), (8, 1, 16)])
def test_grouped_attention_against_float64(poison, dtype, heads, n_kv, head_size):
    args, _, _, expected = grouped_batch(*MIXED, heads, n_kv, head_size, dtype, seed=heads + head_size)
    torch_out = ragged_attention(*args, backend="torch")
    assert_close_as_torch(ragged_attention(*args, backend="triton"), torch_out, expected, dtype)
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    assert (torch_out.double().cpu() - expected).abs().max().item() < tol      # the reference itself


def test_grouped_attention_equals_multi_head_over_repeated_heads():
    """Grouping is only a saving: the same attention as multi-head over each K/V head repeated."""
    args, _, _, _ = grouped_batch(*MIXED, 6, 2, 16, torch.float32, seed=2)
    q, k_pool, v_pool, *rest = args
    repeated = (q, k_pool.repeat_interleave(3, 1), v_pool.repeat_interleave(3, 1), *rest)
    for backend in ("torch", "triton"):
        torch.testing.assert_close(ragged_attention(*args, backend=backend),
                                   ragged_attention(*repeated, backend=backend), rtol=1e-5, atol=1e-6)


def test_each_kv_head_is_read_once_per_group(monkeypatch):
    """Both kernels launch one program column per K/V head, not per query head; the ragged kernel's
    query blocks hold (query, head) rows of the group (7 queries x 4 heads = 28 rows: two blocks of 16
    under the interpreter). On a GPU the autotuner launches each config, with its own block size:
    every launch there still has one column per K/V head (seen on an H100: 1875 launches, (1, 2) first)."""
    grids = {}
    for name in ("_ragged_attention_kernel", "_decode_attention_kernel"):
        kernel = getattr(attention, name)

        class Recorder:
            def __getitem__(self, grid, _name=name, _kernel=kernel):
                grids.setdefault(_name, []).append(grid)
                return _kernel[grid]
        monkeypatch.setattr(attention, name, Recorder())
    args, cu_q, cu_k, expected = grouped_batch([7, 1], [7, 20], 8, 2, 16, torch.float32)
    out = ragged_attention_triton(*args, 0.25, triton_plan(cu_q, cu_k, DEVICE))
    if DEVICE.type == "cpu":
        assert grids["_ragged_attention_kernel"] == [(2, 2)]             # 2 query blocks x 2 K/V heads
        assert grids["_decode_attention_kernel"] == [(1, 2, 1)]          # 1 request x 2 K/V heads
    assert {g[1] for name in grids for g in grids[name]} == {2}          # K/V heads, never query heads
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=1e-5)


def test_grouped_decode_takes_its_group_whole():
    with pytest.raises(ValueError, match="cannot hold a group of 4 query heads: block_h must be 4"):
        args, cu_q, cu_k, _ = grouped_batch([1], [3], 8, 2, 16, torch.float32)
        ragged_attention_triton(*args, 0.25, triton_plan(cu_q, cu_k, DEVICE),
                                decode=attention.DecodeConfig(2, 16, 0, 1, 1))
    assert [c.block_h for c in attention.decode_candidates(128, 64, 8)] == [8] * 12


# --------------------------------------------------------------------------------------- RMSNorm
def norm_inputs(rows, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(rows, width, generator=g).to(dtype) * 3 + 1 for _ in range(2))
    weight = (torch.rand(width, generator=g) + 0.5).to(dtype)
    return tuple(t.to(DEVICE) for t in (x, weight, residual))


def rms_oracle(x, weight, eps):
    x = x.double().cpu()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double().cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_reference_is_transformers(dtype):
    x, w, r = (t.cpu() for t in norm_inputs(7, 200, dtype))
    norm = transformers_llama.LlamaRMSNorm(200, eps=1e-5).to(dtype)
    norm.weight.data.copy_(w)
    assert torch.equal(rms_norm(x, w, 1e-5, backend="torch"), norm(x))
    y, total = rms_norm(x, w, 1e-5, residual=r, backend="torch")
    assert torch.equal(total, x + r) and torch.equal(y, norm(x + r))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,width", [(1, 200), (7, 37), (33, 64)])
def test_rms_norm(poison, dtype, rows, width):
    x, w, r = norm_inputs(rows, width, dtype, seed=width)
    assert_close_as_torch(rms_norm(x, w, 1e-6, backend="triton"), rms_norm(x, w, 1e-6, backend="torch"),
                          rms_oracle(x, w, 1e-6), dtype)
    y, total = rms_norm(x, w, 1e-6, residual=r, backend="triton")
    y_torch, total_torch = rms_norm(x, w, 1e-6, residual=r, backend="torch")
    assert torch.equal(total, total_torch)          # one rounding of x + residual, as PyTorch's
    assert_close_as_torch(y, y_torch, rms_oracle(x.double() + r.double(), w, 1e-6), dtype)


def test_rms_norm_chunked_row_and_3d_input(poison, monkeypatch):
    """A row longer than one block is walked in chunks (forced small here); leading dims flatten."""
    monkeypatch.setattr(layernorm, "MAX_BLOCK", 64)
    x, w, r = norm_inputs(6, 200, torch.float32, seed=4)
    x, r = x.view(2, 3, 200), r.view(2, 3, 200)
    y, _ = rms_norm(x, w, 1e-5, residual=r, backend="triton")
    assert_close_as_torch(y, rms_norm(x, w, 1e-5, residual=r, backend="torch")[0],
                          rms_oracle(x.double() + r.double(), w, 1e-5), torch.float32)


# --------------------------------------------------------------------------------- SiLU-and-mul
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_reference_is_transformers_mlp(dtype):
    """The fused [gate | up] projection's halves through transformers' LlamaMLP activation."""
    g = torch.Generator().manual_seed(3)
    cfg = LlamaConfig(hidden_size=24, num_attention_heads=2, intermediate_size=40, hidden_act="silu")
    mlp = transformers_llama.LlamaMLP(cfg).to(dtype)
    x = torch.randn(5, 24, generator=g).to(dtype)
    gate_up = F.linear(x, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    expected = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
    # one product of the stacked weights sums in another order than two products on some BLAS
    # builds (an H100 machine's CPU torch 2.11 differed in the last bit): equal to rounding
    torch.testing.assert_close(silu_and_mul(gate_up, backend="torch"), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2 * 37), (7, 2 * 200), (3, 11, 2 * 64)])
def test_silu_and_mul(poison, dtype, shape):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(*shape, generator=g) * 4).to(dtype).to(DEVICE)   # wide range: both sigmoid tails
    gate, up = x.double().cpu().chunk(2, dim=-1)
    oracle64 = gate * torch.sigmoid(gate) * up
    out = silu_and_mul(x, backend="triton")
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert_close_as_torch(out, silu_and_mul(x, backend="torch"), oracle64, dtype)


def test_silu_and_mul_past_one_block(poison, monkeypatch):
    monkeypatch.setattr(activation, "MAX_BLOCK", 128)
    x = torch.randn(3, 2 * 300, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    torch.testing.assert_close(silu_and_mul(x, backend="triton"), silu_and_mul(x, backend="torch"))


# -------------------------------------------------------------------------------------- rotary
def hf_rotary(cfg, x, positions):
    """transformers' own rotary: LlamaRotaryEmbedding's cos/sin, apply_rotary_pos_emb, on [T, H, D]."""
    rope = transformers_llama.LlamaRotaryEmbedding(cfg)
    cos, sin = rope(x, positions[None])
    xt = x.transpose(0, 1)[None]                             # [1, H, T, D]
    q, _ = transformers_llama.apply_rotary_pos_emb(xt, xt, cos, sin)
    return q[0].transpose(0, 1), rope.inv_freq


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["theta", "llama3"])
def test_rotary_reference_is_transformers(dtype, scaling):
    g = torch.Generator().manual_seed(7)
    cfg = LlamaConfig(hidden_size=240, num_attention_heads=3, head_dim=80, rope_theta=500000.0,
                      max_position_embeddings=512, rope_scaling=scaling)
    x = torch.randn(33, 3, 80, generator=g).to(dtype)
    positions = torch.randint(0, 512, (33,), generator=g)
    expected, inv_freq = hf_rotary(cfg, x, positions)
    if scaling is None:
        assert torch.equal(rope_inv_freq(80, 500000.0), inv_freq)
    assert torch.equal(apply_rotary(x, positions, cos_sin_cache(inv_freq, 512), backend="torch"), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,heads,head_size", [(1, 3, 80), (7, 5, 16), (33, 2, 6)])
def test_rotary(poison, dtype, tokens, heads, head_size):
    """On a strided view (q and k of a fused QKV output rotated together), positions out of order."""
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2) * head_size, generator=g).to(dtype).to(DEVICE)
    x = qkv[:, :heads * head_size].view(tokens, heads, head_size)
    positions = torch.randperm(100, generator=g)[:tokens].to(DEVICE)
    cache = cos_sin_cache(rope_inv_freq(head_size, 10000.0, DEVICE), 100)
    c64 = cache.double().cpu()[positions.cpu()]
    cos, sin = (torch.cat([h, h], -1)[:, None] for h in c64.chunk(2, -1))
    x64 = x.double().cpu()
    oracle64 = x64 * cos + rotary.rotate_half(x64) * sin
    out = apply_rotary(x, positions, cache, backend="triton")
    assert out.is_contiguous()
    assert_close_as_torch(out, apply_rotary(x, positions, cache, backend="torch"), oracle64, dtype)


def test_rotary_keeps_the_norm_and_position_zero():
    """A rotation: each head keeps its length, and position 0 leaves it as it is."""
    x = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    cache = cos_sin_cache(rope_inv_freq(32, device=DEVICE), 8)
    y = apply_rotary(x, torch.tensor([0, 5, 7], device=DEVICE), cache, backend="triton")
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(y[0], x[0]) and not torch.allclose(y[1:], x[1:])


# ---------------------------------------------------------------------------------- validation
@pytest.fixture
def no_launch(monkeypatch):
    """Validation must refuse bad input before any kernel is launched."""
    class Bomb:
        def __getitem__(self, grid):
            raise AssertionError("kernel launched before the arguments were checked")

    for module, kernel in ((rmsnorm, "_rms_norm_kernel"), (activation, "_silu_and_mul_kernel"),
                           (rotary, "_rotary_kernel"), (attention, "_ragged_attention_kernel"),
                           (attention, "_decode_attention_kernel")):
        monkeypatch.setattr(module, kernel, Bomb())


META = torch.device("meta")
CACHE = cos_sin_cache(rope_inv_freq(8), 16)
ERRORS = {
    "attention-kv-heads": (ragged_attention, dict(q=torch.randn(2, 6, 8), k_pool=torch.randn(4, 4, 8),
                                                  v_pool=torch.randn(4, 4, 8), slot_ids=torch.arange(2),
                                                  cu_seqlens_q=torch.tensor([0, 2]), cu_seqlens_k=torch.tensor([0, 2])),
                           ValueError, r"k_pool.shape\[1\] \(K/V heads\) is 4; allowed: a divisor of q's 6 heads"),
    "rms-weight-size": (rms_norm, dict(x=torch.randn(3, 8), weight=torch.ones(7), eps=1e-6), ValueError,
                        r"weight.shape\[0\] has size \(x.shape\[-1\]\) 7"),
    "rms-eps": (rms_norm, dict(x=torch.randn(3, 8), weight=torch.ones(8), eps=0.0), ValueError,
                "eps must be a positive float, got 0.0"),
    "rms-residual": (rms_norm, dict(x=torch.randn(3, 8), weight=torch.ones(8), residual=torch.randn(3, 9)),
                     ValueError, "residual.shape"),
    "silu-odd": (silu_and_mul, dict(x=torch.randn(3, 7)), ValueError, r"even last dimension.*\(3, 7\)"),
    "silu-int": (silu_and_mul, dict(x=torch.ones(3, 8, dtype=torch.int32)), TypeError, "x has dtype"),
    "rotary-odd-head": (apply_rotary, dict(x=torch.randn(2, 1, 7), positions=torch.arange(2), cos_sin_cache=CACHE),
                        ValueError, "head size is 7; allowed: a positive even number"),
    "rotary-2d": (apply_rotary, dict(x=torch.randn(2, 8), positions=torch.arange(2), cos_sin_cache=CACHE),
                  ValueError, "x must be 3-D"),
    "rotary-positions": (apply_rotary, dict(x=torch.randn(3, 1, 8), positions=torch.arange(2), cos_sin_cache=CACHE),
                         ValueError, r"len\(positions\) has length \(T\) 2, expected 3"),
    "rotary-past-cache": (apply_rotary, dict(x=torch.randn(2, 1, 8), positions=torch.tensor([3, 16]),
                                             cos_sin_cache=CACHE),
                          ValueError, r"positions holds values in \[3, 16\], allowed \[0, max_positions=16\)"),
    "rotary-cache-width": (apply_rotary, dict(x=torch.randn(2, 1, 8), positions=torch.arange(2),
                                              cos_sin_cache=cos_sin_cache(rope_inv_freq(4), 16)),
                           ValueError, r"cos_sin_cache.shape\[1\] has size \(head size\) 4, expected 8"),
    "rotary-cache-dtype": (apply_rotary, dict(x=torch.randn(2, 1, 8), positions=torch.arange(2),
                                              cos_sin_cache=CACHE.half()), TypeError, "cos_sin_cache has dtype"),
    "rotary-positions-float": (apply_rotary, dict(x=torch.randn(2, 1, 8), positions=torch.zeros(2),
                                                  cos_sin_cache=CACHE), TypeError, "positions has dtype"),
    "rotary-device": (apply_rotary, dict(x=torch.randn(2, 1, 8),
                                         positions=torch.empty(2, dtype=torch.int64, device=META),
                                         cos_sin_cache=CACHE), ValueError, "positions is on meta"),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ERRORS)
def test_llama_kernels_refuse(no_launch, backend, case):
    fn, args, error, match = ERRORS[case]
    with pytest.raises(error, match=match):
        fn(**args, backend=backend)


# -------------------------------------------------------------------- one Llama attention layer
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_llama_attention_layer_from_the_kernels_equals_transformers(backend):
    """Rotary on q and k, k and v written to a pool of n_kv_heads per slot, grouped attention over it:
    transformers' LlamaAttention (random weights, 6 query heads over 2 K/V heads of 16) on each of two
    requests alone, against both requests flattened into one selectively batched pass."""
    torch.manual_seed(9)
    cfg = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, rope_theta=10000.0,
                      max_position_embeddings=64, attn_implementation="sdpa")
    layer = transformers_llama.LlamaAttention(cfg, layer_idx=0).eval()
    rope = transformers_llama.LlamaRotaryEmbedding(cfg)
    lens = [7, 5]
    xs = [torch.randn(1, n, 96) for n in lens]
    with torch.no_grad():
        expected = torch.cat([layer(x, rope(x, torch.arange(n)[None]), None)[0][0] for x, n in zip(xs, lens)])
        x = torch.cat(xs, dim=1)[0].to(DEVICE)
        positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
        q = F.linear(x, layer.q_proj.weight.to(DEVICE)).view(-1, 6, 16)
        k = F.linear(x, layer.k_proj.weight.to(DEVICE)).view(-1, 2, 16)
        v = F.linear(x, layer.v_proj.weight.to(DEVICE)).view(-1, 2, 16)
        cache = cos_sin_cache(rope.inv_freq.to(DEVICE), 64)
        q, k = (apply_rotary(t, positions, cache, backend=backend) for t in (q, k))
        k_pool, v_pool = (torch.randn(40, 2, 16, device=DEVICE) for _ in range(2))
        slots = torch.tensor([3, 9, 4, 30, 31, 0, 7, 12, 13, 14, 15, 39], device=DEVICE)
        write_kv(k, v, k_pool, v_pool, slots, backend=backend)
        cu = torch.tensor([0, 7, 12], dtype=torch.int32, device=DEVICE)
        out = ragged_attention(q, k_pool, v_pool, slots, cu, cu, backend=backend)
        got = F.linear(out.reshape(-1, 96), layer.o_proj.weight.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------- the model on the kernels
@pytest.fixture
def launches(monkeypatch):
    """``kernel name -> [grid, ...]`` of every Triton launch made while the test runs."""
    grids = {}
    for module, name in ((rmsnorm, "_rms_norm_kernel"), (activation, "_silu_and_mul_kernel"),
                         (rotary, "_rotary_kernel"), (attention, "_ragged_attention_kernel"),
                         (attention, "_decode_attention_kernel")):
        class Recorder:
            def __getitem__(self, grid, _name=name, _kernel=getattr(module, name)):
                grids.setdefault(_name, []).append(grid)
                return _kernel[grid]
        monkeypatch.setattr(module, name, Recorder())
    return grids


@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["group1", "group2"])
def test_llama_on_the_triton_kernels_equals_torch(launches, n_kv_heads):
    """A tiny Llama (4 query heads over ``n_kv_heads``) with both backends "triton" runs every op on its
    kernel (RMSNorm, with the residual add; SiLU-and-multiply; rotary; prefill and decode attention) and
    equals the PyTorch reference: the logits of a batched prefill, and the greedy tokens of prompts
    batched through prefill and decode. Grouped, each K/V head is read once for its group (one
    program column per K/V head)."""
    cfg = ModelConfig("llama-kernels", n_layers=2, d_model=64, n_heads=4, vocab_size=257, max_seq_len=64,
                      family="llama", n_kv_heads=n_kv_heads, intermediate_size=96, layer_norm_eps=1e-5)
    prompts = random_prompts(3, 257, 2, 7, seed=n_kv_heads)
    llm = {b: LLM(cfg, engine=engine_config(max_bs=3, n_slots=64, attention_backend=b, fused_ops_backend=b))
           for b in ("torch", "triton")}
    torch.testing.assert_close(first_iteration_logits(llm["triton"], prompts),
                               first_iteration_logits(llm["torch"], prompts), rtol=1e-4, atol=1e-4)
    assert llm["triton"].generate(prompts, 3, ignore_eos=True) == llm["torch"].generate(prompts, 3, ignore_eos=True)
    assert set(launches) == {"_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel",
                             "_ragged_attention_kernel", "_decode_attention_kernel"}
    assert {g[1] for g in launches["_ragged_attention_kernel"]} == {n_kv_heads}
    if n_kv_heads < cfg.n_heads:
        assert {g[1] for g in launches["_decode_attention_kernel"]} == {n_kv_heads}
