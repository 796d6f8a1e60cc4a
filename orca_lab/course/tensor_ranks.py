"""Tensor-parallel ranks as threads of this process, built from a learner's split (notebook 07).

The workers (``orca_lab/distributed``) run each rank in a process of its own, over gloo or NCCL. Here
rank ``t`` of ``T`` is a thread running the same ``stage_model`` (every layer, its heads, its rows of
the vocabulary), read through ``LearnerShards``: each linear layer of a block is cut by the learner's
``split_linear``. Each all-reduce a rank calls (``Block.all_reduce``) waits for the ``T`` partial
outputs, and the learner's ``all_reduce`` adds them. ``TensorRanks`` answers what ``LocalExecutor``
asks of a model, so an engine in this process runs it unchanged.
"""
from __future__ import annotations

import threading

import torch

from orca_lab.course.bounded import plain_tensor
from orca_lab.course.guards import fault_of
from orca_lab.model.families import model_class
from orca_lab.model.gpt import chunk_dim
from orca_lab.model.tensor_parallel import shard_ranges, stage_model

WAIT_S = 60.0      # how long a rank waits for the others at an all-reduce (milliseconds when right)


class LearnerShards:
    """Rank ``t``'s weights, read from ``weights`` (a weight source) as ``stage_model`` reads them,
    with each block's linear layers cut by ``split_linear(weight, bias, t, T, parallel)``: q, k, v
    and the MLP's first linear (each of Llama's gate and up) "column", the attention output and the
    MLP's second linear "row". The rest (norms, embeddings, the row-parallel biases, added once after
    the all-reduce) is the package's cut."""

    def __init__(self, weights, cfg, split_linear, t: int, T: int):
        self.weights, self.cfg, self.split_linear, self.t, self.T = weights, cfg, split_linear, t, T
        with torch.device("meta"):
            self.shapes = {k: tuple(p.shape) for k, p in model_class(cfg).Block(cfg).named_parameters()}

    def read(self, name: str, shape: tuple, ranges=None) -> torch.Tensor:
        """Rank ``t``'s ``name``: the learner's cut of a block's linear, checked against the package's
        (the same read through ``weights``) before the model holds it; else the package's."""
        want = self.weights.read(name, shape, ranges)
        if not name.startswith("blocks.") or ranges is None:
            return want
        got = self._cut(name)
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(plain_tensor(got), want)):
            raise fault_of(self.split_linear, "split_linear", f"cut {name} for rank {self.t} of {self.T} other "
                           f"than the package's shard_ranges (shape {tuple(want.shape)} of {tuple(shape)})")
        return plain_tensor(got)

    def _cut(self, name: str):
        leaf = name.split(".", 2)[-1]
        layer, kind = name.rsplit(".", 1)
        w_leaf, b_leaf = leaf.replace(".bias", ".weight"), leaf.replace(".weight", ".bias")
        weight = self.weights.read(f"{layer}.weight", self.shapes[w_leaf])
        bias = self.weights.read(f"{layer}.bias", self.shapes[b_leaf]) if b_leaf in self.shapes else None
        if chunk_dim(f"{layer}.weight") == 1:
            w, b = self.split_linear(weight, bias, self.t, self.T, "row")
            if b is not None:
                raise ValueError(f"your split_linear gave rank {self.t} of {self.T} a bias for {layer} (row-parallel): "
                                 "the layer adds its bias once, after the all-reduce")
            return w
        # stacked linears (q, k, v; gate, up): the pieces of the whole tensor (one rank), each cut alone
        shards = [self.split_linear(weight[a:b], None if bias is None else bias[a:b], self.t, self.T, "column")
                  for a, b in shard_ranges(w_leaf, self.cfg, 0, 1)]
        return torch.cat([s[kind == "bias"] for s in shards])


