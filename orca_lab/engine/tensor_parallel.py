"""Intra-layer (tensor) parallelism, Megatron-LM style (ORCA §4.3), cut from the full model's weights.

Rank ``t`` of ``T`` owns attention heads ``[t*h, (t+1)*h)`` with ``h = n_heads / T``:
- QKV (``c_attn``) and the first MLP linear (``c_fc``) are split by output columns: each rank computes
  its heads' q, k, v and its quarter of the MLP's hidden units with no communication;
- the attention output (``attn_proj``) and second MLP linear (``mlp_proj``) are split by input rows:
  each rank produces a partial sum of the full ``[T, H]`` output, ``Block.all_reduce`` adds them, and
  the bias (kept whole) is added once, after the reduction;
- the token embedding is split by vocabulary rows (``VocabParallelEmbedding``); the tied LM head then
  gives each rank the logits of its rows, which the worker all-gathers.
LayerNorms and position embeddings are small and replicated. So is the residual stream: every rank of
a stage ends a layer with the same ``[sum L, H]`` tensor, which it sends to its peer in the next stage.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from orca_lab.engine.model import GPT, Block


def shard_block(full: Block, cfg, t: int, T: int, all_reduce=None) -> Block:
    """Rank ``t``'s share of one transformer block (copies: the full block can be dropped)."""
    h, D, d = cfg.n_heads // T, cfg.head_dim, cfg.d_model
    heads = slice(t * h, (t + 1) * h)
    ff = slice(t * cfg.d_ff // T, (t + 1) * cfg.d_ff // T)
    w = full.state_dict()
    cols = {  # by output columns: q, k and v each keep this rank's heads
        "c_attn.weight": w["c_attn.weight"].view(3, cfg.n_heads, D, d)[:, heads].reshape(3 * h * D, d),
        "c_attn.bias": w["c_attn.bias"].view(3, cfg.n_heads, D)[:, heads].reshape(3 * h * D),
        "c_fc.weight": w["c_fc.weight"][ff], "c_fc.bias": w["c_fc.bias"][ff],
    }
    rows = {  # by input rows: partial sums, all-reduced; biases whole, added after the reduction
        "attn_proj.weight": w["attn_proj.weight"].view(d, cfg.n_heads, D)[:, heads].reshape(d, h * D),
        "mlp_proj.weight": w["mlp_proj.weight"][:, ff],
    }
    with torch.device("meta"):
        block = Block(cfg, n_heads=h)
    block.load_state_dict({k: v.clone() for k, v in {**w, **cols, **rows}.items()}, assign=True)
    block.all_reduce = all_reduce if T > 1 else None
    return block


class VocabParallelEmbedding(nn.Module):
    """Rows ``[lo, lo + n)`` of the token embedding, ``n = ceil(V / T)`` (zero-padded so every rank's
    piece has the same size for the all-gather). A lookup gives the row where this rank owns the id
    and zeros elsewhere; the all-reduce sums one real row with zeros: exactly the full embedding."""

    def __init__(self, full_weight: torch.Tensor, t: int, T: int, all_reduce=None):
        super().__init__()
        V, d = full_weight.shape
        self.n, self.lo = -(-V // T), t * -(-V // T)
        piece = torch.zeros(self.n, d, dtype=full_weight.dtype)
        rows = full_weight[self.lo:self.lo + self.n]
        piece[:len(rows)] = rows
        self.weight = nn.Parameter(piece, requires_grad=False)
        self.all_reduce = all_reduce if T > 1 else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        mine = (local >= 0) & (local < self.n)
        x = F.embedding(local.clamp(0, self.n - 1), self.weight).masked_fill(~mine[..., None], 0.0)
        return x if self.all_reduce is None else self.all_reduce(x)


def stage_model(full: GPT, layers: tuple[int, int], t: int, T: int, *, first: bool, last: bool,
                all_reduce=None) -> GPT:
    """The part of ``full`` that worker ``(stage, t)`` runs: its layers' blocks sharded over heads,
    plus the embeddings on the first stage and the final LayerNorm and LM head on the last.
    Parts it does not own are None. Its blocks are numbered from 0 (the worker's K/V pool too)."""
    with torch.device("meta"):
        part = GPT(full.cfg, full.attention_backend, full.fused_ops_backend, full.tf32)
    part.blocks = nn.ModuleList(shard_block(full.blocks[i], full.cfg, t, T, all_reduce)
                                for i in range(*layers))
    part.wte = VocabParallelEmbedding(full.wte.weight.detach(), t, T, all_reduce) if first or last else None
    part.wpe = nn.Embedding.from_pretrained(full.wpe.weight.detach().clone()) if first else None
    part.ln_f = _copy_layer_norm(full.ln_f) if last else None
    return part.eval()


def _copy_layer_norm(ln: nn.LayerNorm) -> nn.LayerNorm:
    new = nn.LayerNorm(ln.normalized_shape, eps=ln.eps)
    new.load_state_dict({k: v.clone() for k, v in ln.state_dict().items()})
    return new
