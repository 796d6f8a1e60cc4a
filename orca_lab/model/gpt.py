"""GPT with selective batching (ORCA §3), readable top to bottom.

Every token-wise op (Linear, LayerNorm, GeLU, Add) runs on the flat ``[sum L, H]`` tensor of the
whole iteration; only attention is split per request, over that request's K/V in the slot pool.
The request-level baseline's padded batches run the same way, laid flat (``engine/batch.py``).
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from orca_lab import kernels
from orca_lab.config import ModelConfig
from orca_lab.kernels._backend import use_triton
from orca_lab.kernels.attention import (attention_plan, ragged_attention_torch, ragged_attention_triton,
                                        tf32_matmuls, triton_plan)
from orca_lab.model.checkpoint import SafetensorFiles


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, n_heads: int | None = None):
        super().__init__()
        d, h = cfg.d_model, n_heads or cfg.n_heads
        self.n_heads, self.head_dim, self.eps = h, cfg.head_dim, cfg.layer_norm_eps
        self.ln_1 = nn.LayerNorm(d, eps=self.eps)
        self.c_attn = nn.Linear(d, 3 * h * self.head_dim)
        self.attn_proj = nn.Linear(h * self.head_dim, d)
        self.ln_2 = nn.LayerNorm(d, eps=self.eps)
        d_ff = cfg.d_ff * h // cfg.n_heads   # tensor parallelism splits the MLP with the heads
        self.c_fc = nn.Linear(d, d_ff)
        self.mlp_proj = nn.Linear(d_ff, d)
        self.all_reduce = None               # set by tensor-parallel workers: sums partial outputs

    def forward(self, x, attend, backend: str):
        """Pre-LayerNorm block on the residual stream ``x [T, H]``; ``attend(q, k, v)`` is the only
        op that looks across tokens. The kernels skip their argument checks (``check=False``): the
        engine built every argument itself, and the checks cost more than a small layer."""
        h = kernels.layer_norm(x, self.ln_1.weight, self.ln_1.bias, self.eps, backend=backend, check=False)
        qkv = F.linear(h, self.c_attn.weight, self.c_attn.bias).view(len(x), 3, self.n_heads, self.head_dim)
        a = self._row_parallel(attend(*qkv.unbind(1)).flatten(1), self.attn_proj)
        h, x = kernels.layer_norm(a, self.ln_2.weight, self.ln_2.bias, self.eps, residual=x, backend=backend,
                                  check=False)
        m = kernels.bias_gelu(F.linear(h, self.c_fc.weight), self.c_fc.bias, backend=backend, check=False)
        return x + self._row_parallel(m, self.mlp_proj)

    def _row_parallel(self, t, linear):
        """A linear whose input is split by features under tensor parallelism: the ranks' partial
        products are summed first, then the bias is added once. Alone, the bias rides in the matmul."""
        if self.all_reduce is None:
            return F.linear(t, linear.weight, linear.bias)
        out = self.all_reduce(F.linear(t, linear.weight))
        return out if linear.bias is None else out + linear.bias


class GPT(nn.Module):
    Block = Block      # a family's block (tensor_parallel.py builds each rank's share of one)

    def __init__(self, cfg: ModelConfig, attention_backend="auto", fused_ops_backend="auto", tf32=False):
        super().__init__()
        self.cfg = cfg
        self.attention_backend, self.fused_ops_backend = attention_backend, fused_ops_backend
        self.tf32 = tf32     # fp32 matmuls and attention dots on TF32 tensor cores (a GPU only)
        self.build_modules(cfg)

    def build_modules(self, cfg: ModelConfig):
        """GPT-2's modules: token and learned position embeddings, blocks, final LayerNorm."""
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    # -- the forward, in the three parts a pipeline stage may own ------------------------------
    def embed(self, bt) -> torch.Tensor:
        """Token + position embeddings of the flat batch: ``[T, H]``."""
        return self.wte(bt.input_ids) + self.wpe(bt.positions)

    def run_layers(self, x, bt, kv, lo: int = 0, hi: int | None = None, layer_offset: int = 0):
        """Blocks ``lo..hi`` on ``x``; ``kv.layer(i - layer_offset)`` holds block i's K/V pool."""
        hi = len(self.blocks) if hi is None else hi
        attention = self._attention_for(bt, x)
        with tf32_matmuls(self.tf32 and x.is_cuda):
            for i in range(lo, hi):
                x = self.blocks[i](x, attention(*kv.layer(i - layer_offset)), self.fused_ops_backend)
        return x

    def head(self, x, bt) -> torch.Tensor:
        """Logits of each request's last new token only: ``[B, vocab]`` (LM head tied to wte)."""
        return self.head_at(x, bt.last_idx)

    def head_at(self, x, rows) -> torch.Tensor:
        """Logits of the tokens ``rows`` of ``x``: ``[len(rows), vocab]`` (a prompt's, for its logprobs)."""
        h = F.layer_norm(x.index_select(0, rows), (self.cfg.d_model,), self.ln_f.weight, self.ln_f.bias,
                         self.cfg.layer_norm_eps)
        with tf32_matmuls(self.tf32 and x.is_cuda):
            return F.linear(h, self.wte.weight)

    def forward(self, bt, kv) -> torch.Tensor:
        return self.head(self.run_layers(self.embed(bt), bt, kv), bt)

    def _attention_for(self, bt, x):
        """``(k_pool, v_pool) -> attend`` of this iteration (``x``: its activations): what its layers
        share (a family's positional tables) is made here, once per iteration."""
        return lambda k_pool, v_pool: self._attention(bt, k_pool, v_pool)

    def _attention(self, bt, k_pool, v_pool):
        """``attend(q, k, v)`` of one layer. The kernels run unchecked (``check=False``) on what the
        engine built itself; the plan, built by the first layer from host data, checked the slots.
        ``k, v`` and the pools hold this rank's K/V heads, each shared by a group of its query heads
        (grouped-query attention): every path reads a K/V head once for its whole group."""
        backend, scale = self.attention_backend, 1.0 / math.sqrt(self.cfg.head_dim)
        triton = use_triton(backend, k_pool)
        plan = _plan(bt, triton, k_pool.shape[0])

        def attend(q, k, v):
            kernels.write_kv(k, v, k_pool, v_pool, bt.slot_mapping, backend=backend, check=False)
            if triton:
                return ragged_attention_triton(q, k_pool, v_pool, bt.kv_slot_ids, bt.cu_seqlens_q,
                                               bt.cu_seqlens_k, scale, plan, tf32=self.tf32, k=k, v=v)
            return ragged_attention_torch(q, k_pool, v_pool, plan, scale, k, v)
        return attend

    # -- weights ----------------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: ModelConfig, weights, **kw) -> "GPT":
        """The whole model with every parameter read from ``weights`` (``RandomWeights``,
        ``CheckpointWeights`` or ``StateDictWeights``), each tensor made once, on its final device."""
        with torch.device("meta"):
            model = cls(cfg, **kw)
        state = {name: weights.read(name, tuple(p.shape)) for name, p in model.named_parameters()}
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval()

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, device="cpu", dtype=torch.float32, *,
               init_device=None, **kw) -> "GPT":
        """Seeded random weights, biases and norms included (never zeros). The scale, 0.1, is five
        times GPT-2's init: wide enough that greedy outputs vary from token to token, so a batching
        bug changes them. ``device="meta"`` builds the shapes only, for paper-scale presets.

        The numbers are drawn on ``init_device`` (default: ``device``'s type) in chunks, each from its
        own generator (``RandomWeights``), straight into the final tensors: a GPU builds gpt3-13b in
        seconds, and a tensor-parallel worker draws only its shard, equal to the same slice of this
        model. CPU and CUDA generators differ: pass ``init_device="cpu"`` for the CPU's numbers on a GPU."""
        if str(device) == "meta":
            with torch.device("meta"):
                return cls(cfg, **kw).eval()
        return cls.build(cfg, RandomWeights(seed, device, dtype, init_device), **kw)

    def save_pretrained(self, path):
        """Write this model as a Hugging Face GPT-2 checkpoint (transformers can load it)."""
        from safetensors.torch import save_file
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
        hf = {_hf_name(k): v for k, v in _to_conv1d(state).items()}
        save_file(hf, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(config_to_hf(self.cfg), indent=2))


