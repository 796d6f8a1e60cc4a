"""The decode path of the attention kernels against float64, and its launch machinery.

On a GPU the tensors live there; without one the kernels run in Triton's interpreter at small sizes.
Contexts cross the interpreter's split boundary (32 keys) so both the one-pass path and the
split-and-merge path (FlashDecoding) run, the merge over more splits than it reads in one step too;
head sizes 13 and 80 are masked tails of power-of-two blocks.
"""
import json
import math

import numpy as np
import pytest
import torch

from orca_lab.config import EngineConfig
from orca_lab.kernels import attention
from orca_lab.kernels._tuning import LaunchTuner, bucket
from orca_lab.kernels.attention import (DecodeConfig, PrefillConfig, ragged_attention_ref,
                                        ragged_attention_triton, triton_plan)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_batch(q_lens, kv_lens, heads, head_size, dtype, seed=0):
    """A ragged batch whose K/V sit in shuffled, non-contiguous slots of a larger pool (int64 ids,
    as the K/V manager hands them out)."""
    g = torch.Generator().manual_seed(seed)
    n_keys = sum(kv_lens)
    n_slots = 2 * n_keys + 3
    rand = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE, dtype)
    q, k_pool, v_pool = rand(sum(q_lens), heads, head_size), rand(n_slots, heads, head_size), \
        rand(n_slots, heads, head_size)
    slot_ids = torch.randperm(n_slots, generator=g)[:n_keys].to(DEVICE)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(lens)]) for lens in (q_lens, kv_lens))
    to_dev = lambda cu: torch.from_numpy(cu.astype(np.int32)).to(DEVICE)
    return (q, k_pool, v_pool, slot_ids, to_dev(cu_q), to_dev(cu_k)), cu_q, cu_k


def oracle(q, k_pool, v_pool, slot_ids, cu_q, cu_k, scale):
    """float64, one query at a time: query i of a request sees its first kv_len - q_len + i + 1 keys."""
    q, k_pool, v_pool = q.double().cpu(), k_pool.double().cpu(), v_pool.double().cpu()
    slot_ids, cu_q, cu_k = slot_ids.cpu(), cu_q.tolist(), cu_k.tolist()
    out = torch.full_like(q, float("nan"))
    for b in range(len(cu_q) - 1):
        keys, values = (pool[slot_ids[cu_k[b]:cu_k[b + 1]]] for pool in (k_pool, v_pool))
        q_len = cu_q[b + 1] - cu_q[b]
        for i in range(q_len):
            seen = len(keys) - q_len + i + 1
            p = torch.softmax(torch.einsum("hd,khd->hk", q[cu_q[b] + i], keys[:seen]) * scale, dim=-1)
            out[cu_q[b] + i] = torch.einsum("hk,khd->hd", p, values[:seen])
    return out


def check(q_lens, kv_lens, heads, head_size, dtype, **forced):
    args, cu_q, cu_k = make_batch(q_lens, kv_lens, heads, head_size, dtype, seed=head_size + heads)
    scale = 1 / math.sqrt(head_size)
    expected = oracle(*args, scale)
    plan = triton_plan(cu_q, cu_k, DEVICE)
    out = ragged_attention_triton(*args, scale, plan, **forced).cpu()
    assert out.dtype == dtype and not torch.isnan(out).any(), "an output row was never written"
    err = (out.double() - expected).abs().max().item()
    # no worse than PyTorch's own attention in the same dtype (FlashAttention's rule), plus a floor
    torch_err = (ragged_attention_ref(*args, scale).cpu().double() - expected).abs().max().item()
    assert err <= 2 * torch_err + (1e-5 if dtype == torch.float32 else 0.0), (err, torch_err)
    return plan


# contexts 1, 17, 32 (one split), 33 (one key past the boundary) and 70 (three splits)
DECODE = ([1] * 5, [1, 17, 32, 33, 70])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [13, 80])
def test_decode_kernel_against_float64(dtype, head_size):
    plan = check(*DECODE, 3, head_size, dtype)
    assert plan.n_decode == 5 and plan.prefill_reqs.size == 0 and plan.max_kv == 70


@pytest.mark.parametrize("cfg", [DecodeConfig(1, 16, 16, 1, 1), DecodeConfig(4, 16, 0, 1, 1),
                                 DecodeConfig(2, 32, 48, 1, 1), DecodeConfig(4, 16, 5, 1, 1)], ids=str)
