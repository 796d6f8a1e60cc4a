"""The Llama family (Llama 2/3, Qwen2) with selective batching, beside GPT-2 (``gpt.py``).

Four blocks differ from GPT's: RMSNorm for LayerNorm, rotary positions (applied to q and k before K
is written to the pool) for learned ones, a SwiGLU MLP for GeLU, and grouped-query attention: the
pool holds ``n_kv_heads`` heads per slot, each shared by ``n_heads / n_kv_heads`` query heads. No
biases, but Qwen2's on q, k and v. Everything else (the flat ``[sum L, H]`` batch, the attention
plan, the K/V pool, pipeline stages, tensor-parallel all-reduces) is GPT's, inherited, and so is how
an op is run: each through its ``orca_lab.kernels`` wrapper, which picks Triton or PyTorch from the
model's ``fused_ops_backend`` (RMSNorm, SiLU-and-multiply, rotary) or ``attention_backend`` (the K/V
write, grouped attention), the PyTorch one being the reference.

Parameters carry GPT's names where they play its part, so the weight sources and tensor parallelism
read them alike: ``c_attn`` is q, k and v stacked, ``c_fc`` the gate and up projections stacked,
``attn_proj`` / ``mlp_proj`` the row-parallel o and down projections, ``ln_*`` the norms' gains.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from orca_lab import kernels
from orca_lab.config import ModelConfig
from orca_lab.kernels.attention import tf32_matmuls
from orca_lab.model.checkpoint import SafetensorFiles
from orca_lab.model.gpt import GPT, Block, _place, chunk_dim


class RMSNorm(nn.Module):
    """The gain of an RMSNorm (the op is ``kernels.rms_norm``, called with the block's epsilon)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class LlamaBlock(Block):
    def __init__(self, cfg: ModelConfig, n_heads: int | None = None):
        """``n_heads``: a tensor-parallel rank's share of the query heads, and so of the K/V heads."""
        nn.Module.__init__(self)
        d, D = cfg.d_model, cfg.head_dim
        h = n_heads or cfg.n_heads
        kv = cfg.kv_heads_on(cfg.n_heads // h)
        self.n_heads, self.n_kv_heads, self.head_dim, self.eps = h, kv, D, cfg.layer_norm_eps
        self.ln_1 = RMSNorm(d)
        self.c_attn = nn.Linear(d, (h + 2 * kv) * D, bias=cfg.qkv_bias)       # q, k, v stacked
        self.attn_proj = nn.Linear(h * D, d, bias=False)
        self.ln_2 = RMSNorm(d)
        d_ff = cfg.d_ff * h // cfg.n_heads   # tensor parallelism splits the MLP with the heads
        self.c_fc = nn.Linear(d, 2 * d_ff, bias=False)                       # gate, up stacked
        self.mlp_proj = nn.Linear(d_ff, d, bias=False)
        self.all_reduce = None

    def forward(self, x, attend, backend: str):
        """Pre-RMSNorm block on ``x [T, H]``, through the kernels as GPT's ``Block`` (unchecked: the
        engine built every argument); ``attend(qk, v)`` takes q and k as one ``[T, heads + kv heads, D]``
        view, rotates them together, writes k and v to the pool and attends (``Llama._attention_for``)."""
        T, D = len(x), self.head_dim
        h = kernels.rms_norm(x, self.ln_1.weight, self.eps, backend=backend, check=False)
        qk, v = F.linear(h, self.c_attn.weight, self.c_attn.bias).split(
            ((self.n_heads + self.n_kv_heads) * D, self.n_kv_heads * D), -1)
        a = attend(qk.view(T, -1, D), v.view(T, self.n_kv_heads, D))
        h, x = kernels.rms_norm(self._row_parallel(a.flatten(1), self.attn_proj), self.ln_2.weight, self.eps,
                                residual=x, backend=backend, check=False)
        m = kernels.silu_and_mul(F.linear(h, self.c_fc.weight), backend=backend, check=False)
        return x + self._row_parallel(m, self.mlp_proj)


class Llama(GPT):
    Block = LlamaBlock

    def build_modules(self, cfg: ModelConfig):
        """Token embedding (no positions: they rotate q and k), blocks, final RMSNorm, and an LM head
        of its own unless tied to the embedding."""
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rotary_caches = {}     # device -> cos/sin of every position (``rotary_cache``)

    def embed(self, bt) -> torch.Tensor:
        return self.wte(bt.input_ids)

    def head_at(self, x, rows) -> torch.Tensor:
        h = kernels.rms_norm(x.index_select(0, rows), self.ln_f.weight, self.cfg.layer_norm_eps,
                             backend=self.fused_ops_backend, check=False)
        with tf32_matmuls(self.tf32 and x.is_cuda):
            return F.linear(h, (self.wte if self.lm_head is None else self.lm_head).weight)

    def _attention_for(self, bt, x):
        """Each layer's ``attend(qk, v)``: q and k rotated at the batch's own per-token positions (a
        token-wise op: ``fused_ops_backend``, one launch for both), then GPT's attention, which writes
        the rotated k to the pool (so attention needs no positions) and reads each K/V head once for
        its group of query heads."""
        positions, cache = bt.positions, self.rotary_cache(x.device)

        def for_layer(k_pool, v_pool):
            attend = self._attention(bt, k_pool, v_pool)

            def rotate_and_attend(qk, v):
                qk = kernels.apply_rotary(qk, positions, cache, backend=self.fused_ops_backend, check=False)
                return attend(*qk.split((qk.shape[1] - v.shape[1], v.shape[1]), 1), v)
            return rotate_and_attend
        return for_layer

    def rotary_cache(self, device) -> torch.Tensor:
        """cos and sin of every position below ``max_seq_len`` (``kernels.cos_sin_cache``, fp32), made
        on ``device`` by the first iteration there (before a CUDA graph is captured) and kept."""
        if device not in self.rotary_caches:
            self.rotary_caches[device] = kernels.cos_sin_cache(inverse_frequencies(self.cfg).to(device),
                                                               self.cfg.max_seq_len)
        return self.rotary_caches[device]

    def save_pretrained(self, path):
        """Write this model as a Hugging Face Llama (Qwen2, with q/k/v biases) checkpoint."""
        from safetensors.torch import save_file
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        hf, kv = {}, self.cfg.n_kv_heads * self.cfg.head_dim
        for name, t in self.state_dict().items():
            t = t.detach().float().cpu()
            names = hf_names(name)                       # q, k, v / gate, up: unstacked
            sizes = [len(t) - 2 * kv, kv, kv] if len(names) == 3 else [len(t) // len(names)] * len(names)
            hf.update({n: piece.contiguous() for n, piece in zip(names, t.split(sizes))})
        save_file(hf, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(config_to_hf(self.cfg), indent=2))


# -- rotary position embeddings --------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """``theta ** (-2i / D)`` per pair of dimensions (fp32), with Llama 3's scaling when configured:
    wavelengths beyond the original context divided by ``factor``, those between the two bounds
    blended smoothly (as transformers' ``_compute_llama3_parameters``)."""
    inv = kernels.rope_inv_freq(cfg.head_dim, cfg.rope_theta)
    if cfg.rope_scaling is None:
        return inv
    s = dict(cfg.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


# -- the Hugging Face Llama / Qwen2 layout --------------------------------------------------------
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_BLOCK_NAMES = {"ln_1.weight": ("input_layernorm.weight",),
                "c_attn.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                "c_attn.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                "attn_proj.weight": ("self_attn.o_proj.weight",),
                "ln_2.weight": ("post_attention_layernorm.weight",),
                "c_fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                "mlp_proj.weight": ("mlp.down_proj.weight",)}
_TOP_NAMES = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}


def hf_names(ours: str) -> tuple[str, ...]:
    """The checkpoint tensors that parameter ``ours`` stacks (along dim 0), in order."""
    if ours.startswith("blocks."):
        _, i, leaf = ours.split(".", 2)
        return tuple(f"model.layers.{i}.{n}" for n in _BLOCK_NAMES[leaf])
    return (_TOP_NAMES[ours],)


class LlamaCheckpointWeights:
    """A Llama or Qwen2 checkpoint directory, one safetensors file or sharded: each parameter read
    slice by slice from the tensors it stacks (q, k, v; gate, up), so a tensor-parallel worker reads
    only its heads of each and a pipeline stage only its layers."""

    def __init__(self, path, cfg: ModelConfig, device="cpu", dtype=torch.float32):
        self.path, self.cfg, self.device, self.dtype = Path(path), cfg, device, dtype
        self.files = SafetensorFiles(path)

    def read(self, name: str, shape: tuple, ranges=None) -> torch.Tensor:
        parts = []
        for hf in hf_names(name):
            if hf not in self.files.keys():
                raise KeyError(f"{self.path} has no tensor {hf!r} (for {name!r})")
            parts.append(self.files.get_slice(hf))
        dim = chunk_dim(name)
        stored = [tuple(p.get_shape()) for p in parts]
        total = (sum(s[0] for s in stored), *stored[0][1:]) if dim == 0 else stored[0]
        if len(parts) > 1 and dim:
            raise ValueError(f"{name!r} stacks {len(parts)} tensors along dim 0 but splits along {dim}")
        if total != tuple(shape) or any(s[1:] != stored[0][1:] for s in stored):
            raise ValueError(f"{', '.join(hf_names(name))} have shapes {stored} in the checkpoint: "
                             f"{name!r} needs {tuple(shape)} stacked")
        pieces = []
        for a, b in ((0, shape[dim]),) if ranges is None else ranges:
            at = 0
            for part, s in zip(parts, stored):       # the rows of [a, b) each stacked tensor holds
                lo, hi = max(a, at), min(b, at + s[dim])
                if lo < hi:
                    pieces.append(part[lo - at:hi - at] if dim == 0 else part[:, lo - at:hi - at])
                at += s[dim]
        return _place(torch.cat(pieces, dim), self.device, self.dtype)


def _field(c: dict, key: str, *, default=None):
    """``c[key]`` (``default`` when absent, if there is one); absent or null without a default is refused."""
    value = c.get(key, default)
    if value is None:
        raise ValueError(f"{key!r} is missing: a Llama or Qwen2 config needs it")
    return value


def config_from_hf(c: dict, name: str = "hf") -> ModelConfig:
    """The shape of a Llama or Qwen2 ``config.json``; what this family does not run is refused,
    naming the field."""
    arch = c["architectures"][0]
    qwen = arch == "Qwen2ForCausalLM"
    refuse = {"hidden_act": ("silu", _field(c, "hidden_act", default="silu")),
              "mlp_bias": (False, c.get("mlp_bias", False)),
              "use_sliding_window": (False, c.get("use_sliding_window", False)),
              "attention_bias": (qwen, c.get("attention_bias", qwen))}   # Llama's would bias o_proj too
    for key, (allowed, value) in refuse.items():
        if value != allowed:
            raise ValueError(f"{key}={value!r} is not supported for {arch} (allowed: {allowed!r})")
    d, heads = _field(c, "hidden_size"), _field(c, "num_attention_heads")
    head_dim = c.get("head_dim")
    if head_dim is not None and isinstance(d, int) and isinstance(heads, int) and heads and head_dim * heads != d:
        raise ValueError(f"head_dim={head_dim} is not supported: only hidden_size / "
                         f"num_attention_heads = {d // heads}")
    rope = c.get("rope_parameters") or {**(c.get("rope_scaling") or {}),
                                        "rope_theta": c.get("rope_theta", 10000.0)}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type != "default":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = tuple(sorted([("rope_type", rope_type), *((k, rope.get(k)) for k in keys)]))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={rope['partial_rotary_factor']} is not "
                         "supported (allowed: 1.0)")
    return ModelConfig(name=name, n_layers=_field(c, "num_hidden_layers"), d_model=d, n_heads=heads,
                       vocab_size=_field(c, "vocab_size"), max_seq_len=_field(c, "max_position_embeddings"),
                       layer_norm_eps=_field(c, "rms_norm_eps", default=1e-6), family="llama",
                       n_kv_heads=c.get("num_key_value_heads") or heads,
                       intermediate_size=_field(c, "intermediate_size"),
                       rope_theta=float(rope.get("rope_theta", 10000.0)), rope_scaling=scaling,
                       tie_embeddings=c.get("tie_word_embeddings", False), qkv_bias=qwen)


def config_to_hf(cfg: ModelConfig) -> dict:
    arch = ARCHITECTURES[cfg.qkv_bias]
    rope = {"rope_type": "default", **dict(cfg.rope_scaling or ()), "rope_theta": cfg.rope_theta}
    return {"architectures": [arch], "model_type": "qwen2" if cfg.qkv_bias else "llama",
            "num_hidden_layers": cfg.n_layers, "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.d_ff, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.layer_norm_eps, "hidden_act": "silu",
            "rope_theta": cfg.rope_theta, "rope_parameters": rope,
            "rope_scaling": None if cfg.rope_scaling is None else dict(cfg.rope_scaling),
            "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": cfg.vocab_size - 1,
            "eos_token_id": cfg.vocab_size - 1}
