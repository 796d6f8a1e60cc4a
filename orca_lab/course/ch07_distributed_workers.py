"""Chapter 07, distributed workers: the graders of the pipeline's stages and of a tensor-parallel
split of a linear layer with its all-reduce, and its plug point, ``use_split_linear``."""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from orca_lab.course.bounded import plain_tensor, refuse_package_code, run_bounded
from orca_lab.course.forked import grader
from orca_lab.course.harness import N_CASES, Piece, correct, differ, read, same_kind, shown_answer
from orca_lab.course.tensor_ranks import LearnerShards, TensorRanks, checked_sum
from orca_lab.distributed.data_plane import DataPlane
from orca_lab.engine.executor import split_layers
from orca_lab.model.executor import LocalExecutor
from orca_lab.model.gpt import GPT, StateDictWeights
from orca_lab.model.tensor_parallel import even_range, shard_ranges


@grader
def check_split_layers(fn, seed: int = 0):
    """``fn(n_layers, n_stages) -> [(first, end), ...]`` against ``executor.split_layers``."""
    refuse_package_code(fn, split_layers)
    rng = random.Random(seed)
    for case in range(N_CASES):
        n_layers = rng.randint(1, 96)
        n_stages = rng.randint(1, min(n_layers, 16))
        label = f"case {case} (n_layers={n_layers}, n_stages={n_stages})"
        got = read("the stages", label, run_bounded(fn, n_layers, n_stages, case=label, references=(split_layers,)),
                   lambda got: [(int(a), int(b)) for a, b in got], "a list of (first, end) pairs, one per stage")
        expected = split_layers(n_layers, n_stages)
        if got != expected:
            differ("the stages", label, expected, got, f"n_stages={n_stages} pairs" if len(got) != n_stages else
                   "contiguous, in order, sizes differing by at most one: stage i starts at round(i * n_layers / n_stages)")
    correct(N_CASES, "orca_lab.engine.executor.split_layers")


def _package_shard(weight, bias, t: int, T: int, parallel: str):
    """Rank ``t``'s ``(weight, bias)`` as ``shard_ranges`` cuts the model's linears (``even_range``):
    column-parallel, rows (outputs) of the weight and the same entries of the bias; row-parallel,
    columns (inputs) and no bias (the layer adds it once, after the all-reduce)."""
    dim = 0 if parallel == "column" else 1
    lo, hi = even_range(weight.shape[dim], t, T)
    return weight.narrow(dim, lo, hi - lo), bias[lo:hi] if dim == 0 and bias is not None else None