def test_decode_kernel_launch_configurations(cfg):
    """Head groups wider than the heads (masked), no split, a split that is not a multiple of the
    key block, and splits shorter than a key block (14 merged)."""
    check(*DECODE, 3, 16, torch.float32, decode=cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_merge_over_more_splits_than_two_chunks(dtype):
    """The merge reads MERGE_CHUNK splits a step, rescaling what it holds by the new running max:
    2 chunks and 3 splits for the longest context (its last split partial), one split past a
    chunk, one chunk of splits, and two splits read among the many the grid allocates."""
    cfg, chunk = attention.INTERPRETER_DECODE, attention.MERGE_CHUNK
    splits = [2 * chunk + 3, chunk + 1, chunk, 2]
    kv_lens = [n * cfg.partition - 5 for n in splits]
    plan = check([1] * len(kv_lens), kv_lens, 2, 13, dtype, decode=cfg)
    assert plan.max_kv == kv_lens[0] and -(-plan.max_kv // cfg.partition) == splits[0]


@pytest.mark.parametrize("decode", [True, False])
def test_mixed_batch_splits_between_the_kernels(decode):
    """Prefill, decode, a request with no new tokens and a partial prompt in one batch: the decode
    kernel takes the one-token requests, the ragged kernel the rest (or all, with decode=False)."""
    q_lens, kv_lens = [7, 1, 0, 1, 5, 1], [7, 40, 3, 1, 23, 33]
    plan = check(q_lens, kv_lens, 2, 13, torch.float32, prefill=PrefillConfig(16, 16, 1, 1))
    assert plan.prefill_reqs.tolist() == [0, 4] and plan.n_decode == 3 and plan.max_q == 7
    if not decode:
        args, cu_q, cu_k = make_batch(q_lens, kv_lens, 2, 13, torch.float32, seed=15)
        ragged_only = triton_plan(cu_q, cu_k, DEVICE, decode=False)
        assert ragged_only.n_decode == 0 and ragged_only.prefill_reqs.tolist() == [0, 1, 3, 4, 5]
        both = ragged_attention_triton(*args, 0.3, triton_plan(cu_q, cu_k, DEVICE))
        torch.testing.assert_close(ragged_attention_triton(*args, 0.3, ragged_only), both)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_ragged_kernel_can_take_the_one_token_requests(dtype):
    """``decode`` forced to a ``PrefillConfig``: the ragged kernel over a mixed batch's one-token
    requests in the decode kernel's place (the GPU tuner times it beside the decode kernel's launches),
    against float64; its work map is the plan's, cached for a CUDA graph's replays."""
    plan = check([7, 1, 0, 1, 5, 1], [7, 40, 3, 1, 23, 33], 2, 13, dtype, prefill=PrefillConfig(16, 16, 1, 1),
                 decode=PrefillConfig(16, 16, 1, 1))
    assert plan.n_decode == 3 and plan.works[16, 1, "decode"].cpu().tolist() == [[1, 3, 5], [0, 0, 0]]


def test_the_ragged_kernel_takes_one_token_requests_of_grouped_heads():
    """Four query heads over two K/V heads: a block holds one request's group, as the decode kernel's
    grouped program does; both against PyTorch's attention."""
    g = torch.Generator().manual_seed(3)
    q_lens, kv_lens, D = [1, 1, 1], [1, 30, 47], 16
    rand = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)
    q, k_pool, v_pool = rand(3, 4, D), rand(90, 2, D), rand(90, 2, D)
    slots = torch.randperm(90, generator=g)[:sum(kv_lens)].to(DEVICE)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]) for x in (q_lens, kv_lens))
    args = (q, k_pool, v_pool, slots, *(torch.from_numpy(c.astype(np.int32)).to(DEVICE) for c in (cu_q, cu_k)))
    ref = ragged_attention_ref(*args, 0.25)
    for route in (PrefillConfig(16, 16, 1, 1), attention.interpreter_decode(4, 2)):
        got = ragged_attention_triton(*args, 0.25, triton_plan(cu_q, cu_k, DEVICE), decode=route)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_the_gpu_tuner_times_the_ragged_kernel_for_one_token_requests_too():
    """The decode kernel's launches first (the first serves untuned, in a graph captured before any
    timing), then the ragged kernel's 16-row tile of the prefill table, where it fits."""
    for arch, elem in ((90, 2), (80, 2), (90, 4)):
        routes, own = attention.decode_routes(128, 40, 1, elem, arch), attention.decode_candidates(128, 40, 1)
        ragged = [c for c in attention.prefill_candidates(128, elem, arch) if c.block_m == 16]
        assert routes == own + ragged and routes[0] == own[0]
    assert attention.decode_routes(128, 40, 1, 2, 90)[-1] == PrefillConfig(16, 64, 4, 3)