def _plan(bt, triton: bool, n_slots: int):
    """The iteration's attention plan, built by the first layer from the batch's host copies (no
    read from the device) and read by the others. The slot ids are checked here, once."""
    if bt.attn_plan is None:
        bt.check_slots(n_slots)
        if triton:
            bt.attn_plan = triton_plan(bt.cu_q_host, bt.cu_k_host, bt.kv_slot_ids.device)
        else:
            bt.attn_plan = attention_plan(bt.cu_q_host, bt.cu_k_host, bt.kv_slot_ids,
                                          bt.slots_host[len(bt.slot_mapping):])
    return bt.attn_plan


# -- weights, whole or by shard --------------------------------------------------------------------
# A source's ``read(name, shape, ranges)`` gives parameter ``name`` (full shape ``shape``) on its
# device and dtype: whole, or only the pieces ``ranges = ((lo, hi), ...)`` along ``chunk_dim(name)``,
# concatenated. Tensor-parallel workers read their shards this way (``tensor_parallel.py``).

def chunk_dim(name: str) -> int:
    """The dimension tensor parallelism splits ``name`` along: the input features of the
    row-parallel linears, the first dimension of every other tensor."""
    return 1 if name.endswith(("attn_proj.weight", "mlp_proj.weight")) else 0


def _pieces(t: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    if ranges is None:
        return t
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim)


