"""Analytical cost of one iteration: FLOPs and bytes of every op on ``[sum L, H]``, on one GPU of a
tensor-parallel group, for each pipeline stage (ORCA §3, §4.1, evaluated on §6's hardware).

Each op takes the longer of its compute time and its memory time (a roofline) at achievable, not
peak, rates. Tensor parallelism adds two all-reduces per layer over NVLink; pipeline parallelism
adds a send of the activations over InfiniBand between stages. The two engines differ only where
the paper says they do:
- attention: ORCA runs it per request (selective batching, §3), the baseline runs one batched
  kernel over its padded ``[B, L]`` batch;
- control: ORCA's engine master sends a gRPC message to the first worker and gets the tokens back
  from the last (§4.1, separate control plane); FasterTransformer carries control through NCCL,
  so every stage synchronizes its CPU with its GPU every iteration (§6.1).
Every number below is a named parameter with its source beside it; none is fitted to the paper's
figures. ``AnalyticalCost(...).describe()`` records them with each result.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from orca_lab.config import ModelConfig, check_choice, check_range, model_config
from orca_lab.engine.executor import split_layers
from orca_lab.sim.executor import IterationCost

GiB = 2 ** 30


@dataclass(frozen=True)
class Device:
    """One GPU and its links. Rates in FLOP/s and bytes/s; ``memory`` in bytes."""
    name: str
    flops: float          # dense fp16 tensor-core peak
    hbm_bw: float         # HBM bandwidth
    memory: float
    nvlink_bw: float      # per GPU, one direction (the all-reduce's ring runs both ways at once)
    internode_bw: float   # per GPU: its own InfiniBand NIC


DEVICES: dict[str, Device] = {
    # NVIDIA A100 datasheet (SXM4 40GB): 312 TFLOP/s fp16 dense, 1,555 GB/s HBM2, 40 GB (nvidia-smi:
    # 40,960 MiB), NVLink 3: 600 GB/s total = 300 GB/s each way. Azure ND96asr A100 v4 (the paper's
    # VM): 8x 200 Gb/s HDR InfiniBand, one NIC per GPU = 25 GB/s per GPU.
    "a100-40gb": Device("A100-SXM4-40GB", 312e12, 1555e9, 40 * GiB, 300e9, 25e9),
    # A100-SXM4-80GB, the GPU of FasterTransformer's published GPT timings (the calibration data,
    # orca_lab/sim/calibration.py): same compute and links; HBM2e at the guide's "mclk 1593MHz" on a
    # 5120-bit bus, double data rate = 2,039 GB/s (the datasheet's figure).
    "a100-80gb": Device("A100-SXM4-80GB", 312e12, 2039e9, 80 * GiB, 300e9, 25e9),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s fp16 dense (1,979 with sparsity), 3.35 TB/s HBM3,
    # 80 GB, NVLink 4: 900 GB/s total = 450 GB/s each way. Azure ND H100 v5: 8x 400 Gb/s NDR
    # InfiniBand, one per GPU = 50 GB/s per GPU.
    "h100": Device("H100-SXM5-80GB", 989e12, 3.35e12, 80 * GiB, 450e9, 50e9),
    # NVIDIA H200 datasheet (SXM): the H100's compute and NVLink, 141 GB HBM3e at 4.8 TB/s; same
    # 400 Gb/s NDR per GPU as the H100 systems (Azure ND H200 v5).
    "h200": Device("H200-SXM-141GB", 989e12, 4.8e12, 141e9, 450e9, 50e9),
}


def model_of_gpu(name: str) -> str | None:
    """The key of ``DEVICES`` that models a CUDA device of this name (``torch.cuda.get_device_name``),
    if one does: an A100 of either size by the paper's 40 GB one."""
    n = name.lower()
    return next((key for key, pattern in (("h200", "h200"), ("h100", "h100"), ("a100-40gb", "a100"))
                 if pattern in n), None)


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of the peaks, fixed latencies and control overheads. Assumptions taken
    from public measurements (named beside each), not from ORCA's figures; change them to ask
    "what if"."""
    gemm: float = 0.70           # large fp16 GEMMs in cuBLAS reach ~70% of tensor-core peak on A100
                                 # (NVIDIA Deep Learning Performance guide, GEMM background)
    attention: float = 0.40      # fused attention forward: ~40% of A100 peak (FlashAttention,
                                 # Dao et al. 2022, ~124 of 312 TFLOP/s); 2022-era kernels no better
    hbm: float = 0.85            # STREAM-like copies reach ~1.3 of 1.555 TB/s on A100
    nvlink: float = 0.75         # nccl-tests all-reduce bus bandwidth ~230 of 300 GB/s on DGX A100
    internode: float = 0.80      # nccl-tests send/recv ~20 of 25 GB/s on HDR InfiniBand
    kernel_floor_s: float = 3e-6     # shortest kernel, back to back in a stream (a few us on A100)
    allreduce_latency_s: float = 15e-6   # nccl-tests small-message all-reduce inside an 8-GPU node
    p2p_latency_s: float = 20e-6     # NCCL send/recv of a small message across InfiniBand
    memory_utilization: float = 0.90  # share of GPU memory for weights + K/V: vLLM's default
                                      # gpu_memory_utilization; the rest holds activations,
                                      # workspaces and the CUDA context
    orca_control_s: float = 50e-6    # one gRPC message between hosts (grpc.io benchmarks: tens of
                                     # us for a small unary call); ORCA pays one to start an
                                     # iteration and one to return its tokens
    ft_sync_s: float = 40e-6         # FasterTransformer: cudaStreamSynchronize (~10 us) plus a
                                     # small NCCL message (~20-30 us) per stage per iteration
    step_overhead_s: float = 0.0     # both engines, once per iteration: host work of a decoding step
                                     # (sampling, stop checks, buffer set-up); 0 here, fitted in the
                                     # calibrated model
    ft_hop_s: float = 0.0            # FasterTransformer, per stage boundary per iteration: the next
                                     # stage learns of the iteration only through NCCL once the
                                     # previous one is done, so its launches are not hidden (§4.1);
                                     # 0 here, fitted to Figure 9's text in the calibrated model

    def __post_init__(self):
        for f in ("gemm", "attention", "hbm", "nvlink", "internode", "memory_utilization"):
            check_range(f, getattr(self, f), 1e-3, 1.0, kind=float)
        for f in ("kernel_floor_s", "allreduce_latency_s", "p2p_latency_s", "orca_control_s", "ft_sync_s",
                  "step_overhead_s", "ft_hop_s"):
            check_range(f, getattr(self, f), 0.0, 1.0, kind=float)


# ORCA §6, Table: (tensor parallel, pipeline stages) of each model on A100-40GB.
PAPER_PARALLELISM = {"gpt3-13b": (1, 1), "gpt3-101b": (8, 1), "gpt3-175b": (8, 2), "gpt3-341b": (8, 4),
                     # not in the paper: Llama-3-70B's 141 GB of fp16 weights on the 8 GPUs of one node
                     # (18 GB each, room for K/V even on 40 GB), one of its 8 K/V heads per GPU
                     "llama3-70b": (8, 1)}
DTYPE_BYTES = 2   # fp16 parameters and activations (§6)


class AnalyticalCost:
    """Per-stage time of an iteration of ``model`` on ``tensor_parallel x pipeline_parallel`` GPUs."""

    def __init__(self, model: str | ModelConfig, device: str = "a100-40gb", tensor_parallel: int | None = None,
                 pipeline_parallel: int | None = None, eff: Efficiency | None = None):
        self.cfg = model_config(model)
        check_choice("device", device, tuple(DEVICES))
        self.device, self.dev = device, DEVICES[device]
        t, p = PAPER_PARALLELISM.get(self.cfg.name, (1, 1))
        self.tp = check_range("tensor_parallel", t if tensor_parallel is None else tensor_parallel, 1, self.cfg.n_heads)
        self.pp = p if pipeline_parallel is None else pipeline_parallel   # split_layers checks it
        self.stage_layers = [hi - lo for lo, hi in split_layers(self.cfg.n_layers, self.pp)]
        self.eff = eff or Efficiency()
        self.n_stages = self.pp
        self._fixed: dict = {}       # (tokens, requests, padded) -> token-wise costs

    # -- memory: how many K/V slots fit (the paper's out-of-memory cases come from here) --------
    def weight_bytes_per_gpu(self) -> float:
        return self.cfg.n_params * DTYPE_BYTES / (self.tp * self.pp)

    def n_slots(self) -> int:
        """Token slots of K/V the GPUs hold next to the weights: one slot = one token's K and V
        over all layers, spread over the ``tp x pp`` GPUs."""
        free = self.dev.memory * self.eff.memory_utilization - self.weight_bytes_per_gpu()
        per_token = self.cfg.kv_bytes_per_token(DTYPE_BYTES) / (self.tp * self.pp)
        if free < per_token:
            raise ValueError(f"model {self.cfg.name} does not fit on {self.tp * self.pp} x {self.dev.name}: "
                             f"{self.weight_bytes_per_gpu() / GiB:.1f} GiB of weights per GPU leave no room "
                             f"for K/V; use more GPUs (tensor_parallel, pipeline_parallel) or a larger device")
        return int(free // per_token)

    # -- time -----------------------------------------------------------------------------------
    def iteration(self, batch) -> IterationCost:
        key = (batch.n_tokens, len(batch.q_lens), batch.padded)
        fixed = self._fixed.get(key)
        if fixed is None:                       # token-wise work depends on these three only
            fixed = self._fixed[key] = self._token_wise(*key)
        layer_rest, extras = fixed
        layer = layer_rest + self.attention_time(batch)
        stages = tuple(n * layer + extra for n, extra in zip(self.stage_layers, extras))
        if batch.padded:
            return IterationCost(stages)
        return IterationCost(stages, self.eff.orca_control_s, self.eff.orca_control_s)

    def _token_wise(self, T: int, B: int, padded: bool):
        """A layer's time without attention, and what each stage adds to its layers."""
        layer = sum(self.layer_parts(T).values())
        return layer, tuple(sum(parts.values()) for parts in self.stage_extras(T, B, padded))

    def layer_parts(self, T: int) -> dict:
        """One layer's time without attention, by kind of op, for ``T`` rows of ``[sum L, H]``.
        Llama's SwiGLU has a gate beside the up projection (stacked in one GEMM, as in
        ``model/llama.py``); GPT's MLP has the up projection only."""
        d, tp = self.cfg.d_model, self.tp
        d_tp, ff_tp = d / tp, self.cfg.d_ff / tp
        gated = self.cfg.family == "llama"
        gemms = (self.gemm(T, d, d_tp + 2 * self.kv_width()) + self.gemm(T, d_tp, d)   # QKV, attention out
                 + self.gemm(T, d, (1 + gated) * ff_tp) + self.gemm(T, ff_tp, d))     # MLP
        # the norms x2 and the residual adds read and write [T, d]; GPT's bias+GeLU reads and writes
        # [T, d_ff/tp], SwiGLU's silu(gate) * up reads two of them and writes one
        elementwise = (2 * self.memory_op(2 * T * d) + 2 * self.memory_op(3 * T * d)
                       + self.memory_op((2 + gated) * T * ff_tp))
        return {"gemm": gemms, "elementwise": elementwise, "all_reduce": 2 * self.all_reduce(T * d)}

    def kv_width(self) -> float:
        """Width of K (or V) on one GPU: its share of the ``n_kv_heads`` heads, at least one head
        (replicated when tensor parallelism exceeds them, ``ModelConfig.kv_heads_on``)."""
        return max(self.cfg.n_kv_heads * self.cfg.head_dim / self.tp, self.cfg.head_dim)

    def stage_extras(self, T: int, B: int, padded: bool) -> list[dict]:
        """What each stage adds to its layers: embedding on the first, LM head and the iteration's
        host work on the last, the send to the next stage on the others; the baseline's per-stage
        CPU-GPU sync for its NCCL-carried control (§6.1), and its wait at each stage boundary."""
        last, out = self.n_stages - 1, []
        for s in range(self.n_stages):
            parts = {"embed_head": self.embed_time(T) if s == 0 else 0.0, "send": 0.0, "step_overhead": 0.0,
                     "ft_sync": self.eff.ft_sync_s if padded else 0.0,
                     "ft_hop": self.eff.ft_hop_s if padded and s > 0 else 0.0}
            if s == last:
                parts["embed_head"] += self.head_time(B)
                parts["step_overhead"] = self.eff.step_overhead_s
            else:
                parts["send"] = self.send_time(T)
            out.append(parts)
        return out

    def breakdown(self, batch) -> dict:
        """Seconds of one iteration of ``batch`` by kind of work, over all stages (a pipeline's
        stages run one after the other for one batch), control messages included."""
        out = {k: v * self.cfg.n_layers for k, v in self.layer_parts(batch.n_tokens).items()}
        out["attention"] = self.attention_time(batch) * self.cfg.n_layers
        for parts in self.stage_extras(batch.n_tokens, len(batch.q_lens), batch.padded):
            for k, v in parts.items():
                out[k] = out.get(k, 0.0) + v
        out["orca_control"] = 0.0 if batch.padded else 2 * self.eff.orca_control_s
        return out

    def attention_time(self, batch) -> float:
        """Per request (ORCA): each attends over its own context, so each takes its own roofline
        and the times add up (one launch for all: ORCA fuses them, §5). Batched (baseline): one
        kernel over the padded batch, whose requests all have the same shape."""
        flops_rate, bytes_rate = self.dev.flops * self.eff.attention, self.dev.hbm_bw * self.eff.hbm
        d_tp, kv_tp = self.cfg.d_model / self.tp, self.kv_width()
        if batch.padded:
            f, b = _attention_work(batch.starts[0], batch.q_lens[0], d_tp, kv_tp)
            B = len(batch.q_lens)
            return max(B * f / flops_rate, B * b / bytes_rate, self.eff.kernel_floor_s)
        t = 0.0
        for s, q in zip(batch.starts, batch.q_lens):
            f, b = _attention_work(s, q, d_tp, kv_tp)
            t += max(f / flops_rate, b / bytes_rate)
        return max(t, self.eff.kernel_floor_s)

    def gemm(self, rows: int, k: float, n: float) -> float:
        flops = 2 * rows * k * n
        bytes_ = DTYPE_BYTES * (k * n + rows * k + rows * n)     # weights, input, output
        return self.roofline(flops, bytes_, self.eff.gemm)

    def memory_op(self, n_elements: float) -> float:
        return self.roofline(0.0, n_elements * DTYPE_BYTES, self.eff.gemm)

    def roofline(self, flops: float, bytes_: float, flops_eff: float) -> float:
        t = max(flops / (self.dev.flops * flops_eff), bytes_ / (self.dev.hbm_bw * self.eff.hbm))
        return max(t, self.eff.kernel_floor_s)

    def all_reduce(self, n_elements: float) -> float:
        """Ring all-reduce over the tensor-parallel group: 2 (tp-1)/tp of the data each way."""
        if self.tp == 1:
            return 0.0
        bytes_ = n_elements * DTYPE_BYTES * 2 * (self.tp - 1) / self.tp
        return bytes_ / (self.dev.nvlink_bw * self.eff.nvlink) + self.eff.allreduce_latency_s

    def send_time(self, n_tokens: int) -> float:
        """Activations to the next stage over InfiniBand; each of the tp GPUs sends its 1/tp share
        through its own NIC (Megatron-LM's scatter/gather, Narayanan et al. SC'21)."""
        bytes_ = n_tokens * self.cfg.d_model * DTYPE_BYTES / self.tp
        return bytes_ / (self.dev.internode_bw * self.eff.internode) + self.eff.p2p_latency_s

    def embed_time(self, n_tokens: int) -> float:
        return self.memory_op(3 * n_tokens * self.cfg.d_model)     # two table rows read, one sum written

    def head_time(self, rows: int) -> float:
        """Final LayerNorm and logits of each request's last token (vocabulary split over tp)."""
        return self.memory_op(2 * rows * self.cfg.d_model) + self.gemm(rows, self.cfg.d_model, self.cfg.vocab_size / self.tp)

    def describe(self) -> dict:
        return {"model": self.cfg.name, "device": dataclasses.asdict(self.dev), "tensor_parallel": self.tp,
                "pipeline_parallel": self.pp, "efficiency": dataclasses.asdict(self.eff),
                "n_slots": self.n_slots()}


def _attention_work(start: int, q: int, d_tp: float, kv_tp: float) -> tuple[float, float]:
    """FLOPs and bytes of one request's attention: ``q`` new tokens after ``start`` cached ones,
    causal, over ``d_tp`` of the hidden size (its query heads on this GPU) and ``kv_tp`` of K/V
    width (its K/V heads: grouped queries read each K/V head once for the whole group)."""
    pairs = q * start + q * (q + 1) / 2          # (query, key) pairs under the causal mask
    ctx = start + q
    flops = 4 * pairs * d_tp                     # Q K^T and P V
    bytes_ = DTYPE_BYTES * (d_tp * 2 * q + kv_tp * (2 * ctx + 2 * q))   # Q in, O out; K, V of the context read, new ones written
    return flops, bytes_