def test_work_map_is_built_once_per_block_size():
    plan = triton_plan([0, 19, 20, 23], [0, 19, 40, 30 + 23 - 20], DEVICE)
    work = plan.work_map(16)
    assert work.cpu().tolist() == [[0, 0, 2], [0, 1, 0]]     # request 0: two blocks; request 2: one
    assert plan.work_map(16) is work and plan.work_map(64).shape == (2, 2)


def test_tuner_uses_the_fixed_config_in_the_interpreter_and_caches_per_bucket():
    tuner, launched = LaunchTuner(), []
    pick = tuner.choose(("k", bucket(5)), ["small", "big"], launched.append, on_gpu=False)
    assert pick == "small" and launched == [] and tuner.best == {("k", 8): "small"}
    assert [bucket(n) for n in (1, 2, 3, 8, 9)] == [1, 2, 4, 8, 16]


def test_tune_off_takes_the_first_candidate_on_a_gpu_untimed(monkeypatch):
    """``ORCA_LAB_TUNE=0`` (the GPU check's workers, whose processes must run the same tiles): on a
    GPU too, each bucket takes the first candidate and nothing is launched to time it."""
    import triton
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: pytest.fail("timed with tuning off"))
    monkeypatch.setenv("ORCA_LAB_TUNE", "0")
    tuner, launched = LaunchTuner(), []
    assert tuner.choose(("k", 8), ["first", "fast"], launched.append, on_gpu=True) == "first" and launched == []
    monkeypatch.setenv("ORCA_LAB_TUNE", "1")
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or {"first": 2.0, "fast": 1.0}[launched[-1]])
    assert LaunchTuner().choose(("k", 8), ["first", "fast"], launched.append, on_gpu=True) == "fast"


def test_tuner_times_each_candidate_once_and_skips_what_does_not_fit(monkeypatch):
    """The GPU path of the tuner, its timer replaced: the fastest config that runs wins, a config
    that needs too much shared memory is skipped, and the bucket is not timed again; every time
    taken is kept for the record (``tuned_launches``)."""
    import triton
    cost, launched = {"a": 3.0, "b": 1.0, "c": 0.5}, []

    def launch(cfg):
        launched.append(cfg)
        if cfg == "c":
            raise triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")

    def do_bench(fn, **kw):
        fn()
        return cost[launched[-1]]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    tuner = LaunchTuner()
    assert tuner.choose("key", ["a", "b", "c"], launch, on_gpu=True) == "b"
    assert tuner.timed == {"key": {"a": 3.0, "b": 1.0}}
    n = len(launched)
    assert tuner.choose("key", ["a", "b", "c"], launch, on_gpu=True) == "b" and len(launched) == n


def test_a_candidate_that_fails_otherwise_is_skipped_and_named(monkeypatch):
    """A configuration whose launch raises for another reason (a driver refusing a tensor descriptor)
    is skipped with a warning naming it and the error; when none runs, the error names them all."""
    import triton
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or 1.0)

    def launch(cfg):
        if cfg.startswith("tma"):
            raise RuntimeError("Triton Error [CUDA]: invalid argument")

    with pytest.warns(RuntimeWarning, match="tma-128: RuntimeError: Triton Error .CUDA.: invalid argument"):
        assert LaunchTuner().choose("key", ["tma-128", "ptr-64"], launch, on_gpu=True) == "ptr-64"
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="no launch configuration.*tma-1: .*tma-2"):
        LaunchTuner().choose("key", ["tma-1", "tma-2"], launch, on_gpu=True)


def test_a_settled_tuner_borrows_its_nearest_timed_bucket_and_times_nothing(monkeypatch):
    """After a warm-up the tuner settles: a new bucket of a kernel and model shape already timed takes
    the nearest timed bucket's choice without launching anything; another shape is still timed."""
    import triton
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or 1.0)
    tuner, launched = LaunchTuner(), []
    tuner.best = {("p", 40, 16, 64): "short", ("p", 40, 1024, 4096): "long"}
    tuner.settle()
    assert tuner.choose(("p", 40, 32, 128), ["x", "y"], launched.append, on_gpu=True) == "short"
    assert tuner.choose(("p", 40, 2048, 8192), ["x", "y"], launched.append, on_gpu=True) == "long"
    assert launched == []
    assert tuner.choose(("p", 12, 32, 128), ["x", "y"], launched.append, on_gpu=True) == "x" and launched


