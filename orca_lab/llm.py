"""The user-facing API: ``LLM(model=..., engine=EngineConfig(...)).generate(prompts)``."""
from __future__ import annotations

import copy
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from orca_lab.config import (EngineConfig, FieldError, ModelConfig, check_degrees, check_range, model_config, shown,
                             uses_workers)
from orca_lab.distributed.executor import WorkerExecutor
from orca_lab.distributed.pool import attached
from orca_lab.engine.beam_search import Beam, BeamSearch, BeamSearchParams, StepFailed, advance_all, pending
from orca_lab.engine.engine import Engine, RunResult, eos_ids
from orca_lab.engine.executor import split_layers
from orca_lab.engine.fields import check_text
from orca_lab.engine.kv_manager import KVPool
from orca_lab.engine.policies import system as resolve
from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.kernels.attention import settle_tuning
from orca_lab.model.cuda_graphs import BUCKETS as GRAPH_SIZES
from orca_lab.model.cuda_graphs import decode_graphs_for
from orca_lab.model.executor import LocalExecutor
from orca_lab.model.families import checkpoint_config, from_pretrained, random_model
from orca_lab.model.gpt import GPT
from orca_lab.model.kv_sizing import check_host_fits, rank_shares, size_kv_pool
from orca_lab.tokenizer import default_tokenizer, load_tokenizer
from orca_lab.workload import warm_up_traces


def kv_slots_on_gpu(cfg: ModelConfig, ec: EngineConfig) -> int:
    """``ec.n_slots``, or as many as fit on the GPU (the rank that holds most, with workers); a
    ValueError naming bytes needed and available when the weights and the pool cannot fit."""
    n = size_kv_pool(*_ranks(cfg, ec), ec.n_slots, cfg.max_seq_len, ec.device, ec.gpu_memory_utilization)
    return n if ec.n_slots is not None else n - n % ec.block_size    # whole blocks for paged / chunked


def _ranks(cfg: ModelConfig, ec: EngineConfig) -> tuple[str, list]:
    """What the model is called in a refusal, and each rank's ``(weight bytes, bytes per slot)``."""
    workers = uses_workers(ec)
    stages = split_layers(cfg.n_layers, ec.pipeline_parallel) if workers else [(0, cfg.n_layers)]
    shares = rank_shares(cfg, ec.tensor_parallel if workers else 1, stages, getattr(torch, ec.dtype).itemsize)
    return (f"{cfg.name} in {ec.dtype} (tensor_parallel x pipeline_parallel = {ec.tensor_parallel} x "
            f"{ec.pipeline_parallel})", shares)


@dataclass(frozen=True)
class Completion:
    """One prompt's result, as an OpenAI completion choice carries it."""
    prompt_token_ids: list[int]
    token_ids: list[int]          # EOS or a stop token that ended it included, as vLLM keeps them
    text: str | None              # the output as text, stop string excluded; None without a tokenizer
    finish_reason: str            # "length", "stop", or "error": it failed alone (``error`` says why)
    # with SamplingParams(logprobs=k) / (prompt_logprobs=k): a TokenLogprob (model/logprobs.py) per
    # generated token / per prompt token (None for the first); None when not asked for
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    error: str | None = None


class RequestsFailed(RuntimeError):
    """Some prompts failed inside an iteration (``Request.fail``): each alone, the others ran to
    their end. ``errors``: prompt index -> why; ``outputs``: every prompt's tokens, as far as they got."""

    def __init__(self, errors: dict[int, str], outputs: list[list[int]] | None = None):
        self.errors, self.outputs = errors, outputs
        super().__init__("; ".join(f"prompt {i} failed: {why}" for i, why in sorted(errors.items())))


