"""The user-facing API: ``LLM(model=..., engine=EngineConfig(...)).generate(prompts)``."""
from __future__ import annotations

from typing import Iterator

import torch

from orca_lab.config import EngineConfig, ModelConfig, model_config
from orca_lab.engine.engine import Engine, RunResult
from orca_lab.engine.executor import LocalExecutor
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.model import GPT
from orca_lab.engine.parallel import WorkerExecutor, check_degrees, uses_workers
from orca_lab.engine.request import SamplingParams
from orca_lab.engine.scheduler import OrcaScheduler, RequestLevelScheduler
from orca_lab.tokenizer import ByteTokenizer

SYSTEMS = ("orca", "ft")


class LLM:
    """A GPT served by ORCA's engine (``system="orca"``) or by the request-level baseline (``"ft"``)."""

    def __init__(self, model: str | ModelConfig = "tiny", seed: int = 0, engine: EngineConfig | None = None,
                 tokenizer=None, *, gpt: GPT | None = None):
        self.engine_config = engine or EngineConfig()
        ec = self.engine_config
        check_degrees(gpt.cfg if gpt is not None else model_config(model), ec)
        if ec.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={ec.device!r} but no CUDA device is available: use device='cpu'")
        dtype = getattr(torch, ec.dtype)
        backends = dict(attention_backend=ec.attention_backend, fused_ops_backend=ec.fused_ops_backend)
        self.model = gpt.to(ec.device, dtype) if gpt is not None else \
            GPT.random(model_config(model), seed, ec.device, dtype, **backends)
        self.model.attention_backend, self.model.fused_ops_backend = ec.attention_backend, ec.fused_ops_backend
        self.cfg = self.model.cfg
        self.tokenizer = tokenizer or (ByteTokenizer() if self.cfg.vocab_size == ByteTokenizer.vocab_size else None)

    @classmethod
    def from_pretrained(cls, path, engine: EngineConfig | None = None, tokenizer=None) -> "LLM":
        """A GPT-2 checkpoint in the Hugging Face layout from a local directory (never the network)."""
        return cls(engine=engine, tokenizer=tokenizer, gpt=GPT.from_pretrained(path))

    def save_pretrained(self, path):
        self.model.save_pretrained(path)

    # -- engines --------------------------------------------------------------------------------
    def new_engine(self, system: str = "orca", mbs: int | None = None) -> Engine:
        """A fresh engine over this model: its own K/V slot pool, scheduler and executor."""
        if system not in SYSTEMS:
            raise ValueError(f"system={system!r} is not allowed: choose one of {SYSTEMS}")
        ec, cfg = self.engine_config, self.cfg
        workers = uses_workers(ec)      # workers hold the K/V pools; the master keeps only the accounting
        shape = () if workers else (cfg.n_layers, cfg.n_heads, cfg.head_dim)
        kv = KVSlotManager(ec.n_slots, *shape, device=ec.device, dtype=getattr(torch, ec.dtype))
        if system == "orca":
            scheduler = OrcaScheduler(kv, ec.max_bs)
        else:
            if mbs is not None and not 1 <= mbs <= ec.max_bs:
                raise ValueError(f"mbs={mbs} is out of range: allowed [1, max_bs={ec.max_bs}]")
            scheduler = RequestLevelScheduler(kv, ec.max_bs, cfg.max_seq_len, mbs)
        executor = WorkerExecutor.for_llm(self) if workers else LocalExecutor(self.model, kv, ec.n_workers, ec.device)
        config = {"model": cfg.name, "system": system, "mbs": mbs, **vars(ec)}
        return Engine(scheduler, executor, cfg.vocab_size, cfg.max_seq_len, config, self.tokenizer,
                      getattr(self.tokenizer, "eos_token_id", None))

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