def test_a_settled_tuner_lends_one_paths_choice_to_the_other(monkeypatch):
    """A warm-up of whole prompts times the fresh path only; once settled, prompts that read earlier
    keys too (a chunk, a prefix-cache hit) borrow its nearest choice rather than timing mid-run,
    unless that choice is not one of theirs (the 128 x 128 tile is the fresh path's alone)."""
    import triton
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or 1.0)
    tuner, launched = LaunchTuner(), []
    tuner.best = {("p", True, 40, 1024, 4096): "t64", ("p", True, 12, 1024, 4096): "t128"}
    tuner.settle()
    assert tuner.choose(("p", False, 40, 512, 512), ["t64", "t32"], launched.append, True,
                        like=[("p", True, 40, 512, 512)]) == "t64" and launched == []
    assert tuner.choose(("p", False, 12, 512, 512), ["t64", "t32"], launched.append, True,
                        like=[("p", True, 12, 512, 512)]) == "t64" and launched
    # a fresh path read through the TMA lends its tile to the slots path, as the slots path reads it;
    # of several other paths, the first with a choice of the borrower's
    tuner.best[("p", "tma", 7, 1024, 4096)] = "t32-tma"
    launched.clear()
    assert tuner.choose(("p", False, 7, 64, 64), ["t64", "t32"], launched.append, True,
                        like=[("p", "none", 7, 1, 1), ("p", "tma", 7, 1, 1)],
                        as_own=lambda c: c.removesuffix("-tma")) == "t32" and launched == []


def test_a_choice_timed_once_on_a_gpu_is_recalled_by_the_next_process_untimed(monkeypatch, tmp_path):
    """The tuner's choices kept on disk (``ChoiceStore``): a second tuner (a restart, the benchmark
    after a figure) takes the first's choice and its times untimed (one trial launch); a choice no
    longer among the candidates, another GPU model or changed kernels time anew; ``ORCA_LAB_TUNE=0``
    reads nothing; ``ORCA_LAB_TUNING_CACHE=0`` keeps nothing."""
    import triton
    from orca_lab.kernels import _tuning
    cost, launched = {"a": 3.0, "b": 1.0, "c": 2.0}, []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or cost[launched[-1]])
    monkeypatch.setenv("ORCA_LAB_TUNING_CACHE", str(tmp_path / "cache"))
    key = ("prefill", "fresh-tma", 90, 40, 40, 128, "bf16", 2048, 8192)

    def choose(tuner=None, candidates=("a", "b", "c"), k=key):
        launched.clear()
        return (tuner or LaunchTuner()).choose(k, list(candidates), launched.append, on_gpu=True)

    assert choose() == "b" and set(launched) == set(cost)
    again = LaunchTuner()
    assert choose(again) == "b" and launched == ["b"]
    assert again.timed[key] == cost and key in again.recalled
    settled = LaunchTuner()                 # settled, the store is read before a neighbour is borrowed
    settled.best[key[:-2] + (1, 64)] = "c"
    settled.settle()
    assert choose(settled) == "b" and launched == ["b"]
    assert choose(candidates=("a", "c")) == "c" and set(launched) == {"a", "c"}
    real = _tuning.fingerprint()
    for changed in ({"device": "another GPU"}, {"kernels": "edited"}):
        monkeypatch.setattr(_tuning, "fingerprint", lambda changed=changed: {**real, **changed})
        assert choose() == "b" and set(launched) == set(cost)
    monkeypatch.setenv("ORCA_LAB_TUNE", "0")
    assert choose() == "a" and launched == []
    monkeypatch.setenv("ORCA_LAB_TUNE", "1")
    monkeypatch.setenv("ORCA_LAB_TUNING_CACHE", "0")
    before = sorted((tmp_path / "cache").iterdir())
    assert choose(candidates=("a", "b"), k=key[:-1] + (1,)) == "b"
    assert sorted((tmp_path / "cache").iterdir()) == before


