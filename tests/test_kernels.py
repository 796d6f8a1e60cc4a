"""The selective-batching kernels against float64 oracles, on both backends.

Inputs live on the test device (``helpers.DEVICE``): on a GPU the Triton kernels are compiled and
run there, fp16 and bf16 for real; without one they run in Triton's interpreter (``conftest.py``
turns it on), so sizes stay small. Outputs are poisoned with NaN before each run, so an element the
kernel forgets to write fails the test. The error bound is FlashAttention's rule: no larger than twice
the error of the same computation done by PyTorch in the same dtype (plus a tiny floor for fp32).
"""
import json
from dataclasses import replace
import math

import pytest
import torch

from orca_lab.kernels import attention, bias_gelu, gelu, kv_write, layer_norm, layernorm
from orca_lab.kernels import ragged_attention, write_kv
from orca_lab.kernels.attention import kv_descriptors
from orca_lab.kernels import bench
from helpers import DEVICE, ON_GPU, needs_gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP32_FLOOR = 1e-5


# ------------------------------------------------------------------------------------- helpers
@pytest.fixture
def poison(monkeypatch):
    """Every float tensor from torch.empty / empty_like starts as NaN, not as leftover memory."""
    for name in ("empty", "empty_like"):
        real = getattr(torch, name)

        def poisoned(*args, _real=real, **kwargs):
            t = _real(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() and t.device.type != "meta" else t

        monkeypatch.setattr(torch, name, poisoned)


@pytest.fixture
def no_launch(monkeypatch):
    """Validation must refuse bad input before any kernel is launched."""
    class Bomb:
        def __getitem__(self, grid):
            raise AssertionError("kernel launched before the arguments were checked")

    for module, kernel in ((attention, "_ragged_attention_kernel"), (kv_write, "_write_kv_kernel"),
                           (layernorm, "_layer_norm_kernel"), (gelu, "_bias_gelu_kernel")):
        monkeypatch.setattr(module, kernel, Bomb())


def assert_close_as_torch(out, torch_out, oracle, dtype):
    """FlashAttention's rule: max error vs float64 <= 2x the same-dtype PyTorch error."""
    assert not torch.isnan(out).any(), "an output element was never written"
    assert out.dtype == dtype and out.shape == oracle.shape and out.device == torch_out.device
    oracle = oracle.cpu()
    err = (out.double().cpu() - oracle).abs().max().item()
    torch_err = (torch_out.double().cpu() - oracle).abs().max().item()
    floor = FP32_FLOOR if dtype == torch.float32 else 0.0
    assert err <= 2 * torch_err + floor, f"error {err:.3g} vs PyTorch's {torch_err:.3g} in {dtype}"


# ------------------------------------------------------------------------------------ attention
def make_batch(q_lens, kv_lens, heads, head_size, dtype, seed=0, slot_dtype=torch.int32):
    """A ragged batch whose K/V sit in shuffled, non-contiguous slots of a larger pool."""
    g = torch.Generator().manual_seed(seed)
    n_keys = sum(kv_lens)
    n_slots = 2 * n_keys + 3
    q = torch.randn(sum(q_lens), heads, head_size, generator=g).to(dtype)
    k_pool = torch.randn(n_slots, heads, head_size, generator=g).to(dtype)
    v_pool = torch.randn(n_slots, heads, head_size, generator=g).to(dtype)
    slot_ids = torch.randperm(n_slots, generator=g)[:n_keys].to(slot_dtype)
    offsets = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return tuple(t.to(DEVICE) for t in (q, k_pool, v_pool, slot_ids, offsets(q_lens), offsets(kv_lens)))


def attention_oracle(q, k_pool, v_pool, slot_ids, cu_q, cu_k, scale):
    """float64, one query at a time: query i of a request sees its first kv_len - q_len + i + 1 keys."""
    q, k_pool, v_pool, slot_ids = (t.cpu() for t in (q, k_pool, v_pool, slot_ids))
    q, k_pool, v_pool = q.double(), k_pool.double(), v_pool.double()
    out = torch.full_like(q, float("nan"))
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
        keys, values = k_pool[slot_ids[ks:ke].long()], v_pool[slot_ids[ks:ke].long()]
        for i in range(qe - qs):
            seen = (ke - ks) - (qe - qs) + i + 1
            p = torch.softmax(torch.einsum("hd,khd->hk", q[qs + i], keys[:seen]) * scale, dim=-1)
            out[qs + i] = torch.einsum("hk,khd->hd", p, values[:seen])
    return out


# (q_len, kv_len) per request: prefill (q = kv), decode (q = 1, long context), partial (1 < q < kv),
# a decode whose whole context is new (1, 1). T = 17: not a multiple of any block size.
MIXED = ([7, 1, 5, 1, 3], [7, 40, 23, 1, 3])
BATCHES = {"one-prefill": ([19], [19]), "one-decode": ([1], [50]),
           "no-new-tokens-in-middle": ([3, 0, 1], [4, 6, 9])}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [13, 64, 80])
