"""Model shapes and engine settings; every field is validated here, where it enters (docs/design.md, layer 1)."""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass


class FieldError(ValueError):
    """A value refused, with the field it belongs to as data (``field``): whoever reports it (an HTTP
    endpoint's ``param``) reads this, never the message's text. A ValueError, as every refusal here."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field          # (kept when pickled: it travels from the engine process to the server)


def check_range(name: str, value, lo=None, hi=None, kind=int, *, field: str | None = None, open_lo: bool = False):
    """Raise FieldError naming ``name``, its value and the allowed range unless lo <= value <= hi
    (lo < value with ``open_lo``); its ``field`` is ``field``, else ``name``. An integer too large for
    a float is out of any float range, never an OverflowError."""
    allowed = range_text(lo, hi, open_lo)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise FieldError(f"{name}={shown(value)} must be an integer in {allowed}", field or name)
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))
                          or (isinstance(value, float) and not math.isfinite(value))):
        raise FieldError(f"{name}={shown(value)} must be a finite number in {allowed}", field or name)
    if (lo is not None and (value <= lo if open_lo else value < lo)) or (hi is not None and value > hi):
        raise FieldError(f"{name}={shown(value)} is out of range: allowed {allowed}", field or name)
    return value


def shown(value) -> str:
    """``value`` as a message shows it: its repr, cut to 80 characters; an integer of more than 30
    digits by its first ones and its length (Python refuses to print one past 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 30:
        digits = int(math.log10(abs(value))) + 1
        digits += (abs(value) >= 10 ** digits) - (abs(value) < 10 ** (digits - 1))   # log10's rounding
        return f"{'-' if value < 0 else ''}{abs(value) // 10 ** (digits - 10)}... ({digits} digits)"
    try:
        text = repr(value)
    except ValueError:                  # a container of such an integer
        return f"<a {type(value).__name__} holding an integer too long to print>"
    return text if len(text) <= 80 else text[:77] + "..."


def check_out_dir(name: str, out) -> str:
    """A results folder ``out`` of parameter ``name``: made now, so a path that cannot be one (a file,
    a folder this user cannot write) fails before the run rather than after it."""
    if not isinstance(out, (str, os.PathLike)) or not str(out).strip():
        raise FieldError(f"{name}={out!r} must be a non-empty path", name)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise FieldError(f"{name}={str(out)!r}: cannot make that folder ({e.strerror or e})", name) from None
    if not os.access(out, os.W_OK):
        raise FieldError(f"{name}={str(out)!r}: this user cannot write there", name)
    return str(out)


def parsed_args(parser, argv, check, smoke: dict | None = None):
    """A script's arguments: with ``--smoke``, ``smoke``'s values for the flags not given (one given
    is kept, and checked); then ``check(args)``, whose ValueError (a flag named with its range) exits
    2 with that message through ``parser.error``, before anything is built."""
    args = parser.parse_args(argv)
    if smoke and args.smoke:
        parser.set_defaults(**smoke)
        args = parser.parse_args(argv)
    try:
        check(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def check_choice(name: str, value, choices):
    if value not in choices:
        raise FieldError(f"{name}={value!r} is not allowed: choose one of {', '.join(map(repr, choices))}", name)
    return value


def check_bool(name: str, value):
    """Raise FieldError naming ``name`` and its value unless it is True or False."""
    if not isinstance(value, bool):
        raise FieldError(f"{name}={value!r} is not allowed: choose True or False", name)
    return value


def check_device(name: str, device):
    """A device as torch names the ones this project runs on: ``cpu``, ``cuda`` or ``cuda:N``."""
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d{1,4})?", device):
        raise FieldError(f"{name}={shown(device)} is not allowed: use 'cpu', 'cuda' or 'cuda:N'", name)
    return device


def range_text(lo, hi, open_lo: bool = False) -> str:
    return f"{'(' if open_lo else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"


FAMILIES = ("gpt2", "llama")          # model/families.py builds each
ROPE_TYPES = ("default", "llama3")     # Llama 3's frequency scaling (rope_scaling / rope_parameters)


@dataclass(frozen=True)
class ModelConfig:
    """A model's shape. ``family="gpt2"``: GPT-2 / GPT-3 (pre-LayerNorm blocks, learned positions,
    GeLU (tanh), tied LM head). ``family="llama"``: Llama / Qwen2 (RMSNorm, rotary positions, SwiGLU,
    grouped-query attention with ``n_kv_heads`` K/V heads, no biases but Qwen2's on q/k/v).
    ``layer_norm_eps`` is the norm's epsilon in both (RMSNorm's for Llama)."""
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int = 50257
    max_seq_len: int = 1024
    layer_norm_eps: float = 1e-5
    family: str = "gpt2"
    n_kv_heads: int | None = None        # None: n_heads (multi-head attention)
    intermediate_size: int | None = None  # None: 4 * d_model (GPT's MLP)
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None    # llama: sorted (key, value) pairs of rope_scaling, or None
    tie_embeddings: bool = True
    qkv_bias: bool = False

    def __post_init__(self):
        check_range("n_layers", self.n_layers, 1, 1024)
        check_range("d_model", self.d_model, 1, 1 << 17)
        check_range("n_heads", self.n_heads, 1, self.d_model)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        check_range("vocab_size", self.vocab_size, 2, 1 << 24)
        check_range("max_seq_len", self.max_seq_len, 1, 1 << 20)
        check_range("layer_norm_eps", self.layer_norm_eps, 0.0, 1.0, kind=float)
        check_choice("family", self.family, FAMILIES)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        check_range("n_kv_heads", self.n_kv_heads, 1, self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}: each K/V head "
                             "serves a whole group of query heads")
        if self.intermediate_size is not None:
            check_range("intermediate_size", self.intermediate_size, 1, 1 << 20)
        check_range("rope_theta", self.rope_theta, 1.0, 1e12, kind=float)
        check_bool("tie_embeddings", self.tie_embeddings)
        check_bool("qkv_bias", self.qkv_bias)
        if self.family == "gpt2":
            for field, default in (("n_kv_heads", self.n_heads), ("intermediate_size", None),
                                   ("rope_scaling", None), ("tie_embeddings", True), ("qkv_bias", False)):
                if getattr(self, field) != default:
                    raise ValueError(f"{field}={getattr(self, field)!r} is not allowed with family='gpt2' "
                                     f"(GPT-2 has {field}={default!r}): use family='llama'")
        if self.rope_scaling is not None:
            self._check_rope_scaling()

    def _check_rope_scaling(self):
        s = dict(self.rope_scaling)
        check_choice("rope_scaling.rope_type", s.get("rope_type"), ROPE_TYPES)
        if s["rope_type"] == "llama3":
            for key in ("factor", "low_freq_factor", "high_freq_factor"):
                check_range(f"rope_scaling.{key}", s.get(key), 1e-6, 1e6, kind=float)
            check_range("rope_scaling.original_max_position_embeddings", s.get("original_max_position_embeddings"),
                        1, 1 << 24)
            if s["high_freq_factor"] <= s["low_freq_factor"]:
                raise ValueError(f"rope_scaling.high_freq_factor={s['high_freq_factor']} must exceed "
                                 f"rope_scaling.low_freq_factor={s['low_freq_factor']}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (1: multi-head attention)."""
        return self.n_heads // self.n_kv_heads

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model if self.intermediate_size is None else self.intermediate_size

    @property
    def n_params(self) -> int:
        """Parameters (GPT: with the LM head tied to the token embedding)."""
        d = self.d_model
        if self.family == "gpt2":
            per_layer = 12 * d ** 2 + 13 * d
            return self.n_layers * per_layer + (self.vocab_size + self.max_seq_len + 2) * d
        qkv = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        per_layer = d * qkv + self.qkv_bias * qkv + d * d + 3 * d * self.d_ff + 2 * d
        return self.n_layers * per_layer + (2 - self.tie_embeddings) * self.vocab_size * d + d

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers: the size of one slot (``n_kv_heads`` heads)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    def kv_heads_on(self, T: int) -> int:
        """K/V heads each of ``T`` tensor-parallel ranks holds: its share, or one replicated head."""
        return max(1, self.n_kv_heads // T)

    def check_tensor_parallel(self, T: int):
        """Refuse a tensor-parallel degree the heads (and the MLP) cannot be split into: ``T`` divides
        the query heads; K/V heads split when ``T`` divides them, else each is replicated on ``T /
        n_kv_heads`` ranks (``T`` must be a multiple of them)."""
        if self.n_heads % T:
            allowed = [d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]
            raise ValueError(f"tensor_parallel={T} is not allowed: it must divide n_heads={self.n_heads} "
                             f"(allowed: {', '.join(map(str, allowed))})")
        if self.n_kv_heads % T and T % self.n_kv_heads:
            raise ValueError(f"tensor_parallel={T} is not allowed: it must divide n_kv_heads={self.n_kv_heads} "
                             f"or be a multiple of it (each rank then holds one K/V head, replicated)")
        if self.d_ff % T:
            raise ValueError(f"tensor_parallel={T} is not allowed: it must divide intermediate_size={self.d_ff}")


# The tiny presets use a byte-level vocabulary (256 bytes + EOS) so they need no tokenizer download.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("tiny", n_layers=4, d_model=256, n_heads=4, vocab_size=257, max_seq_len=1024),
    # tiny's size in Llama's blocks, grouped-query: 2 query heads share each of the 2 K/V heads
    "tiny-llama": ModelConfig("tiny-llama", n_layers=4, d_model=256, n_heads=4, vocab_size=257, max_seq_len=1024,
                              family="llama", n_kv_heads=2, intermediate_size=688, layer_norm_eps=1e-5,
                              tie_embeddings=False),
    "gpt2": ModelConfig("gpt2", n_layers=12, d_model=768, n_heads=12, vocab_size=50257, max_seq_len=1024),
    # docs/paper.md's Table 1 (GPT-3 architecture, head size 128, max sequence length 2048).
    "gpt3-13b": ModelConfig("gpt3-13b", n_layers=40, d_model=5120, n_heads=40, max_seq_len=2048),
    "gpt3-101b": ModelConfig("gpt3-101b", n_layers=80, d_model=10240, n_heads=80, max_seq_len=2048),
    "gpt3-175b": ModelConfig("gpt3-175b", n_layers=96, d_model=12288, n_heads=96, max_seq_len=2048),
    "gpt3-341b": ModelConfig("gpt3-341b", n_layers=120, d_model=15360, n_heads=120, max_seq_len=2048),
    # Llama 3 (simulator shapes): Meta's config.json on the Hugging Face Hub (meta-llama/Meta-Llama-3-8B,
    # meta-llama/Meta-Llama-3-70B) and "The Llama 3 Herd of Models" (Dubey et al. 2024), Table 3:
    # 8 K/V heads for 32 or 64 query heads, head size 128, untied head, rope_theta 500000, 8192 positions.
    "llama3-8b": ModelConfig("llama3-8b", n_layers=32, d_model=4096, n_heads=32, vocab_size=128256,
                             max_seq_len=8192, family="llama", n_kv_heads=8, intermediate_size=14336,
                             rope_theta=500000.0, tie_embeddings=False),
    "llama3-70b": ModelConfig("llama3-70b", n_layers=80, d_model=8192, n_heads=64, vocab_size=128256,
                              max_seq_len=8192, family="llama", n_kv_heads=8, intermediate_size=28672,
                              rope_theta=500000.0, tie_embeddings=False),
}


def model_config(name_or_config: str | ModelConfig) -> ModelConfig:
    if isinstance(name_or_config, ModelConfig):
        return name_or_config
    check_choice("model", name_or_config, tuple(PRESETS))
    return PRESETS[name_or_config]


def check_blocks(n_slots: int, block_size: int):
    """A paged pool holds whole blocks (checked when a paged or chunked engine is built: ORCA's
    reservation takes any ``n_slots``)."""
    check_range("block_size", block_size, 1, 1 << 16)
    if n_slots % block_size:
        raise ValueError(f"block_size={block_size} must divide n_slots={n_slots}: a paged pool holds "
                         f"whole blocks (e.g. n_slots={max(1, n_slots // block_size) * block_size})")


SCHEDULE_POLICIES = ("fcfs", "lpm")     # arrival order; SGLang's longest cached prefix first


def check_prefix_caching(prefix_caching: bool, schedule_policy: str = "fcfs"):
    """The fields alone; which system takes them is the system's own entry (``engine/policies.py``,
    checked where an engine is built and a server starts)."""
    check_bool("prefix_caching", prefix_caching)
    check_choice("schedule_policy", schedule_policy, SCHEDULE_POLICIES)
    if schedule_policy == "lpm" and not prefix_caching:
        raise ValueError("schedule_policy='lpm' (longest cached prefix first) needs prefix_caching=True: "
                         "without a cache every prefix is 0 long; use schedule_policy='fcfs'")


DTYPES = ("float32", "float16", "bfloat16")
KERNEL_BACKENDS = ("auto", "torch", "triton")
EXECUTORS = ("auto", "local", "workers")
CPU_SLOTS = 16384           # n_slots on CPU unless given
MAX_THREADS = 1024          # torch intra-op threads a command or notebook may ask for


@dataclass(frozen=True)
class EngineConfig:
    """What the engine runs with: Algorithm 1's parameters, kernels, placement and parallelism.

    ``n_slots`` is the K/V memory in token slots (one slot = K and V of one token, all layers).
    ``None`` (the default) means 16384 on CPU and, on CUDA, as many as fit in the GPU's free memory
    after the weights, keeping ``1 - gpu_memory_utilization`` of the GPU back for activations and
    other processes (``LLM`` sizes it before allocating anything, and refuses a model that cannot fit);
    ``pipeline_parallel`` is the paper's ``n_workers``: that many batches are kept in flight.
    ``executor``: "auto" runs tensor_parallel x pipeline_parallel worker processes when that is above 1,
    else the model in this process; "local" emulates the pipeline stages in this process; "workers"
    always uses worker processes (even 1 x 1).
    ``tf32``: fp32 matmuls and attention dots on a GPU may use TF32 tensor cores (10-bit mantissa
    products; off by default, so fp32 stays IEEE). ``cuda_graphs``: decode-only iterations replay
    CUDA graphs captured per padded batch size (on a GPU, in this process, with Triton attention).
    """
    max_bs: int = 32
    n_slots: int | None = None
    attention_backend: str = "auto"
    fused_ops_backend: str = "auto"
    device: str = "cpu"
    dtype: str = "float32"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    executor: str = "auto"
    gpu_memory_utilization: float = 0.9
    block_size: int = 16                 # paged / chunked: K/V slots per block (vLLM's default)
    max_num_batched_tokens: int = 512    # chunked: new tokens per iteration (Sarathi-Serve's budget)
    tf32: bool = False
    cuda_graphs: bool = True
    prefix_caching: bool = False         # paged / chunked: full K/V blocks shared and cached (prefix_cache.py)
    schedule_policy: str = "fcfs"        # paged / chunked: "fcfs", or "lpm" (longest cached prefix first)

    def __post_init__(self):
        check_range("max_bs", self.max_bs, 1, 65536)
        if self.n_slots is None and not str(self.device).startswith("cuda"):
            object.__setattr__(self, "n_slots", CPU_SLOTS)
        if self.n_slots is not None:
            check_range("n_slots", self.n_slots, 1, 1 << 31)
        check_range("gpu_memory_utilization", self.gpu_memory_utilization, 0.01, 1.0, kind=float)
        check_choice("attention_backend", self.attention_backend, KERNEL_BACKENDS)
        check_choice("fused_ops_backend", self.fused_ops_backend, KERNEL_BACKENDS)
        check_choice("dtype", self.dtype, DTYPES)
        check_device("device", self.device)
        check_range("tensor_parallel", self.tensor_parallel, 1, 1024)
        check_range("pipeline_parallel", self.pipeline_parallel, 1, 1024)
        check_choice("executor", self.executor, EXECUTORS)
        check_range("block_size", self.block_size, 1, 1 << 16)
        check_range("max_num_batched_tokens", self.max_num_batched_tokens, self.block_size, 1 << 24)
        check_bool("tf32", self.tf32)
        check_bool("cuda_graphs", self.cuda_graphs)
        check_prefix_caching(self.prefix_caching, self.schedule_policy)   # the system's part: new_engine

    @property
    def n_workers(self) -> int:
        return self.pipeline_parallel

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


# -- parallel degrees: what the model and the machine (or the launcher's world) can take ----------
def uses_workers(ec: EngineConfig) -> bool:
    """Worker processes for any parallel degree above 1 (``executor="auto"``), or when asked."""
    return ec.executor == "workers" or (ec.executor == "auto" and ec.tensor_parallel * ec.pipeline_parallel > 1)


def launcher_world_size() -> int | None:
    """``WORLD_SIZE`` when a launcher (torchrun, or any that sets ``RANK`` and ``WORLD_SIZE``) started
    this process: its ranks span nodes, so the local GPU count says nothing about them."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def check_degrees(cfg: ModelConfig, ec: EngineConfig):
    """Refuse degrees the model or the machine cannot take, naming the field and the allowed range.

    With workers on CUDA, ``tensor_parallel x pipeline_parallel`` is one GPU per worker: under a
    launcher it must equal the world size (each node checks its own GPUs when its workers start);
    a pool on this machine must fit its GPUs."""
    T, P = ec.tensor_parallel, ec.pipeline_parallel
    cfg.check_tensor_parallel(T)
    check_range("pipeline_parallel", P, 1, cfg.n_layers)         # a stage holds at least one layer
    if T > 1 and not uses_workers(ec):
        raise ValueError(f"tensor_parallel={T} needs worker processes: executor='local' allows "
                         "tensor_parallel=1 only (use executor='auto' or 'workers')")
    if not (uses_workers(ec) and ec.device.startswith("cuda")):
        return
    world = launcher_world_size()
    if world is not None:
        if T * P != world:
            raise ValueError(f"tensor_parallel x pipeline_parallel = {T} x {P} = {T * P} must equal the "
                             f"launcher's world size WORLD_SIZE={world}: one rank per worker")
        return
    import torch        # here, not at import: this module stays free of torch and of CUDA
    n = torch.cuda.device_count()
    if T * P > n:
        raise ValueError(f"tensor_parallel x pipeline_parallel = {T} x {P} = {T * P} exceeds the {n} "
                         f"GPU(s) available: allowed tensor_parallel * pipeline_parallel in [1, {n}]")