def test_a_store_that_cannot_be_written_or_read_costs_only_the_recall(monkeypatch, tmp_path):
    """A cache folder that is a file: the choice is timed, kept in memory, and a warning names the
    folder; a file of another shape is no recall."""
    import triton
    from orca_lab.kernels import _tuning
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: {"a": 2.0, "b": 1.0}[fn() or launch.last])

    def launch(cfg):
        launch.last = cfg
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("ORCA_LAB_TUNING_CACHE", str(blocked))
    with pytest.warns(RuntimeWarning, match=f"tuning cache {blocked}"):
        assert LaunchTuner().choose(("k", 1), ["a", "b"], launch, on_gpu=True) == "b"
    store = _tuning.ChoiceStore(tmp_path / "ok")
    store.keep(("k", 1), "b", {"a": 2.0, "b": 1.0})
    store._path(("k", 1)).write_text("[1, 2]")
    assert store.recall(("k", 1), ["a", "b"]) is None
    store._path(("k", 1)).write_text(json.dumps({"choice": repr("b"), "timed_ms": [1]}))   # the choice, no times
    assert store.recall(("k", 1), ["a", "b"]) == ("b", {})
    store._path(("k", 1)).write_text(json.dumps({"choice": repr("b"), "timed_ms": {repr("a"): "3", repr("b"): 1}}))
    assert store.recall(("k", 1), ["a", "b"]) == ("b", {"b": 1.0})
    store._path(("k", 1)).write_text(json.dumps({"choice": ["b"]}))
    assert store.recall(("k", 1), ["a", "b"]) is None
    # a write that fails leaves no temporary file behind (here a folder stands where the record goes)
    store._path(("k", 2)).mkdir()
    with pytest.warns(RuntimeWarning, match="tuning cache"):
        store.keep(("k", 2), "a", {"a": 1.0})
    assert not list(store.folder.glob("*.tmp"))


def test_a_recalled_tile_that_fails_to_launch_here_is_timed_anew(monkeypatch, tmp_path):
    """What an earlier process timed on this GPU model may not run here (another driver refusing a
    tensor descriptor): it is launched once before it is trusted, and if it fails, forgotten, named,
    and the candidates are timed again."""
    import triton
    monkeypatch.setenv("ORCA_LAB_TUNING_CACHE", str(tmp_path))
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or {"a": 2.0, "b": 1.0}[launch.last])
    broken = set()

    def launch(cfg):
        if cfg in broken:
            raise RuntimeError("Triton Error [CUDA]: invalid argument")
        launch.last = cfg
    assert LaunchTuner().choose(("k", 1), ["a", "b"], launch, on_gpu=True) == "b"
    broken.add("b")
    with pytest.warns(RuntimeWarning, match="configuration b, timed by an earlier process, fails here .*invalid argument"):
        assert LaunchTuner().choose(("k", 1), ["a", "b"], launch, on_gpu=True) == "a"
    broken.clear()
    again = LaunchTuner()
    assert again.choose(("k", 1), ["a", "b"], launch, on_gpu=True) == "a" and ("k", 1) in again.recalled


def test_tf32_is_a_validated_engine_option():
    assert EngineConfig().tf32 is False and EngineConfig(tf32=True).tf32 is True
    with pytest.raises(ValueError, match="tf32='yes'"):
        EngineConfig(tf32="yes")
    before = torch.backends.cuda.matmul.allow_tf32
    with attention.tf32_matmuls(True):
        assert torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cuda.matmul.allow_tf32 == before
    assert attention._dot_precision(torch.float32, False) == "ieee"
    assert attention._dot_precision(torch.float32, True) == "tf32"


def test_a_candidate_that_answers_otherwise_is_never_picked_for_being_fast(monkeypatch):
    """A tile that compiles and runs but computes wrongly (here the fastest) is skipped and named;
    tiles that differ only in accumulation order agree, and rows no launch wrote (NaN) match."""
    import triton
    cost = {"first": 3.0, "close": 2.0, "wrong": 1.0}
    out = torch.full((4, 2), float("nan"))
    written = {"first": 1.0, "close": 1.0 + 1e-3, "wrong": 1.5}

    def launch(cfg):
        out[:2] = written[cfg]
        launch.last = cfg

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or cost[launch.last])
    with pytest.warns(RuntimeWarning, match="wrong answers other than first \\(largest difference 0.5\\): skipped"):
        assert LaunchTuner().choose("key", list(cost), launch, on_gpu=True, answer=lambda: out) == "close"