def _span(weight, w, dim: int):
    """``(lo, hi)`` when ``w`` is ``weight``'s slice ``[lo, hi)`` along ``dim``, else None."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1 - dim] != weight.shape[1 - dim]:
        return None
    n = w.shape[dim]
    return next(((lo, lo + n) for lo in range(weight.shape[dim] - n + 1)
                 if torch.equal(weight.narrow(dim, lo, n), w)), None)


def _slice_of(weight, w) -> str:
    for dim in (0, 1):
        where = _span(weight, w, dim)
        if where is not None:
            return f"{('rows', 'columns')[dim]} [{where[0]}, {where[1]}) of weight"
    return f"a tensor of shape {tuple(w.shape)}, not weight's rows or columns"


def _values(t, case) -> str:
    if not isinstance(t, torch.Tensor):
        return shown_answer(t, case)
    return f"shape {tuple(t.shape)}, first values {[round(v, 4) for v in t.flatten()[:4].tolist()]}"


def _split_hint(weight, ws, dim: int, T: int) -> str:
    n, what = weight.shape[dim], ("rows (its outputs)", "columns (its inputs)")[dim]
    spans = [_span(weight, w, dim) for w in ws]
    if T > 1 and None in spans and all(_span(weight, w, 1 - dim) for w in ws):
        return (f"split along the wrong dimension: a {('column', 'row')[dim]}-parallel rank keeps weight's {what} "
                "(nn.Linear stores weight as [out_features, in_features])")
    if None in spans:
        return f"each rank's weight is one contiguous slice of weight's {what}, [lo, hi)"
    rows = [i for lo, hi in spans for i in range(lo, hi)]
    if len(set(rows)) < len(rows):
        return "overlapping shards: rank t starts where rank t-1 ends, every row on exactly one rank"
    if len(rows) < n:
        return (f"missing rows when T does not divide {n}: {n} // {T} per rank leaves {n % T} to no rank; the first "
                f"{n} % {T} ranks take one more" if n % T else "missing rows: every row on exactly one rank")
    if spans != sorted(spans):
        return "the shards in rank order: rank 0 the first rows"
    return "uneven shards: sizes differ by at most one, the first n % T ranks one more (as torch.tensor_split)"


def _bias_hint(parallel: str) -> str:
    if parallel == "row":
        return ("bias added on every rank before the sum: the T partials would carry T x bias. A row-parallel "
                "rank's linear has no bias (None); the layer adds it once, after the all-reduce")
    return "a column-parallel rank keeps the bias entries of its own outputs, bias[lo:hi] (None when bias is None)"


def _reduce_hint(got, partials) -> str:
    whole = torch.stack(partials).sum(0)
    if not isinstance(got, torch.Tensor) or got.shape != whole.shape:
        if isinstance(got, torch.Tensor) and got.shape[-1] == whole.shape[-1] * len(partials):
            return "concatenates the partials: an all-reduce adds them elementwise, each the whole output's shape"
        return f"return one tensor of the partials' shape {tuple(whole.shape)}"
    if len(partials) > 1 and torch.allclose(got, whole / len(partials), atol=1e-5):
        return "averages instead of sums: each rank's partial is a share of the output, not an estimate of it"
    if any(torch.allclose(got, p, atol=1e-5) for p in partials):
        return "one rank's partial: the output is the sum of all T"
    return "the elementwise sum of the T partial outputs"


def _pair(got, label: str, rank: int):
    ok = (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor)
          and (got[1] is None or isinstance(got[1], torch.Tensor)))
    if not ok:
        differ(f"rank {rank}'s shard", label, "(weight_t, bias_t): a tensor, and a tensor or None", shown_answer(got, label),
               "return the pair (weight_t, bias_t)")
    return plain_tensor(got[0]), None if got[1] is None else plain_tensor(got[1])


@grader
def check_split_linear(split_linear, all_reduce, seed: int = 0):
    """``split_linear(weight, bias, t, T, parallel) -> (weight_t, bias_t)`` against the package's cut
    of the model's linears (``shard_ranges``, ``even_range``), rank by rank, for T in 1..4 on random
    shapes (T dividing them or not); then the T ranks' outputs of a row-parallel layer, added by
    ``all_reduce(partials)`` and the bias once, against the unsplit ``F.linear(x, weight, bias)``."""
    refs = (_package_shard, even_range, shard_ranges, DataPlane.all_reduce)
    refuse_package_code(split_linear, *refs)
    refuse_package_code(all_reduce, *refs)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for case in range(N_CASES):
        T = (2, 3, 4, 1)[case % 4]
        d_out, d_in, n = rng.randint(T, 3 * T + 3), rng.randint(T, 3 * T + 3), rng.randint(1, 4)
        weight, x = torch.randn(d_out, d_in, generator=g), torch.randn(n, d_in, generator=g)
        bias = torch.randn(d_out, generator=g) if rng.random() < 0.75 else None
        for dim, parallel in enumerate(("column", "row")):
            label = (f"case {case} (weight [{d_out}, {d_in}], bias {'None' if bias is None else [d_out]}, T={T}, "
                     f"parallel={parallel!r})")
            got = [_pair(run_bounded(split_linear, weight.clone(), None if bias is None else bias.clone(), t, T,
                                     parallel, case=f"{label}, rank {t}", references=refs), label, t)
                   for t in range(T)]
            for t, ((w, b), (w_ref, b_ref)) in enumerate(zip(got, (_package_shard(weight, bias, t, T, parallel)
                                                                   for t in range(T)))):
                same_kind(f"rank {t}'s weight", label, w_ref, w)
                if not (w.shape == w_ref.shape and torch.equal(w, w_ref)):
                    differ(f"rank {t}'s weight", label, _slice_of(weight, w_ref), _slice_of(weight, w),
                           _split_hint(weight, [s[0] for s in got], dim, T))
                if (b is None) != (b_ref is None) or b is not None and not torch.equal(b, b_ref):
                    show = lambda v: "None" if v is None else f"bias of shape {tuple(v.shape)}"  # noqa: E731
                    differ(f"rank {t}'s bias", label, show(b_ref), show(b), _bias_hint(parallel))
        partials = [F.linear(x[:, slice(*even_range(d_in, t, T))], w) for t, (w, _) in enumerate(got)]
        label = f"case {case} (x [{n}, {d_in}], weight [{d_out}, {d_in}], T={T} row-parallel partials)"
        whole = run_bounded(all_reduce, [p.clone() for p in partials], case=label, references=refs)
        whole = plain_tensor(whole) if isinstance(whole, torch.Tensor) else whole
        expected = F.linear(x, weight, bias)
        if isinstance(whole, torch.Tensor) and whole.shape == expected.shape:
            same_kind("your all_reduce's sum", label, expected, whole)
        out = whole + bias if isinstance(whole, torch.Tensor) and bias is not None and whole.shape == expected.shape \
            else whole
        if not (isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.allclose(out, expected, atol=1e-5)):
            differ("the layer's output (your all_reduce of the ranks' partials, then the bias once)", label,
                   f"F.linear(x, weight, bias): {_values(expected, label)}", _values(out, label), _reduce_hint(whole, partials))
    correct(N_CASES, "the package's split (shard_ranges) and the unsplit F.linear")


def use_split_linear(engine, split_linear, all_reduce, T: int):
    """``engine`` (in this process, fresh) running its model on ``T`` tensor-parallel ranks, threads
    of this process (``tensor_ranks.py``): each rank's linear layers cut by the learner's
    ``split_linear(weight, bias, t, T, parallel)``, its partial outputs added by the learner's
    ``all_reduce(partials)`` (notebook 07)."""
    executor = engine.executor
    if not isinstance(executor, LocalExecutor) or not isinstance(executor.model, GPT):
        raise ValueError("use_split_linear takes an engine whose model runs in this process "
                         "(EngineConfig(executor='local'), tensor_parallel=1)")
    model = executor.model
    model.cfg.check_tensor_parallel(T)
    if model.cfg.kv_heads_on(T) * T != model.cfg.n_kv_heads:
        raise ValueError(f"T={T} exceeds n_kv_heads={model.cfg.n_kv_heads}: the ranks would share K/V heads, "
                         f"which a split of rows does not give: allowed T dividing {model.cfg.n_kv_heads}")
    weights = StateDictWeights(model.state_dict(), model.wte.weight.device, model.wte.weight.dtype)
    executor.model = TensorRanks(model.cfg, T, lambda t: LearnerShards(weights, model.cfg, split_linear, t, T),
                                 checked_sum(all_reduce), attention_backend=model.attention_backend,
                                 fused_ops_backend=model.fused_ops_backend, tf32=model.tf32)
    executor.graphs = None              # captured over the whole model
    return engine


def _place_split(engine, pieces, tensor_ranks: int = 1, **options):
    """With ``tensor_ranks`` above 1 the model runs on that many ranks cut by the learner's split
    (refused, a ``ValueError``, without their ``split_linear`` and ``all_reduce``)."""
    if tensor_ranks <= 1:
        return None
    if not {"split_linear", "all_reduce"} <= pieces.keys():
        raise ValueError(f"tensor_ranks={tensor_ranks}: the package has no split_linear and all_reduce "
                         "(notebook 07's exercises) to cut the model with")
    return {"T": tensor_ranks}


_SPLIT = dict(graded=("split_linear", "all_reduce"), plugged=("split_linear", "all_reduce"), place=_place_split)
PIECES = (Piece("split_linear", "07", "tensor_ranks > 1, in this process", check_split_linear, use_split_linear, **_SPLIT),
          Piece("all_reduce", "07", "tensor_ranks > 1, in this process", check_split_linear, use_split_linear, **_SPLIT))
