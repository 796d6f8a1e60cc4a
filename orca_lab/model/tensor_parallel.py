"""Intra-layer (tensor) parallelism, Megatron-LM style (ORCA §4.1), cut from the full model's weights.

Rank ``t`` of ``T`` owns attention heads ``[t*h, (t+1)*h)`` with ``h = n_heads / T``, and the K/V
heads they read (``n_kv_heads / T`` of them, or one replicated head when ``T`` exceeds their number):
- QKV (``c_attn``) and the first MLP linear (``c_fc``) are split by output columns: each rank computes
  its heads' q, k, v and its quarter of the MLP's hidden units with no communication;
- the attention output (``attn_proj``) and second MLP linear (``mlp_proj``) are split by input rows:
  each rank produces a partial sum of the full ``[T, H]`` output, ``Block.all_reduce`` adds them, and
  the bias (kept whole) is added once, after the reduction;
- the token embedding is split by vocabulary rows (``VocabParallelEmbedding``); the tied LM head then
  gives each rank the logits of its rows, which the worker all-gathers.
LayerNorms and position embeddings are small and replicated. So is the residual stream: every rank of
a stage ends a layer with the same ``[sum L, H]`` tensor, which it sends to its peer in the next stage.

A worker never holds the full model: ``stage_model`` reads only its layers, and of them only its
slices, from a weight source (``model.py``: seeded random chunks, a checkpoint's slices, or a state
dict), each straight onto the worker's device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from orca_lab.model.families import model_class
from orca_lab.model.gpt import GPT, Block


def even_range(n: int, t: int, T: int) -> tuple[int, int]:
    """Rank ``t``'s ``[lo, hi)`` of ``n`` rows split over ``T`` ranks: contiguous, in rank order, sizes
    that differ by at most one (the first ``n % T`` ranks take one more, as ``torch.tensor_split``)."""
    size, extra = divmod(n, T)
    lo = t * size + min(t, extra)
    return lo, lo + size + (t < extra)


def shard_ranges(leaf: str, cfg, t: int, T: int):
    """Rank ``t``'s pieces of block parameter ``leaf`` along ``chunk_dim`` (None: the whole tensor).
    q, k and v each keep this rank's heads (rows of c_attn; K/V heads replicated when ``T`` exceeds
    their number); the MLP's hidden units split evenly (Llama's gate and up each); attn_proj and
    mlp_proj split by input rows, so their outputs are partial sums (all-reduced)."""
    D, (ff_lo, ff_hi) = cfg.head_dim, even_range(cfg.d_ff, t, T)
    q_lo, q_hi = (D * h for h in even_range(cfg.n_heads, t, T))
    kvD, kv_lo = cfg.kv_heads_on(T) * D, t * cfg.n_kv_heads // T * D
    if leaf.startswith("c_attn."):
        q_rows, kv_rows = cfg.n_heads * D, cfg.n_kv_heads * D
        return ((q_lo, q_hi), (q_rows + kv_lo, q_rows + kv_lo + kvD),
                (q_rows + kv_rows + kv_lo, q_rows + kv_rows + kv_lo + kvD))
    if leaf == "attn_proj.weight":
        return ((q_lo, q_hi),)
    if leaf.startswith("c_fc.") and cfg.family == "llama":      # gate and up stacked
        return ((ff_lo, ff_hi), (cfg.d_ff + ff_lo, cfg.d_ff + ff_hi))
    if leaf.startswith("c_fc.") or leaf == "mlp_proj.weight":
        return ((ff_lo, ff_hi),)
    return None            # norms and the row-parallel biases (added once, after the reduction)


def shard_block(weights, i: int, cfg, t: int, T: int, all_reduce=None) -> Block:
    """Rank ``t``'s share of transformer block ``i``, read from ``weights``."""
    Block = model_class(cfg).Block
    with torch.device("meta"):
        full, block = Block(cfg), Block(cfg, n_heads=cfg.n_heads // T)
    block.load_state_dict({leaf: weights.read(f"blocks.{i}.{leaf}", tuple(p.shape), shard_ranges(leaf, cfg, t, T))
                           for leaf, p in full.named_parameters()}, assign=True)
    block.all_reduce = all_reduce if T > 1 else None
    return block


class VocabParallelEmbedding(nn.Module):
    """Rows ``[lo, lo + n)`` of the token embedding, ``n = ceil(V / T)`` (zero-padded so every rank's
    piece has the same size for the all-gather). A lookup gives the row where this rank owns the id
    and zeros elsewhere; the all-reduce sums one real row with zeros: exactly the full embedding."""

    def __init__(self, rows: torch.Tensor, lo: int, n: int, all_reduce=None):
        super().__init__()
        self.n, self.lo = n, lo
        piece = torch.zeros(n, rows.shape[1], dtype=rows.dtype, device=rows.device)
        piece[:len(rows)] = rows
        self.weight = nn.Parameter(piece, requires_grad=False)
        self.all_reduce = all_reduce

    @classmethod
    def read(cls, weights, cfg, t: int, T: int, all_reduce=None, name="wte.weight") -> "VocabParallelEmbedding":
        V, n = cfg.vocab_size, -(-cfg.vocab_size // T)
        lo = min(t * n, V)
        rows = weights.read(name, (V, cfg.d_model), ((lo, min(lo + n, V)),))
        return cls(rows, lo, n, all_reduce if T > 1 else None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        mine = (local >= 0) & (local < self.n)
        x = F.embedding(local.clamp(0, self.n - 1), self.weight).masked_fill(~mine[..., None], 0.0)
        return x if self.all_reduce is None else self.all_reduce(x)


def stage_model(weights, cfg, layers: tuple[int, int], t: int, T: int, *, first: bool, last: bool,
                all_reduce=None, **backends) -> GPT:
    """The part of the model that worker ``(stage, t)`` runs, read from ``weights``: its layers'
    blocks sharded over heads, plus the embeddings on the first stage (GPT's positions too) and the
    final norm and LM head on the last (the token embedding's rows, when tied). Parts it does not own
    are None. Its blocks are numbered from 0 (the worker's K/V pool too)."""
    with torch.device("meta"):
        part = model_class(cfg)(cfg, **backends)
    part.blocks = nn.ModuleList(shard_block(weights, i, cfg, t, T, all_reduce) for i in range(*layers))
    owned = {"wte": first or (last and cfg.tie_embeddings), "wpe": first, "ln_f": last, "lm_head": last}
    for name, module in list(part.named_children()):
        if name == "blocks" or module is None:
            continue
        if not owned[name]:
            setattr(part, name, None)
        elif name in ("wte", "lm_head"):       # vocabulary-parallel rows
            setattr(part, name, VocabParallelEmbedding.read(weights, cfg, t, T, all_reduce, f"{name}.weight"))
        else:
            module.load_state_dict({k: weights.read(f"{name}.{k}", tuple(p.shape))
                                    for k, p in module.named_parameters()}, assign=True)
    return part.eval()