def test_attention_mixed_batch(poison, dtype, head_size):
    check_attention(*MIXED, head_size, dtype)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_attention_single_request(poison, batch, dtype):
    check_attention(*BATCHES[batch], 64, dtype)


def test_attention_strided_q_int64_slots_and_scale(poison):
    """q sliced out of a fused QKV projection (non-contiguous), int64 slot ids, explicit scale."""
    q, k_pool, v_pool, slot_ids, cu_q, cu_k = make_batch(*MIXED, 2, 16, torch.float32, seed=3,
                                                         slot_dtype=torch.int64)
    qkv = torch.stack([q, q.flip(0), q.flip(1)], dim=1)  # [T, 3, H, D]
    check_attention(*MIXED, 16, torch.float32, batch=(qkv[:, 0], k_pool, v_pool, slot_ids, cu_q, cu_k),
                    scale=0.3)


# Prompts through the ragged kernel alone: an odd prompt over several query and key blocks, a
# two-token one, prefix-cached prompts (q_len < kv_len) whose cached keys span whole key blocks, and
# a one-token request (decode=False sends it there too).
PREFILL = ([37, 2, 21, 1], [37, 2, 50, 13])


@pytest.mark.parametrize("cfg,heads,n_kv,head_size", [
    (attention.PrefillConfig(16, 16, 1, 1), 2, 2, 64), (attention.PrefillConfig(32, 16, 1, 1), 4, 2, 80),
    (attention.PrefillConfig(16, 32, 1, 1), 2, 1, 128)], ids=str)
def test_prefill_tiles_against_float64(poison, cfg, heads, n_kv, head_size):
    """The causal split at query and key blocks of equal and unequal sizes, grouped and not: key
    blocks below every row of a query block run unmasked, those on its diagonal masked, and a
    request's query blocks run last first."""
    q, k_pool, v_pool, *rest = make_batch(*PREFILL, heads, head_size, torch.float32, seed=heads + head_size)
    k_pool, v_pool = k_pool[:, :n_kv].contiguous(), v_pool[:, -n_kv:].contiguous()
    args = (q, k_pool, v_pool, *rest)
    group, scale = heads // n_kv, 1 / math.sqrt(head_size)
    oracle = attention_oracle(q, k_pool.repeat_interleave(group, 1), v_pool.repeat_interleave(group, 1),
                              *rest, scale)
    plan = attention.triton_plan(*(t.tolist() for t in rest[1:]), DEVICE, decode=False)
    out = attention.ragged_attention_triton(*args, scale, plan, prefill=cfg)
    assert plan.n_decode == 0 and plan.prefill_reqs.tolist() == [0, 1, 2, 3]
    assert_close_as_torch(out, ragged_attention(*args, backend="torch"), oracle, torch.float32)


@pytest.mark.parametrize("heads,n_kv,head_size,tma", [(2, 2, 64, False), (4, 2, 80, False), (2, 2, 64, True),
                                                     (4, 2, 64, True), (4, 2, 80, True)], ids=str)