def _place(t: torch.Tensor, device, dtype) -> torch.Tensor:
    """A tensor of its own on ``device``: never a view into a memory-mapped file."""
    return t.to(device=device, dtype=dtype, copy=True).contiguous()


class RandomWeights:
    """Seeded random weights: ``0.1 * N(0, 1)``, LayerNorm gains ``1 + 0.1 * N(0, 1)``.

    Each tensor is drawn in chunks of whole rows along ``chunk_dim(name)`` (about ``CHUNK`` elements
    each; the row count depends only on the tensor's shape), chunk ``c`` from a generator seeded with
    a hash of ``(seed, name, c)``. So any slice along that dimension is drawn without the rest of the
    tensor, equal to the same slice of the whole: a worker builds only its own shard."""
    CHUNK = 1 << 22

    def __init__(self, seed: int = 0, device="cpu", dtype=torch.float32, init_device=None):
        self.seed, self.device, self.dtype = seed, torch.device(device), dtype
        self.init_device = torch.device(init_device if init_device is not None else self.device)

    def read(self, name: str, shape: tuple, ranges=None) -> torch.Tensor:
        dim = chunk_dim(name)
        n = shape[dim]
        rows = max(1, self.CHUNK // max(1, math.prod(shape) // n))        # per chunk
        ranges = ((0, n),) if ranges is None else ranges
        out = torch.empty(*shape[:dim], sum(b - a for a, b in ranges), *shape[dim + 1:],
                          device=self.device, dtype=self.dtype)
        at = 0
        for a, b in ranges:
            for c in range(a // rows, (b - 1) // rows + 1):
                lo, hi = max(a, c * rows), min(b, (c + 1) * rows)      # this chunk's part of [a, b)
                chunk = self._chunk(name, shape, dim, c, rows)
                out.narrow(dim, at + lo - a, hi - lo).copy_(chunk.narrow(dim, lo - c * rows, hi - lo))
            at += b - a
        return out

    def _chunk(self, name, shape, dim, c, rows) -> torch.Tensor:
        size = list(shape)
        size[dim] = min(rows, shape[dim] - c * rows)
        key = hashlib.blake2b(f"{self.seed}/{name}/{c}".encode(), digest_size=8).digest()
        gen = torch.Generator(self.init_device).manual_seed(int.from_bytes(key, "little"))
        x = torch.randn(size, generator=gen, device=self.init_device).mul_(0.1)
        return x.add_(1.0) if ".ln" in f".{name}" and name.endswith("weight") else x


class StateDictWeights:
    """Slices of a full state dict (for example ``torch.load(..., mmap=True)``: only the pages of
    the slices read are touched)."""

    def __init__(self, state: dict, device="cpu", dtype=torch.float32):
        self.state, self.device, self.dtype = state, device, dtype

    def read(self, name: str, shape: tuple, ranges=None) -> torch.Tensor:
        t = self.state[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"weights[{name!r}] has shape {tuple(t.shape)}, the model needs {tuple(shape)}")
        return _place(_pieces(t, chunk_dim(name), ranges), self.device, self.dtype)


class CheckpointWeights:
    """A GPT-2 checkpoint in the Hugging Face layout (``config.json`` + safetensors), read
    tensor by tensor and slice by slice (``safe_open(...).get_slice``): a worker reads only its
    layers and its shards of them, never the whole file."""

    def __init__(self, path, device="cpu", dtype=torch.float32):
        path = Path(path)
        self.cfg = config_from_hf(json.loads((path / "config.json").read_text()), name=path.name)
        self.file = SafetensorFiles(path)          # one file or sharded: the headers only
        self.keys = {_our_name(k): k for k in self.file.keys() if _our_name(k) is not None}
        self.path, self.device, self.dtype = path, device, dtype

    def read(self, name: str, shape: tuple, ranges=None) -> torch.Tensor:
        if name not in self.keys:
            raise KeyError(f"{self.path} has no tensor for {name!r} ({_hf_name(name)})")
        conv1d = name.endswith(_CONV1D)                  # stored transposed: [in, out]
        dim = chunk_dim(name)
        file_dim = 1 - dim if conv1d else dim
        piece = self.file.get_slice(self.keys[name])
        stored = tuple(piece.get_shape())
        expected = tuple(reversed(shape)) if conv1d else tuple(shape)
        if stored != expected:
            raise ValueError(f"{_hf_name(name)} has shape {stored} in the checkpoint, expected {expected}")
        if ranges is None:
            t = piece[:]
        else:
            t = torch.cat([piece[a:b] if file_dim == 0 else piece[:, a:b] for a, b in ranges], file_dim)
        return _place(t.t() if conv1d else t, self.device, self.dtype)


# -- Hugging Face GPT-2 layout --------------------------------------------------------------------
_HF_NAMES = {"ln_1": "ln_1", "c_attn": "attn.c_attn", "attn_proj": "attn.c_proj", "ln_2": "ln_2",
             "c_fc": "mlp.c_fc", "mlp_proj": "mlp.c_proj"}
_CONV1D = ("c_attn.weight", "attn_proj.weight", "c_fc.weight", "mlp_proj.weight")


def _hf_name(ours: str) -> str:
    if ours.startswith("blocks."):
        _, i, mod, leaf = ours.split(".")
        return f"transformer.h.{i}.{_HF_NAMES[mod]}.{leaf}"
    return f"transformer.{ours}"


def _our_name(hf: str) -> str | None:
    hf = hf.removeprefix("transformer.")
    if hf.startswith("lm_head") or hf.split(".")[-2:] in (["attn", "bias"], ["attn", "masked_bias"]):
        return None   # tied to wte / causal-mask buffers of old checkpoints
    if hf.startswith("h."):
        _, i, *mod, leaf = hf.split(".")
        ours = {v: k for k, v in _HF_NAMES.items()}[".".join(mod)]
        return f"blocks.{i}.{ours}.{leaf}"
    return hf


def _to_conv1d(state):   # HF's Conv1D stores [in, out]; nn.Linear stores [out, in]
    return {k: v.t().contiguous() if k.endswith(_CONV1D) else v for k, v in state.items()}


def config_from_hf(c: dict, name: str = "hf") -> ModelConfig:
    act = c.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function={act!r}: only GPT-2's tanh GeLU is supported")
    return ModelConfig(name=name, n_layers=c["n_layer"], d_model=c["n_embd"], n_heads=c["n_head"],
                       vocab_size=c["vocab_size"], max_seq_len=c["n_positions"],
                       layer_norm_eps=c.get("layer_norm_epsilon", 1e-5))


def config_to_hf(cfg: ModelConfig) -> dict:
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": cfg.n_layers,
            "n_embd": cfg.d_model, "n_head": cfg.n_heads, "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len, "n_inner": None,
            "layer_norm_epsilon": cfg.layer_norm_eps, "activation_function": "gelu_new",
            "tie_word_embeddings": True, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1}