class LLM:
    """A GPT served by ORCA's engine (``system="orca"``), the request-level baseline (``"ft"``), or
    the policies after ORCA (``"paged"``, ``"chunked"``: ``engine/policies.py``).

    ``tokenizer``: any object with ``encode(text) -> ids`` and ``decode(ids) -> text`` (and, if it has
    one, ``eos_token_id``); by default bytes for ``tiny`` and GPT-2's BPE for ``gpt2`` when its ranks
    are installed (``orca_lab.tokenizer``). ``gpt=``: a model of your own; it is left as it is (copied
    when the engine's device, dtype or kernels differ from its own, shared otherwise).
    ``eos_token_id``: the EOS (default: the tokenizer's), or a list of ids each of which ends a request
    that does not ignore EOS (``eos_token_ids``).
    ``kv_pool``: another LLM's ``kv_pool`` to write into instead of allocating one: its n_slots, shape,
    dtype and device must be this LLM's (on a GPU, ``n_slots=None`` takes the pool's, sizing nothing),
    without prefix caching (a borrower's writes drop the lender's cache, ``KVMemory.lend_kv``).
    The LLMs take turns: an engine of one closes the other's when it is done, and is refused while
    it still has requests.
    """

    def __init__(self, model: str | ModelConfig = "tiny", seed: int = 0, engine: EngineConfig | None = None,
                 tokenizer=None, *, gpt: GPT | None = None, checkpoint=None,
                 eos_token_id: int | list[int] | None = None, kv_pool: KVPool | None = None):
        self.engine_config = engine or EngineConfig()
        ec = self.engine_config
        cfg = gpt.cfg if gpt is not None else model_config(model)
        check_degrees(cfg, ec)
        if ec.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={ec.device!r} but no CUDA device is available: use device='cpu'")
        if kv_pool is not None:                 # its memory is taken already: nothing to size
            ec = self.engine_config = ec.replace(n_slots=_check_lent_pool(kv_pool, cfg, ec))
        elif ec.device.startswith("cuda"):      # before any allocation: refuse what cannot fit
            ec = self.engine_config = ec.replace(n_slots=kv_slots_on_gpu(cfg, ec))
        elif gpt is None:                       # the CPU: the host's memory, every rank on it
            check_host_fits(*_ranks(cfg, ec), ec.n_slots, ec.tensor_parallel if uses_workers(ec) else 1)
        dtype = getattr(torch, ec.dtype)
        # Where the workers' weights come from: (checkpoint or None for random, seed). With workers, the
        # master keeps shapes only (a meta model) and each worker reads its own shard; a model passed
        # in stays where it is (the pool hands its weights to the workers).
        self.weights = (None if checkpoint is None else str(checkpoint), seed)
        if gpt is not None:
            self.model = gpt if uses_workers(ec) else _placed(gpt, ec)
        elif uses_workers(ec):
            self.model = random_model(cfg, device="meta", **_backends(ec))
        elif checkpoint is not None:
            self.model = from_pretrained(checkpoint, ec.device, dtype, **_backends(ec))
        else:
            self.model = random_model(cfg, seed, ec.device, dtype=dtype, **_backends(ec))
        self.cfg = self.model.cfg
        if tokenizer is not None and not all(callable(getattr(tokenizer, f, None)) for f in ("encode", "decode")):
            raise TypeError(f"tokenizer={tokenizer!r} needs encode(text) -> ids and decode(ids) -> text")
        self.tokenizer = tokenizer if tokenizer is not None else default_tokenizer(self.cfg.vocab_size)
        eos = getattr(self.tokenizer, "eos_token_id", None) if eos_token_id is None else eos_token_id
        # every id a request that does not ignore EOS stops at (Llama 3 lists several); the first is its EOS
        self.eos_token_ids = eos_ids(eos)
        for t in self.eos_token_ids:
            check_range("eos_token_id", t, 0, self.cfg.vocab_size - 1)
        self._kv_pool = kv_pool               # allocated on the first engine (unless lent), then lent to each
        self._graphs = None                   # CUDA graphs over that pool, captured once
        self._engine = None                   # weak reference to the engine holding the workers' K/V

    @classmethod
    def from_pretrained(cls, path, engine: EngineConfig | None = None, tokenizer=None) -> "LLM":
        """A GPT-2, Llama or Qwen2 checkpoint in the Hugging Face layout from a local directory (never
        the network; safetensors, one file or sharded with its index), with the tokenizer saved beside
        it when there is one (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``; read by
        ``tokenizers``). EOS: the tokenizer's, and every id of the checkpoint's ``eos_token_id`` (an
        int or a list: Llama 3's) as transformers' ``generate`` reads it, from generation_config.json
        else config.json; any of them ends a request, as in vLLM. With workers, each reads only its
        own slices of the files."""
        path = Path(path)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = ([] if eos is None else [eos]) + [t for t in _generation_eos(path) if t != eos]
        return cls(checkpoint_config(path), engine=engine, tokenizer=tokenizer, checkpoint=path,
                   eos_token_id=ids or None)

    @property
    def eos_token_id(self) -> int | None:
        """The EOS (the first of ``eos_token_ids``), None without one."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def save_pretrained(self, path):
        """The weights, and a Hugging Face tokenizer's ``tokenizer.json`` when the LLM has one."""
        if self.model.wte.weight.is_meta:
            raise RuntimeError("this LLM's weights live on its workers (the master holds shapes only): save "
                               "a model built with executor='local', or pass gpt= to keep one here")
        self.model.save_pretrained(path)
        if hasattr(getattr(self.tokenizer, "tokenizer", None), "to_str"):
            (Path(path) / "tokenizer.json").write_text(self.tokenizer.tokenizer.to_str())

    # -- engines --------------------------------------------------------------------------------
    def new_engine(self, system: str = "orca", mbs: int | None = None) -> Engine:
        """A fresh engine over this model: its own scheduler, executor and K/V accounting, over the
        LLM's one K/V pool (allocated by the first engine, reused by every later one).

        One engine serves at a time, as in vLLM: the pool is lent to the newest engine. An engine
        that is done (nothing waiting, running or in flight) is closed when the next one is built;
        one that still has requests is not interrupted: this raises instead, naming it."""
        ec, cfg, entry = self.engine_config, self.cfg, resolve(system)
        entry.check(ec.prefix_caching, ec.schedule_policy, mbs, ec.max_bs)
        workers = uses_workers(ec)      # workers hold the K/V pools; the master keeps only the accounting
        local = None if workers else self._pool()
        self._take_pool_back(local)
        memory = attached(self) if workers else local
        # the memory lends its prefix cache with it (``KVMemory``); None: workers of the engine's own
        kv = entry.new_kv(ec.n_slots, ec.block_size, pool=None if workers else memory, memory=memory,
                          prefix_caching=ec.prefix_caching)
        scheduler = entry.new_scheduler(kv, ec.max_bs, cfg.max_seq_len, mbs, ec.max_num_batched_tokens,
                                        ec.schedule_policy)
        executor = WorkerExecutor.for_llm(self, memory) if workers else \
            LocalExecutor(self.model, kv, ec.n_workers, ec.device, self._decode_graphs(kv))
        config = {"model": cfg.name, "system": system, "mbs": mbs, **vars(ec)}
        engine = Engine(scheduler, executor, cfg.vocab_size, cfg.max_seq_len, config, self.tokenizer,
                        self.eos_token_ids)
        if local is not None:
            local.engine = weakref.ref(engine)
        else:
            self._engine = weakref.ref(engine)
        return engine

    def _take_pool_back(self, local: KVPool | None):
        """Close the engine holding the K/V if it is done; refuse if it still serves requests. A local
        pool records its engine itself: every LLM it is lent to sees the others' (``kv_pool=``)."""
        ref = local.engine if local is not None else self._engine
        holder = ref() if ref is not None else None
        if holder is None or holder.closed is not None:
            return
        if holder.has_work():
            s = holder.stats()
            raise RuntimeError(
                f"another engine of this LLM (or of one sharing its K/V pool) still serves requests "
                f"({s.waiting} waiting, {s.running} running) and holds its K/V pool: finish them "
                "(engine.run()) or close it (engine.close()) before building a new engine (one engine "
                "per LLM, as in vLLM)")
        holder.close("a newer engine of its LLM took over the K/V pool (one engine per LLM)")

    def _memory(self):
        """What holds this LLM's K/V now: the ``WorkerPool`` attached to it (with workers), else its
        ``KVPool`` (None before the first engine, or for workers an engine starts and stops itself)."""
        return attached(self) if uses_workers(self.engine_config) else self._kv_pool

    def reset_prefix_cache(self):
        """Forget every cached block of the K/V memory this LLM uses (vLLM's ``reset_prefix_cache``):
        the next engine over it, this LLM's or another's on the same worker pool, starts empty."""
        memory = self._memory()
        if memory is not None:
            memory.reset_prefix_cache()

    @property
    def kv_pool(self) -> KVPool:
        """This LLM's K/V pool (allocated now if no engine did yet), to lend another LLM of the same
        shapes (``LLM(kv_pool=...)``); with workers there is none here: they hold the K/V."""
        if uses_workers(self.engine_config):
            raise ValueError("kv_pool: this LLM's K/V lives on its workers (tensor_parallel x "
                             "pipeline_parallel > 1), not in this process")
        return self._pool()

    def _pool(self) -> KVPool:
        if self._kv_pool is None:
            ec, cfg = self.engine_config, self.cfg
            self._kv_pool = KVPool(ec.n_slots, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, ec.device,
                                   getattr(torch, ec.dtype))
        return self._kv_pool

    def _decode_graphs(self, kv):
        """The LLM's CUDA graphs (captured once over its pool, replayed by every engine), reserving
        their padding slots from this engine's ``kv``; None where they do not run."""
        if self._graphs is None:
            self._graphs = decode_graphs_for(self.model, kv, self.engine_config) or False
        if self._graphs:
            self._graphs.kv = kv
        return self._graphs or None

    def warm_up(self, longest: int | None = None) -> dict:
        """Meet every shape a run will meet before one is timed, as vLLM does at start-up: Triton's JIT
        and launch tuning at each prompt length bucket (up to ``longest`` tokens when no longer prompt
        will come, else the model's longest), a CUDA graph at each batch size up to ``max_bs``, the
        libraries' first calls (``workload.warm_up_traces``). Then the tuner settles: a shape met
        later borrows its nearest tuned neighbour's launch instead of timing mid-run. The prefix cache
        is emptied after. Returns the lengths and batch sizes it ran."""
        ec, cfg = self.engine_config, self.cfg
        prompts, steps = warm_up_traces(ec.max_bs, cfg.max_seq_len, ec.n_slots, cfg.vocab_size, GRAPH_SIZES,
                                        longest)
        for trace in prompts + steps:
            self.serve(trace)
        self.reset_prefix_cache()
        settle_tuning()
        return {"prompt_lens": [len(t[0].prompt) for t in prompts], "batch_sizes": [len(t) for t in steps]}

    def serve(self, trace, system: str = "orca", mbs: int | None = None, progress: bool = False) -> RunResult:
        """Serve a trace (``orca_lab.workload``) with arrivals on the real clock."""
        engine = self.new_engine(system, mbs)
        try:
            return engine.run(trace, progress=progress)
        finally:
            engine.close()

    # -- generation -----------------------------------------------------------------------------
    # Per prompt: ``max_gen_tokens`` an int or a list; ``sampling`` keywords (temperature, top_k, top_p,
    # seed, ignore_eos, eos_token_id, stop_token_ids, stop, logprobs, prompt_logprobs, logit_bias,
    # the penalties, min_tokens) for all; or ``sampling_params``, one
    # SamplingParams or a list of them. A sampled request without a seed draws from OS entropy.
    def generate(self, prompts, max_gen_tokens: int | list[int] | None = None, system: str = "orca", *,
                 sampling_params=None, **sampling) -> list[list[int]]:
        """Generated token ids of each prompt (token-id lists, or strings through the tokenizer).
        A prompt that fails (its sampling or stop check raised) fails alone: the others run to their
        end, then ``RequestsFailed`` names each failure and carries every output."""
        outputs = [[] for _ in _as_list(prompts)]
        try:
            for i, tok in self.stream(prompts, max_gen_tokens, system, sampling_params=sampling_params, **sampling):
                outputs[i].append(tok)
        except RequestsFailed as e:
            raise RequestsFailed(e.errors, outputs) from None
        return outputs

    def stream(self, prompts, max_gen_tokens: int | list[int] | None = None, system: str = "orca", *,
               sampling_params=None, **sampling) -> Iterator[tuple[int, int]]:
        """Yield ``(prompt index, token)`` as each iteration completes; ``RequestsFailed`` at the end
        if a prompt failed."""
        errors = {}
        for i, req, tok in self._run(prompts, max_gen_tokens, system, sampling_params, sampling):
            if tok is not None:
                yield i, tok
            if req.finish_reason == "error":
                errors[i] = req.error
        if errors:
            raise RequestsFailed(errors)

    def complete(self, prompts, max_gen_tokens: int | list[int] | None = None, system: str = "orca", *,
                 sampling_params=None, **sampling) -> list[Completion]:
        """Each prompt's tokens, text (stop string excluded) and finish reason, as /v1/completions."""
        reqs = {}
        for i, req, _ in self._run(prompts, max_gen_tokens, system, sampling_params, sampling):
            reqs[i] = req
        texts = {i: r.text_or_fail() for i, r in reqs.items()}       # first: a text that fails fails its request
        return [Completion(list(r.prompt), list(r.output), texts[i], r.finish_reason,
                           None if r.params.logprobs is None else r.logprobs[:len(r.output)],
                           None if r.params.prompt_logprobs is None else list(r.prompt_logprobs), r.error)
                for i, r in sorted(reqs.items())]

    def beam_search(self, prompts, params: BeamSearchParams, system: str = "orca") -> list[list[Beam]]:
        """vLLM's ``LLM.beam_search``: each prompt's ``params.beam_width`` best sequences, best first
        (``engine/beam_search.py``), each step one engine run of one-token requests."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        ids = [self._encode(p) for p in _as_list(prompts)]
        engine = self.new_engine(system)          # refuses first what the longest beams could not run
        try:
            engine.check_requests([(p, SamplingParams(max_gen_tokens=params.max_tokens)) for p in ids])
        finally:
            engine.close()
        searches = [BeamSearch(p, params, self.eos_token_ids) for p in ids]
        while seqs := pending(searches):
            steps = self.complete(seqs, 1, system, logprobs=params.logprobs, ignore_eos=True)
            advance_all(searches, [c.logprobs[0].top if c.error is None else StepFailed(c.error) for c in steps])
        return [s.best(getattr(self.tokenizer, "decode", None)) for s in searches]

    def _run(self, prompts, max_gen_tokens, system, sampling_params, sampling):
        """``(prompt index, request, token)`` for every token of every prompt (None: it failed), on a
        fresh engine."""
        prompts = _as_list(prompts)
        params = _per_prompt_params(len(prompts), max_gen_tokens, sampling_params, sampling)
        ids = [self._encode(p) for p in prompts]
        engine = self.new_engine(system)
        try:
            index = {engine.add_request(p, sp).rid: i for i, (p, sp) in enumerate(zip(ids, params))}
            while engine.has_work():
                for req, tok in engine.step():
                    yield index[req.rid], req, tok
        finally:
            engine.close()

    def _encode(self, prompt):
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError("a string prompt needs a tokenizer: pass LLM(tokenizer=...) or token ids "
                                "(the gpt2 preset finds GPT-2's BPE once tiktoken and openai-whisper are installed)")
            return self.tokenizer.encode(check_text("prompt", prompt))
        return prompt


def _check_lent_pool(pool: KVPool, cfg: ModelConfig, ec: EngineConfig) -> int:
    """The slots of ``pool``, lent to an LLM of ``cfg`` and ``ec``; a ValueError naming the first
    field where they differ."""
    if not isinstance(pool, KVPool):
        raise TypeError(f"kv_pool must be a KVPool (another LLM's kv_pool), got {type(pool).__name__}")
    if uses_workers(ec):
        raise ValueError("kv_pool: with tensor_parallel x pipeline_parallel > 1 the workers hold the K/V; "
                         "a pool in this process cannot be lent to them")
    if ec.prefix_caching:       # the lender's cached blocks hold K/V of its weights, maybe not these
        raise ValueError("kv_pool: a borrowed pool keeps no prefix cache; use prefix_caching=False")
    n_layers, _, n_heads, head_dim = pool.k.shape
    fields = [("n_slots", pool.n_slots, pool.n_slots if ec.n_slots is None else ec.n_slots),
              ("n_layers", n_layers, cfg.n_layers), ("n_kv_heads", n_heads, cfg.n_kv_heads),
              ("head_dim", head_dim, cfg.head_dim), ("dtype", pool.k.dtype, getattr(torch, ec.dtype)),
              ("device", pool.k.device, _device(ec))]
    for name, lent, own in fields:
        if lent != own:
            raise ValueError(f"kv_pool has {name}={lent} but this LLM needs {name}={own}: lend a pool "
                             "of the same model shapes, dtype, device and n_slots")
    return pool.n_slots


def _as_list(prompts) -> list:
    """The prompts of a call: one text, or a list of them (texts, or lists of token ids)."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, dict)) or not hasattr(prompts, "__iter__"):
        raise FieldError(f"prompts={shown(prompts)}: allowed a text, or a list of prompts (each a text or a list of "
                         "token ids)", "prompt")
    return list(prompts)