def test_fresh_prompts_read_their_keys_from_the_step_not_the_pool(poison, monkeypatch, heads, n_kv, head_size, tma):
    """Given the step's ``k, v`` (views of a fused [T, 3, n_kv, D] projection), the fresh prefill
    requests (whole prompts: q_len == kv_len) read their keys there, contiguously, and the rest
    (prefix-cached, decode) through their slots: the fresh ones' slots hold NaN here, and the output
    is still the oracle's, at a head size that fills BLOCK_D (64) and one that does not (80). ``tma``:
    the fresh ones' K/V blocks through tensor descriptors (boxes of a head; the last box of the batch
    runs past its rows, the others into the next request's, masked); at 80 the box would not fill
    BLOCK_D, so that launch reads through pointers."""
    q_lens, kv_lens = [37, 2, 21, 1, 5], [37, 2, 50, 13, 5]
    q, k_pool, v_pool, slot_ids, cu_q, cu_k = make_batch(q_lens, kv_lens, heads, head_size, torch.float32,
                                                         seed=head_size)
    k_pool, v_pool = k_pool[:, :n_kv].contiguous(), v_pool[:, :n_kv].contiguous()
    group, scale = heads // n_kv, 1 / math.sqrt(head_size)
    oracle = attention_oracle(q, k_pool.repeat_interleave(group, 1), v_pool.repeat_interleave(group, 1),
                              slot_ids, cu_q, cu_k, scale)
    new = torch.cat([slot_ids[cu_k[b + 1] - q_lens[b]:cu_k[b + 1]] for b in range(len(q_lens))]).long()
    proj = torch.randn(q.shape[0], 3, n_kv, head_size, device=DEVICE)
    proj[:, 1], proj[:, 2] = k_pool[new], v_pool[new]
    plan = attention.triton_plan(cu_q.tolist(), cu_k.tolist(), DEVICE)
    assert plan.prefill_reqs.tolist() == [0, 1, 2, 4] and plan.fresh.tolist() == [True, True, False, True]
    fresh_slots = torch.cat([slot_ids[cu_k[b]:cu_k[b + 1]] for b in (0, 1, 4)]).long()
    k_pool[fresh_slots], v_pool[fresh_slots] = float("nan"), float("nan")
    args = (q, k_pool, v_pool, slot_ids, cu_q, cu_k, scale, plan)
    boxes = []
    monkeypatch.setattr(attention, "kv_descriptors", lambda *a: boxes.append(a[2]) or kv_descriptors(*a))
    cfg = replace(attention.INTERPRETER_PREFILL, tma=tma)
    out = attention.ragged_attention_triton(*args, k=proj[:, 1], v=proj[:, 2], prefill=cfg)
    assert boxes == ([cfg.block_n] if tma and head_size == 64 else [])
    err = (out.double().cpu() - oracle.cpu()).abs().max().item()
    assert not out.isnan().any() and err < 1e-5, err
    # without them every prefill reads its slots: the fresh prompts' rows read the NaN
    rows = torch.cat([torch.arange(cu_q[b], cu_q[b + 1]) for b in (0, 1, 4)])
    assert attention.ragged_attention_triton(*args)[rows].isnan().all()


def test_orca_lab_tma_0_reads_fresh_prompts_through_pointers_a_forced_tma_tile_too(poison, monkeypatch):
    """The GPU check's switch (set when its smoke step finds the copy engine's path failing): no
    tensor descriptor is built, and the answer is the oracle's."""
    q_lens = [37, 21]
    q, k_pool, v_pool, slot_ids, cu_q, cu_k = make_batch(q_lens, q_lens, 2, 64, torch.float32, seed=12)
    oracle = attention_oracle(q, k_pool, v_pool, slot_ids, cu_q, cu_k, 0.125)
    proj = torch.stack([q, k_pool[slot_ids.long()], v_pool[slot_ids.long()]], dim=1)
    plan = attention.triton_plan(cu_q.tolist(), cu_k.tolist(), DEVICE)
    boxes = []
    monkeypatch.setattr(attention, "kv_descriptors", lambda *a: boxes.append(a[2]) or kv_descriptors(*a))
    monkeypatch.setenv("ORCA_LAB_TMA", "0")
    out = attention.ragged_attention_triton(q, k_pool, v_pool, slot_ids, cu_q, cu_k, 0.125, plan, k=proj[:, 1],
                                            v=proj[:, 2], prefill=replace(attention.INTERPRETER_PREFILL, tma=True))
    assert boxes == [] and (out.double().cpu() - oracle.cpu()).abs().max().item() < 1e-5


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_a_fresh_prompts_neighbour_keeps_its_nan_to_itself(poison, tma):
    """A fresh prompt's last key block runs into the next prompt's rows (a TMA box reads them whole):
    when those hold NaN and inf (a request gone wrong), the first prompt's output is still the
    oracle's, and only the second's is NaN."""
    q_lens = [37, 21]
    q, k_pool, v_pool, slot_ids, cu_q, cu_k = make_batch(q_lens, q_lens, 2, 64, torch.float32, seed=11)
    oracle = attention_oracle(q, k_pool, v_pool, slot_ids, cu_q, cu_k, 0.125)
    proj = torch.stack([q, k_pool[slot_ids.long()], v_pool[slot_ids.long()]], dim=1)
    proj[37:, 1], proj[37:, 2] = float("inf"), float("nan")
    k_pool[slot_ids[37:].long()], v_pool[slot_ids[37:].long()] = float("inf"), float("nan")
    plan = attention.triton_plan(cu_q.tolist(), cu_k.tolist(), DEVICE)
    cfg = replace(attention.INTERPRETER_PREFILL, tma=tma)
    out = attention.ragged_attention_triton(q, k_pool, v_pool, slot_ids, cu_q, cu_k, 0.125, plan, prefill=cfg,
                                            k=proj[:, 1], v=proj[:, 2])
    assert (out[:37].double().cpu() - oracle[:37].cpu()).abs().max().item() < 1e-5
    assert out[37:].isnan().all()