class ThreadGroup:
    """``T`` ranks as threads, with the all-reduce they call: each hands its partial output, one of
    them adds the ``T`` partials with ``reduce`` (a list of tensors -> their sum) once all are there,
    and every rank goes on with a copy of the sum (as each worker does with its own buffer)."""

    def __init__(self, T: int, reduce):
        self.T, self.reduce = T, reduce
        self.partials: list = [None] * T
        self.whole = None
        self.barrier = threading.Barrier(T, timeout=WAIT_S)

    def all_reduce_of(self, t: int):
        def all_reduce(partial: torch.Tensor) -> torch.Tensor:
            self.partials[t] = partial
            if self.barrier.wait() == 0:         # one rank reduces, once every partial is here
                self.whole = self.reduce(list(self.partials))
            self.barrier.wait()                  # the sum is there; no rank overwrites it before all read it
            return self.whole.clone()
        return all_reduce

    def run(self, fn) -> list:
        """``fn(t)`` on each rank's thread: the results in rank order. An error of one rank breaks
        the others' wait and is raised here."""
        out, errors = [None] * self.T, []

        def rank(t):
            try:
                with torch.inference_mode():
                    out[t] = fn(t)
            except BaseException as e:       # noqa: BLE001  (raised below, in the caller's thread)
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=rank, args=(t,), name=f"tensor rank {t}", daemon=True)
                   for t in range(self.T)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(WAIT_S * 2)
        if any(th.is_alive() for th in threads):
            raise RuntimeError(f"a tensor rank did not return within {WAIT_S * 2:g} s: an all_reduce that never returns?")
        if errors:
            self.barrier.reset()
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return out


def checked_sum(all_reduce):
    """The learner's ``all_reduce(partials)``, each sum checked against the partials' own (in float64,
    taken before theirs: it may add in place) within the rounding a sum of them may make, before the
    ranks go on with it."""
    def reduce(partials: list) -> torch.Tensor:
        wide = torch.stack([p.double() for p in partials])
        want, slack = wide.sum(0), len(partials) * torch.finfo(partials[0].dtype).eps * wide.abs().sum(0)
        got = all_reduce(partials)
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape
                and ((plain_tensor(got).double() - want).abs() <= slack + 1e-30).all()):
            raise fault_of(all_reduce, "all_reduce", f"summed {len(partials)} partials of shape {tuple(want.shape)} "
                           "to other than their sum")
        return plain_tensor(got)
    return reduce


class RankKV:
    """Rank ``t``'s heads of the engine's K/V pool (the heads its share of each block reads)."""

    def __init__(self, kv, heads: tuple[int, int]):
        self.kv, self.heads = kv, slice(*heads)

    def layer(self, i: int):
        k, v = self.kv.layer(i)
        return k[:, self.heads], v[:, self.heads]


class TensorRanks:
    """A model of ``T`` tensor-parallel ranks (threads) in place of a ``GPT`` for ``LocalExecutor``:
    ``weights_of(t)`` is rank ``t``'s weight source, ``reduce`` the all-reduce's sum."""

    def __init__(self, cfg, T: int, weights_of, reduce, **backends):
        self.cfg, self.T, self.group = cfg, T, ThreadGroup(T, reduce)
        self.ranks = [stage_model(weights_of(t), cfg, (0, cfg.n_layers), t, T, first=True, last=True,
                                  all_reduce=self.group.all_reduce_of(t), **backends) for t in range(T)]
        q_rows, D = cfg.n_heads * cfg.head_dim, cfg.head_dim
        self.kv_heads = [tuple((r - q_rows) // D for r in shard_ranges("c_attn.weight", cfg, t, T)[1])
                         for t in range(T)]

    def embed(self, bt) -> list:
        """Each rank's copy of the embedded batch (their sum over the vocabulary's rows)."""
        return self.group.run(lambda t: self.ranks[t].embed(bt))

    def run_layers(self, xs, bt, kv, lo: int = 0, hi: int | None = None) -> list:
        return self.group.run(lambda t: self.ranks[t].run_layers(xs[t], bt, RankKV(kv, self.kv_heads[t]), lo, hi))

    def head(self, xs, bt) -> torch.Tensor:
        return self.head_at(xs, bt.last_idx)

    def head_at(self, xs, rows) -> torch.Tensor:
        """The logits over the whole vocabulary: each rank's rows of it, gathered (as the workers do)."""
        return torch.cat([r.head_at(x, rows) for r, x in zip(self.ranks, xs)], -1)[:, :self.cfg.vocab_size]
