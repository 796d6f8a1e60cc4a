"""The user-facing API: ``LLM(model=..., engine=EngineConfig(...)).generate(prompts)``."""
from __future__ import annotations

from typing import Iterator

import torch

from orca_lab.config import EngineConfig, ModelConfig, check_degrees, model_config, uses_workers
from orca_lab.engine.cuda_graphs import decode_graphs_for
from orca_lab.engine.engine import Engine, RunResult
from orca_lab.engine.executor import LocalExecutor, split_layers
from orca_lab.engine.kv_manager import rank_shares, size_kv_pool
from orca_lab.engine.model import GPT, checkpoint_config
from orca_lab.engine.parallel import WorkerExecutor
from orca_lab.engine.request import SamplingParams
from orca_lab.engine.policies import SYSTEMS, new_kv, new_scheduler
from orca_lab.tokenizer import ByteTokenizer


def kv_slots_on_gpu(cfg: ModelConfig, ec: EngineConfig) -> int:
    """``ec.n_slots``, or as many as fit on the GPU (the rank that holds most, with workers); a
    ValueError naming bytes needed and available when the weights and the pool cannot fit."""
    workers = uses_workers(ec)
    stages = split_layers(cfg.n_layers, ec.pipeline_parallel) if workers else [(0, cfg.n_layers)]
    shares = rank_shares(cfg, ec.tensor_parallel if workers else 1, stages, getattr(torch, ec.dtype).itemsize)
    what = f"{cfg.name} in {ec.dtype} (tensor_parallel x pipeline_parallel = {ec.tensor_parallel} x {ec.pipeline_parallel})"
    n = size_kv_pool(what, shares, ec.n_slots, cfg.max_seq_len, ec.device, ec.gpu_memory_utilization)
    return n if ec.n_slots is not None else n - n % ec.block_size    # whole blocks for paged / chunked


class LLM:
    """A GPT served by ORCA's engine (``system="orca"``), the request-level baseline (``"ft"``), or
    the policies after ORCA (``"paged"``, ``"chunked"``: ``engine/policies.py``)."""

    def __init__(self, model: str | ModelConfig = "tiny", seed: int = 0, engine: EngineConfig | None = None,
                 tokenizer=None, *, gpt: GPT | None = None, checkpoint=None):
        self.engine_config = engine or EngineConfig()
        ec = self.engine_config
        cfg = gpt.cfg if gpt is not None else model_config(model)
        check_degrees(cfg, ec)
        if ec.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={ec.device!r} but no CUDA device is available: use device='cpu'")
        if ec.device.startswith("cuda"):        # before any allocation: refuse what cannot fit
            ec = self.engine_config = ec.replace(n_slots=kv_slots_on_gpu(cfg, ec))
        dtype = getattr(torch, ec.dtype)
        backends = dict(attention_backend=ec.attention_backend, fused_ops_backend=ec.fused_ops_backend)
        # Where the workers' weights come from: (checkpoint or None for random, seed). With workers, the
        # master keeps shapes only (a meta model) and each worker reads its own shard; a model passed
        # in stays where it is (the pool hands its weights to the workers).
        self.weights = (None if checkpoint is None else str(checkpoint), seed)
        if gpt is not None:
            self.model = gpt if uses_workers(ec) else gpt.to(ec.device, dtype)
        elif uses_workers(ec):
            self.model = GPT.random(cfg, device="meta", **backends)
        elif checkpoint is not None:
            self.model = GPT.from_pretrained(checkpoint, ec.device, dtype, **backends)
        else:
            self.model = GPT.random(cfg, seed, ec.device, dtype, **backends)
        self.model.attention_backend, self.model.fused_ops_backend = ec.attention_backend, ec.fused_ops_backend
        self.model.tf32 = ec.tf32
        self.cfg = self.model.cfg
        self.tokenizer = tokenizer or (ByteTokenizer() if self.cfg.vocab_size == ByteTokenizer.vocab_size else None)

    @classmethod
    def from_pretrained(cls, path, engine: EngineConfig | None = None, tokenizer=None) -> "LLM":
        """A GPT-2 checkpoint in the Hugging Face layout from a local directory (never the network).
        With workers, each reads only its own slices of the file."""
        return cls(checkpoint_config(path), engine=engine, tokenizer=tokenizer, checkpoint=path)

    def save_pretrained(self, path):
        if self.model.wte.weight.is_meta:
            raise RuntimeError("this LLM's weights live on its workers (the master holds shapes only): save "
                               "a model built with executor='local', or pass gpt= to keep one here")
        self.model.save_pretrained(path)

    # -- engines --------------------------------------------------------------------------------
    def new_engine(self, system: str = "orca", mbs: int | None = None) -> Engine:
        """A fresh engine over this model: its own K/V slot pool, scheduler and executor."""
        if system not in SYSTEMS:
            raise ValueError(f"system={system!r} is not allowed: choose one of {SYSTEMS}")
        ec, cfg = self.engine_config, self.cfg
        workers = uses_workers(ec)      # workers hold the K/V pools; the master keeps only the accounting
        shape = () if workers else (cfg.n_layers, cfg.n_heads, cfg.head_dim)
        if system == "ft" and mbs is not None and not 1 <= mbs <= ec.max_bs:
            raise ValueError(f"mbs={mbs} is out of range: allowed [1, max_bs={ec.max_bs}]")
        kv = new_kv(system, ec.n_slots, ec.block_size, *shape, device=ec.device, dtype=getattr(torch, ec.dtype))
        scheduler = new_scheduler(system, kv, ec.max_bs, cfg.max_seq_len, mbs, ec.max_num_batched_tokens)
        executor = WorkerExecutor.for_llm(self) if workers else \
            LocalExecutor(self.model, kv, ec.n_workers, ec.device, decode_graphs_for(self.model, kv, ec))
        config = {"model": cfg.name, "system": system, "mbs": mbs, **vars(ec)}
        return Engine(scheduler, executor, cfg.vocab_size, cfg.max_seq_len, config)

    def serve(self, trace, system: str = "orca", mbs: int | None = None, progress: bool = False) -> RunResult:
        """Serve a trace (``orca_lab.workload``) with arrivals on the real clock."""
        engine = self.new_engine(system, mbs)
        try:
            return engine.run(trace, progress=progress)
        finally:
            engine.close()

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompts, max_gen_tokens: int = 16, system: str = "orca", **sampling) -> list[list[int]]:
        """Generated token ids of each prompt (token-id lists, or strings through the tokenizer)."""
        outputs = [[] for _ in prompts]
        for i, tok in self.stream(prompts, max_gen_tokens, system, **sampling):
            outputs[i].append(tok)
        return outputs

    def stream(self, prompts, max_gen_tokens: int = 16, system: str = "orca", **sampling) -> Iterator[tuple[int, int]]:
        """Yield ``(prompt index, token)`` as each iteration completes."""
        params = SamplingParams(max_gen_tokens=max_gen_tokens, **sampling)
        engine = self.new_engine(system)
        try:
            index = {engine.add_request(self._encode(p), params).rid: i for i, p in enumerate(prompts)}
            while engine.has_work():
                for req, tok in engine.step():
                    yield index[req.rid], tok
        finally:
            engine.close()

    def _encode(self, prompt):
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError("a string prompt needs a tokenizer: pass LLM(tokenizer=...) or token ids")
            return self.tokenizer.encode(prompt)
        return prompt