@needs_gpu
@pytest.mark.parametrize("tile", range(len(attention.prefill_candidates(128, 2, 90, fresh=True))))
@pytest.mark.parametrize("q_lens", [[300, 77, 5], [40]], ids=["three-prompts", "fewer-rows-than-a-box"])
def test_every_fresh_tile_the_gpu_tuner_may_time_gives_the_oracle(q_lens, tile):
    """Each launch configuration the tuner may pick for fresh prompts in bf16 at head size 128 (on an
    H100 or later every one through the TMA, FlashAttention's 128 x 128 tiles included), forced one
    at a time on the real kernel (one test each, so parallel workers share the compiles):
    FlashAttention's error bound against float64, with a prompt longer than several blocks, one
    shorter than one, and a batch with fewer rows than a box."""
    arch = attention.compute_capability(torch.cuda.current_device())
    cands = attention.prefill_candidates(128, 2, arch, fresh=True)
    assert all(c.tma for c in cands) == (arch >= 90)
    if tile >= len(cands):
        pytest.skip(f"sm_{arch} has {len(cands)} such tiles")
    q, k_pool, v_pool, slot_ids, cu_q, cu_k = make_batch(q_lens, q_lens, 8, 128, torch.bfloat16, seed=5)
    oracle = attention_oracle(q, k_pool, v_pool, slot_ids, cu_q, cu_k, 1 / math.sqrt(128))
    proj = torch.stack([q, k_pool[slot_ids.long()], v_pool[slot_ids.long()]], dim=1)
    args = (q, k_pool, v_pool, slot_ids, cu_q, cu_k)
    plan = attention.triton_plan(cu_q.tolist(), cu_k.tolist(), DEVICE)
    out = attention.ragged_attention_triton(*args, 1 / math.sqrt(128), plan, prefill=cands[tile], k=proj[:, 1],
                                            v=proj[:, 2])
    assert_close_as_torch(out, ragged_attention(*args, backend="torch"), oracle, torch.bfloat16)


def test_a_plans_fresh_and_other_work_maps_split_its_whole_one():
    """The fresh prefill requests and the others each get their own launch's work map; together they
    hold every (request, query block) of the whole map, each once."""
    plan = attention.triton_plan([0, 37, 39, 60, 61, 66], [0, 37, 39, 89, 102, 107], "cpu")
    pairs = lambda w: sorted(map(tuple, w.t().tolist()))
    for block_m, group in ((16, 1), (32, 4)):
        whole = pairs(plan.work_map(block_m, group))
        fresh, other = (pairs(plan.work_map(block_m, group, f)) for f in (True, False))
        assert {r for r, _ in fresh} == {0, 1, 4} and {r for r, _ in other} == {2}
        assert sorted(fresh + other) == whole


def test_prefill_tiles_per_gpu_generation():
    """An H100 or H200 (and later) starts from 128 query rows over 8 warps with K/V prefetched two
    blocks ahead; an A100 (and the other sm_8x) from its own list; ``aot`` declares both; fp32 keeps
    only the tiles whose pipelined blocks fit the shared memory planned for."""
    h100, a100 = (attention.prefill_candidates(128, 2, arch) for arch in (90, 80))
    assert h100[0] == attention.PrefillConfig(128, 64, 8, 3) and a100[0] == attention.PrefillConfig(128, 32, 8, 3)
    assert attention.prefill_candidates(128, 2, 100) == h100 and attention.prefill_candidates(128, 2, 86) == a100
    assert attention.prefill_candidates(128, 2) == list(dict.fromkeys(h100 + a100))
    # fresh prompts on sm_90 (16-bit, a head filling BLOCK_D, k and v ready for it) time the same tiles
    # through the TMA, and FlashAttention's 128 x 128 at 3 stages after the default: it fits an H100's
    # shared memory, not an A100's; aot declares the pointer tiles too (other head sizes, dtypes, GPUs)
    tma = lambda tiles: [replace(c, tma=True) for c in tiles]
    boxes = attention.prefill_candidates(128, 2, 90, fresh=True)
    assert boxes == tma([h100[0], *attention.FRESH_PREFILL[90], *h100[1:]])
    assert attention.PrefillConfig(128, 128, 8, 3, True) in boxes
    assert attention.prefill_candidates(128, 2, fresh=True) == list(dict.fromkeys(boxes + h100 + a100))
    assert not any(c.tma for c in a100 + attention.prefill_candidates(128, 2, 80, fresh=True))
    for no_boxes in (dict(head_size=80), dict(elem_bytes=4), dict(tma=False)):
        assert not any(c.tma for c in attention.prefill_candidates(**{"head_size": 128, "arch": 90, "fresh": True,
                                                                      **no_boxes}))
    fp32 = attention.prefill_candidates(128, 4, 90)
    assert fp32 and set(fp32) < set(h100) and all(
        4 * 128 * (c.block_m + 2 * c.block_n * c.num_stages) <= attention.SHARED_PLAN[80] for c in fp32)