def _per_prompt_params(n: int, max_gen_tokens, sampling_params, sampling: dict) -> list[SamplingParams]:
    """One SamplingParams per prompt; lists must have one entry per prompt."""
    if sampling_params is not None:
        if max_gen_tokens is not None or sampling:
            raise ValueError("pass either sampling_params or max_gen_tokens / sampling keywords "
                             f"({', '.join(sorted(sampling)) or 'max_gen_tokens'}), not both")
        params = _one_per_prompt("sampling_params", sampling_params, n)
        bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise TypeError(f"sampling_params holds {bad!r}: each must be a SamplingParams")
        return params
    gens = _one_per_prompt("max_gen_tokens", 16 if max_gen_tokens is None else max_gen_tokens, n)
    return [SamplingParams(max_gen_tokens=g, **sampling) for g in gens]


def _one_per_prompt(name: str, value, n: int) -> list:
    if not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts: give one per prompt, "
                         "or a single value for all")
    return list(value)


def _generation_eos(path: Path) -> list:
    """``eos_token_id`` of a checkpoint's generation_config.json, else of its config.json, as a list."""
    for name in ("generation_config.json", "config.json"):
        f = path / name
        eos = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [eos]
    return []


def _backends(ec: EngineConfig) -> dict:
    return dict(attention_backend=ec.attention_backend, fused_ops_backend=ec.fused_ops_backend, tf32=ec.tf32)


def _device(ec: EngineConfig) -> torch.device:
    """The engine's device with its index ("cuda" -> cuda:0), as its tensors report it."""
    return torch.empty(0, device=ec.device).device


def _placed(gpt: GPT, ec: EngineConfig) -> GPT:
    """``gpt`` on the engine's device, dtype and kernels, the caller's model untouched: shared when
    nothing differs, a shallow copy sharing the weights when only the kernels do, else new tensors."""
    device, dtype = _device(ec), getattr(torch, ec.dtype)
    state = gpt.state_dict()
    if any(t.device != device or t.dtype != dtype for t in state.values()):
        with torch.device("meta"):
            placed = type(gpt)(gpt.cfg, **_backends(ec))
        placed.load_state_dict({k: t.to(device, dtype) for k, t in state.items()}, assign=True)
        return placed.eval()
    kernels = _backends(ec)
    if all(getattr(gpt, k) == v for k, v in kernels.items()):
        return gpt
    placed = copy.copy(gpt)               # its own attributes, the same modules and weights
    for k, v in kernels.items():
        setattr(placed, k, v)
    return placed