def check_attention(q_lens, kv_lens, head_size, dtype, batch=None, scale=None):
    args = batch or make_batch(q_lens, kv_lens, 2, head_size, dtype, seed=head_size)
    oracle = attention_oracle(*args, scale or 1 / math.sqrt(head_size))
    torch_out = ragged_attention(*args, scale=scale, backend="torch")
    out = ragged_attention(*args, scale=scale, backend="triton")
    assert_close_as_torch(out, torch_out, oracle, dtype)
    # The torch backend itself must be right, not just close to a kernel sharing its bug.
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    assert (torch_out.double().cpu() - oracle.cpu()).abs().max().item() < tol


def test_attention_auto_is_torch_on_cpu(monkeypatch):
    args = tuple(t.cpu() for t in make_batch(*MIXED, 2, 16, torch.float32))
    monkeypatch.setattr(attention, "_ragged_attention_kernel", None)  # would fail if called
    out = ragged_attention(*args)
    assert torch.equal(out, ragged_attention(*args, backend="torch"))


@needs_gpu
def test_attention_auto_is_triton_on_gpu(monkeypatch):
    args = make_batch(*MIXED, 2, 16, torch.float32)
    assert args[0].is_cuda
    assert torch.equal(ragged_attention(*args), ragged_attention(*args, backend="triton"))
    monkeypatch.setattr(attention, "_ragged_attention_kernel", None)  # auto must launch it: now it fails
    with pytest.raises(TypeError):
        ragged_attention(*args)


# --------------------------------------------------------------------------------------- write_kv
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [13, 80])
def test_write_kv(dtype, head_size):
    g = torch.Generator().manual_seed(1)
    T, H, n_slots = 11, 3, 40
    k, v = (torch.randn(T, H, head_size, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    slots = torch.randperm(n_slots, generator=g)[:T].int().to(DEVICE)
    for backend in ("torch", "triton"):
        k_pool = torch.full((n_slots, H, head_size), float("nan"), dtype=dtype, device=DEVICE)
        v_pool = k_pool.clone()
        write_kv(k, v, k_pool, v_pool, slots, backend=backend)
        assert torch.equal(k_pool[slots.long()], k) and torch.equal(v_pool[slots.long()], v)
        untouched = torch.ones(n_slots, dtype=torch.bool, device=DEVICE)
        untouched[slots.long()] = False
        assert k_pool[untouched].isnan().all() and v_pool[untouched].isnan().all()


def test_write_kv_into_strided_pool_with_cast():
    """A one-layer view of a [n_slots, L, H, D] pool; fp32 K/V written into an fp16 pool."""
    g = torch.Generator().manual_seed(2)
    pools = torch.full((30, 2, 4, 16), float("nan"), dtype=torch.float16, device=DEVICE)
    k, v = (torch.randn(5, 4, 16, generator=g).to(DEVICE) for _ in range(2))
    slots = torch.tensor([29, 0, 7, 8, 3], device=DEVICE)
    write_kv(k, v, pools[:, 0], pools[:, 1], slots, backend="triton")
    assert torch.equal(pools[slots, 0], k.half()) and torch.equal(pools[slots, 1], v.half())
    assert pools[:, 0].isnan().sum() == pools[:, 1].isnan().sum() == (30 - 5) * 4 * 16


# -------------------------------------------------------------------------------------- layer_norm
def ln_inputs(rows, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(rows, width, generator=g).to(dtype) * 3 + 1 for _ in range(2))
    weight, bias = torch.rand(width, generator=g).to(dtype) + 0.5, torch.randn(width, generator=g).to(dtype)
    return tuple(t.to(DEVICE) for t in (x, weight, bias, residual))


def ln_oracle(x, weight, bias, eps=1e-5):
    x, weight, bias = x.double().cpu(), weight.cpu(), bias.cpu()
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight.double() + bias.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [200, 768])
def test_layer_norm(poison, dtype, width):
    x, w, b, _ = ln_inputs(9, width, dtype)
    oracle = ln_oracle(x, w, b)
    assert_close_as_torch(layer_norm(x, w, b, backend="triton"), layer_norm(x, w, b, backend="torch"),
                          oracle, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [200, 768])
def test_layer_norm_residual(poison, dtype, width):
    x, w, b, r = ln_inputs(9, width, dtype)
    y64 = ln_oracle(x.double() + r.double(), w, b)
    y_torch, sum_torch = layer_norm(x, w, b, residual=r, backend="torch")
    y, total = layer_norm(x, w, b, residual=r, backend="triton")
    assert_close_as_torch(y, y_torch, y64, dtype)
    assert torch.equal(total, sum_torch)  # one rounding of x + residual, as PyTorch does it


def test_layer_norm_chunked_row_and_3d_input(poison, monkeypatch):
    """A row longer than one block is walked in chunks (forced small here); leading dims flatten."""
    monkeypatch.setattr(layernorm, "MAX_BLOCK", 64)
    x, w, b, r = ln_inputs(6, 200, torch.float32, seed=4)
    x, r = x.view(2, 3, 200), r.view(2, 3, 200)
    y64 = ln_oracle(x.double() + r.double(), w, b)
    y, _ = layer_norm(x, w, b, residual=r, backend="triton")
    assert_close_as_torch(y, layer_norm(x, w, b, residual=r, backend="torch")[0], y64, torch.float32)


# ------------------------------------------------------------------------------------- bias_gelu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 200), (3, 5, 768)])
def test_bias_gelu(poison, dtype, shape):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(*shape, generator=g) * 4).to(dtype).to(DEVICE)  # wide range: both sigmoid tails
    bias = torch.randn(shape[-1], generator=g).to(dtype).to(DEVICE)
    u = x.double().cpu() + bias.double().cpu()
    oracle = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    assert_close_as_torch(bias_gelu(x, bias, backend="triton"), bias_gelu(x, bias, backend="torch"),
                          oracle, dtype)


# ------------------------------------------------------------------------------------ validation
# The argument checks run on the host before any launch: their tests use CPU tensors on every machine.
def _attn_args(**change):
    q, k_pool, v_pool, slot_ids, cu_q, cu_k = (t.cpu() for t in make_batch([2, 1], [3, 4], 2, 8, torch.float32))
    args = dict(q=q, k_pool=k_pool, v_pool=v_pool, slot_ids=slot_ids, cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k)
    return {**args, **change}


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


META = torch.device("meta")
ATTENTION_ERRORS = {
    "q-not-tensor": (dict(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
    "q-2d": (dict(q=torch.randn(3, 16)), ValueError, "q must be 3-D"),
    "q-int": (dict(q=torch.ones(3, 2, 8, dtype=torch.int32)), TypeError, "q has dtype"),
    "q-fp64": (dict(q=torch.randn(3, 2, 8, dtype=torch.float64)), TypeError, "allowed: float32"),
    "pool-dtype": (dict(k_pool=torch.randn(17, 2, 8).half()), TypeError, "k_pool has dtype"),
    "pool-device": (dict(v_pool=torch.empty(17, 2, 8, device=META)), ValueError, "v_pool is on meta"),
    "pool-head-size": (dict(k_pool=torch.randn(17, 2, 9)), ValueError, r"k_pool.shape\[2\] \(head size\) has value 9"),
    "pool-heads": (dict(v_pool=torch.randn(17, 3, 8)), ValueError, r"v_pool.shape has value \(17, 3, 8\)"),
    "pool-heads-not-dividing": (dict(k_pool=torch.randn(17, 3, 8), v_pool=torch.randn(17, 3, 8)), ValueError,
                                r"k_pool.shape\[1\] \(K/V heads\) is 3; allowed: a divisor of q's 2 heads"),
    "pool-shapes": (dict(v_pool=torch.randn(16, 2, 8)), ValueError, "v_pool.shape has"),
    "head-size-257": (dict(q=torch.randn(3, 1, 257), k_pool=torch.randn(17, 1, 257),
                           v_pool=torch.randn(17, 1, 257)), ValueError, "size 1 to 256"),
    "head-size-0": (dict(q=torch.randn(3, 2, 0), k_pool=torch.randn(17, 2, 0),
                         v_pool=torch.randn(17, 2, 0)), ValueError, "q has 2 heads of size 0"),
    "slots-float": (dict(slot_ids=torch.zeros(7)), TypeError, "slot_ids has dtype"),
    "slots-2d": (dict(slot_ids=torch.zeros(7, 1, dtype=torch.int32)), ValueError, "slot_ids must be 1-D"),
    "cu-float": (dict(cu_seqlens_q=torch.tensor([0.0, 2, 3])), TypeError, "cu_seqlens_q has dtype"),
    "cu-one-entry": (dict(cu_seqlens_q=_i32(0), cu_seqlens_k=_i32(0)), ValueError, "B\\+1 >= 2"),
    "cu-lengths": (dict(cu_seqlens_k=_i32(0, 3, 5, 7)), ValueError, r"len\(cu_seqlens_k\)"),
    "cu-q-start": (dict(cu_seqlens_q=_i32(1, 2, 3)), ValueError,
                   "cu_seqlens_q must start at 0 and end at T=3"),
    "cu-q-end": (dict(cu_seqlens_q=_i32(0, 2, 2)), ValueError, "end at T=3"),
    "cu-q-decreasing": (dict(cu_seqlens_q=_i32(0, 4, 3)), ValueError, "non-decreasing"),
    "cu-k-end": (dict(cu_seqlens_k=_i32(0, 3, 6)), ValueError, r"len\(slot_ids\)=7"),
    "q-longer-than-kv": (dict(cu_seqlens_k=_i32(0, 1, 7)), ValueError,
                         "request 0 has 2 queries but only 1 keys"),
    "slot-too-big": (dict(slot_ids=_i32(0, 1, 2, 3, 4, 5, 17)), ValueError,
                     r"\[0, 17\], allowed \[0, n_slots=17\)"),
    "slot-negative": (dict(slot_ids=_i32(-1, 1, 2, 3, 4, 5, 6)), ValueError, "slot_ids holds values"),
    "cu-device": (dict(cu_seqlens_k=torch.empty(3, dtype=torch.int32, device=META)), ValueError,
                  "cu_seqlens_k is on meta"),
    "scale-str": (dict(scale="0.1"), TypeError, "scale must be a float"),
    "scale-zero": (dict(scale=0.0), ValueError, r"scale must be > 0 and finite .* got 0.0"),
    "scale-negative": (dict(scale=-0.5), ValueError, r"scale must be > 0 and finite .* got -0.5"),
    "backend": (dict(backend="cuda"), ValueError, "backend='cuda' is not one of"),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ATTENTION_ERRORS)
def test_attention_refuses(no_launch, backend, case):
    change, error, match = ATTENTION_ERRORS[case]
    with pytest.raises(error, match=match):
        ragged_attention(**_attn_args(**{"backend": backend, **change}))


def _kv_args(**change):
    args = dict(k=torch.randn(3, 2, 8), v=torch.randn(3, 2, 8), k_pool=torch.zeros(10, 2, 8),
                v_pool=torch.zeros(10, 2, 8), slot_mapping=_i32(4, 0, 9))
    return {**args, **change}


KV_ERRORS = {
    "k-not-tensor": (dict(k=3.0), TypeError, "k must be a torch.Tensor"),
    "k-2d": (dict(k=torch.randn(3, 16)), ValueError, "k must be 3-D"),
    "v-int": (dict(v=torch.ones(3, 2, 8, dtype=torch.int64)), TypeError, "v has dtype"),
    "v-shape": (dict(v=torch.randn(4, 2, 8)), ValueError, "v.shape has"),
    "v-device": (dict(v=torch.empty(3, 2, 8, device=META)), ValueError, "v is on meta"),
    "pool-int": (dict(k_pool=torch.zeros(10, 2, 8, dtype=torch.int8)), TypeError, "k_pool has dtype"),
    "pool-dtypes": (dict(v_pool=torch.zeros(10, 2, 8).half()), TypeError, "v_pool has dtype"),
    "pool-shapes": (dict(v_pool=torch.zeros(11, 2, 8)), ValueError, "v_pool.shape has"),
    "pool-head-size": (dict(k_pool=torch.zeros(10, 2, 4), v_pool=torch.zeros(10, 2, 4)), ValueError,
                       r"k_pool.shape\[1:\]"),
    "slots-float": (dict(slot_mapping=torch.tensor([4.0, 0, 9])), TypeError, "slot_mapping has dtype"),
    "slots-length": (dict(slot_mapping=_i32(4, 0)), ValueError,
                     r"len\(slot_mapping\) has length \(T\) 2, expected 3"),
    "slot-too-big": (dict(slot_mapping=_i32(4, 0, 10)), ValueError, "allowed \\[0, n_slots=10\\)"),
    "slot-negative": (dict(slot_mapping=_i32(4, -2, 1)), ValueError, "slot_mapping holds values"),
    "backend": (dict(backend="gpu"), ValueError, "backend='gpu'"),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", KV_ERRORS)
def test_write_kv_refuses(no_launch, backend, case):
    change, error, match = KV_ERRORS[case]
    with pytest.raises(error, match=match):
        write_kv(**_kv_args(**{"backend": backend, **change}))


def _ln_args(**change):
    x, weight, bias, _ = (t.cpu() for t in ln_inputs(3, 8, torch.float32))
    return {**dict(x=x, weight=weight, bias=bias), **change}


LN_ERRORS = {
    "x-list": (dict(x=[1.0]), TypeError, "x must be a torch.Tensor"),
    "x-int": (dict(x=torch.ones(3, 8, dtype=torch.int32)), TypeError, "x has dtype"),
    "x-scalar": (dict(x=torch.tensor(1.0)), ValueError, "non-empty last dimension"),
    "x-empty-row": (dict(x=torch.randn(3, 0)), ValueError, "non-empty last dimension"),
    "weight-size": (dict(weight=torch.ones(7)), ValueError,
                    r"weight.shape\[0\] has size \(x.shape\[-1\]\) 7"),
    "weight-dtype": (dict(weight=torch.ones(8).half()), TypeError, "weight has dtype"),
    "bias-2d": (dict(bias=torch.ones(1, 8)), ValueError, "bias must be 1-D"),
    "bias-device": (dict(bias=torch.empty(8, device=META)), ValueError, "bias is on meta"),
    "residual-shape": (dict(residual=torch.randn(2, 8)), ValueError, "residual.shape"),
    "residual-dtype": (dict(residual=torch.randn(3, 8).half()), TypeError, "residual has dtype"),
    "eps-negative": (dict(eps=-1e-5), ValueError, "eps must be a positive float"),
    "eps-str": (dict(eps="1e-5"), ValueError, "eps must be a positive float"),
    "backend": (dict(backend=None), ValueError, "backend=None"),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", LN_ERRORS)
def test_layer_norm_refuses(no_launch, backend, case):
    change, error, match = LN_ERRORS[case]
    with pytest.raises(error, match=match):
        layer_norm(**_ln_args(**{"backend": backend, **change}))


GELU_ERRORS = {
    "x-none": (dict(x=None), TypeError, "x must be a torch.Tensor"),
    "x-int": (dict(x=torch.ones(3, 8, dtype=torch.int64)), TypeError, "x has dtype"),
    "x-scalar": (dict(x=torch.tensor(2.0)), ValueError, "non-empty last dimension"),
    "bias-size": (dict(bias=torch.ones(9)), ValueError,
                  r"bias.shape\[0\] has size \(x.shape\[-1\]\) 9, expected 8"),
    "bias-dtype": (dict(bias=torch.ones(8, dtype=torch.bfloat16)), TypeError, "bias has dtype"),
    "bias-2d": (dict(bias=torch.ones(3, 8)), ValueError, "bias must be 1-D"),
    "bias-device": (dict(bias=torch.empty(8, device=META)), ValueError, "bias is on meta"),
    "backend": (dict(backend="Triton"), ValueError, "backend='Triton'"),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", GELU_ERRORS)
def test_bias_gelu_refuses(no_launch, backend, case):
    change, error, match = GELU_ERRORS[case]
    args = {**dict(x=torch.randn(3, 8), bias=torch.randn(8), backend=backend), **change}
    with pytest.raises(error, match=match):
        bias_gelu(**args)


# ------------------------------------------------------------------------------------- benchmark
def test_a_bench_cut_by_its_time_limit_keeps_the_rows_it_timed(tmp_path, monkeypatch):
    """The GPU check cuts a step at its limit (SIGINT): the JSON then holds every row timed before
    the cut, marked incomplete."""
    timed = []

    def cut_at_fifth(fn, device, reps, warmup=1):      # the peaks' copy and matmul, then two cases
        if len(timed) == 4:
            raise KeyboardInterrupt
        timed.append(fn)
        return 1.0, 1.0

    monkeypatch.setattr(bench, "time_ms", cut_at_fifth)
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--tiny", "--reps", "1", "--threads", str(torch.get_num_threads()), "--out", str(out)])
    result = json.loads(out.read_text())
    assert not result["complete"] and [r["impl"] for r in result["results"]] == ["triton", "triton-slots"]


def test_bench_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    threads = str(torch.get_num_threads())  # leave the process's setting as it is
    bench.main(["--quick", "--tiny", "--reps", "1", "--threads", threads, "--out", str(out)])
    result = json.loads(out.read_text())
    for field in ("device", "device_type", "torch", "triton", "interpreted", "peaks", "results"):
        assert field in result
    assert result["complete"]
    # which launch configuration each attention timing ran (the interpreter's fixed ones here)
    assert {t["kernel"] for t in result["tuned"]} == {"prefill", "decode"}
    kernels = {row["kernel"] for row in result["results"]}
    assert kernels == {"ragged_attention", "write_kv", "layer_norm", "bias_gelu"}
    impls = {row["impl"] for row in result["results"] if row["kernel"] == "ragged_attention"}
    assert impls == {"triton", "triton-slots", "triton-ragged", "sdpa-loop", "padded-ft", "sdpa-causal"}
    decode = {row["impl"] for row in result["results"] if row["case"] == "decode"}
    assert impls - decode == {"sdpa-causal"}    # whole prompts only
    for row in result["results"]:
        assert row["time_ms"] > 0 and row["floor_ms"] > 0 and row["sizes"]
        # without a GPU both times are the one wall time; on a GPU the device's is the roofline's
        assert (row["wall_ms"] == row["time_ms"]) is not ON_GPU
    assert result["timing"] == bench.TIMING[DEVICE.type]
    printed = capsys.readouterr().out
    assert "wall ms" in printed
    # Without a GPU the Triton rows are the interpreter's and say so; on a GPU they are real speeds.
    assert result["interpreted"] is not ON_GPU and result["device_type"] == DEVICE.type
    assert ("interpreted" in printed) is not ON_GPU
    assert all(row["interpreted"] is (row["impl"].startswith("triton") and not ON_GPU) for row in result["results"])
