"""The two backends a sweep drives, with one interface (``serve(curve, trace)``): ``SimBackend``
assembles the real engine loop, scheduler and K/V slot manager around a ``SimExecutor``;
``RealBackend`` runs the GPT of ``orca_lab.llm`` on the machine at hand."""
from __future__ import annotations

from dataclasses import dataclass

from orca_lab.config import CPU_SLOTS, EngineConfig, ModelConfig, check_range, model_config, uses_workers
from orca_lab.engine.engine import Engine
from orca_lab.engine.policies import PAGED, new_kv, new_scheduler
from orca_lab.engine.policies import system as resolve_system
from orca_lab.llm import LLM
from orca_lab.sim.calibration import efficiency
from orca_lab.sim.cost import AnalyticalCost, Efficiency
from orca_lab.sim.executor import SimExecutor
from orca_lab.sim.sweep import Curve
from orca_lab.workload import TraceItem


@dataclass
class SimBackend:
    """The engine of ``orca_lab`` on a cost model: ``AnalyticalCost`` of ``model`` on ``device`` with
    the paper's parallelism unless given, its parameters ``eff`` or those of the named ``cost``
    ("calibrated" on published GPU measurements, the default, or "analytical":
    ``orca_lab.sim.calibration``), or any object with ``iteration(batch)`` and ``n_stages``.
    Paged curves cut the same ``n_slots`` into blocks of ``block_size`` (the remainder, less than a
    block, unused); chunked ones take ``max_num_batched_tokens`` new tokens per iteration."""
    model: str | ModelConfig
    device: str = "a100-40gb"
    eff: Efficiency | None = None
    cost: object = "calibrated"
    n_slots: int | None = None
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 512
    speed: object = None        # a fitted.SpeedProfile (SimExecutor); None: the cost as it is
    prefix_caching: bool = False     # paged / chunked curves: a cached prefix is not prefilled again
    schedule_policy: str = "fcfs"    # or "lpm" with prefix_caching (engine/policies.py)

    def __post_init__(self):
        self.cfg = model_config(self.model)
        EngineConfig(block_size=self.block_size, max_num_batched_tokens=self.max_num_batched_tokens,
                     prefix_caching=self.prefix_caching, schedule_policy=self.schedule_policy)
        if self.cost is None or isinstance(self.cost, str):
            eff = self.eff or efficiency(self.cost or "calibrated")
            self.cost = AnalyticalCost(self.cfg, self.device, self.tensor_parallel, self.pipeline_parallel, eff)
        if self.n_slots is None:
            self.n_slots = self.cost.n_slots()
        check_range("n_slots", self.n_slots, 1, 1 << 40)

    @property
    def name(self) -> str:
        return self.cfg.name

    def new_engine(self, curve: Curve, eos_after=None) -> Engine:
        n_slots = self.n_slots - (self.n_slots % self.block_size if curve.system in PAGED else 0)
        kv = new_kv(curve.system, n_slots, self.block_size, prefix_caching=self.prefix_caching)   # accounting only
        executor = SimExecutor(self.cost, eos_after, self.speed)
        config = {"model": self.cfg.name, "system": curve.system, "max_bs": curve.max_bs, "mbs": curve.mbs,
                  "n_slots": n_slots, "n_workers": executor.n_workers, "simulated": True,
                  "block_size": self.block_size, "max_num_batched_tokens": self.max_num_batched_tokens,
                  "prefix_caching": self.prefix_caching, "schedule_policy": self.schedule_policy}
        scheduler = new_scheduler(curve.system, kv, curve.max_bs, self.cfg.max_seq_len, curve.mbs,
                                  self.max_num_batched_tokens, self.schedule_policy)
        return Engine(scheduler, executor, self.cfg.vocab_size, self.cfg.max_seq_len, config)

    def serve(self, curve: Curve, trace, **kw):
        return self.new_engine(curve, **kw).run(trace)


class RealBackend:
    """The real engine (``orca_lab.llm``) with ``preset``'s GPT, seeded random weights, on ``device``
    over ``tensor_parallel x pipeline_parallel`` GPUs (worker processes when above 1).

    Every shape is warmed up before it is timed: the first time a curve meets a trace of new lengths,
    a short untimed copy of it runs first (its first ``max_bs`` requests, two tokens each: one prefill
    and one decode iteration), so Triton's JIT and the first-call costs of the libraries stay out of
    the timed run; the device is synchronized before the run's clock starts. One LLM per ``max_bs``
    serves every run of that size: its CUDA graphs are captured once.

    ``n_slots`` None: ``EngineConfig``'s, 16384 on a CPU, and on a GPU as many as its free memory
    holds beside the weights (as the simulator's ``AnalyticalCost.n_slots``: the baseline's
    out-of-memory points come from the memory, not from a fixed count). That one K/V pool, the
    first LLM's, is lent to the LLM of every ``max_bs`` (runs are one at a time): a pool each
    would take the memory as many times over. Workers (``tensor_parallel x pipeline_parallel > 1``)
    hold a pool per LLM that cannot be lent, so there ``n_slots`` None stays ``CPU_SLOTS`` a pool."""

    def __init__(self, preset: str = "tiny", seed: int = 0, n_slots: int | None = None, device: str = "cpu",
                 dtype: str = "float32", tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 block_size: int = 16, max_num_batched_tokens: int = 512):
        engine = EngineConfig(n_slots=n_slots, device=device, dtype=dtype, tensor_parallel=tensor_parallel,
                              pipeline_parallel=pipeline_parallel, block_size=block_size,
                              max_num_batched_tokens=max_num_batched_tokens)
        if engine.n_slots is None and uses_workers(engine):
            engine = engine.replace(n_slots=CPU_SLOTS)
        self.llm = LLM(preset, seed=seed, engine=engine)
        self._engine = self.llm.engine_config       # n_slots as the LLM sized it, before its weights
        self.cfg, self.n_slots = self.llm.cfg, self._engine.n_slots
        self._warm: set = set()
        self._llms: dict[int, LLM] = {}      # max_bs -> the LLM serving that size

    @property
    def name(self) -> str:
        return self.cfg.name

    def describe(self) -> dict:
        """What was measured, for a result's metadata."""
        ec = self._engine
        return {"preset": self.cfg.name, "device": ec.device, "dtype": ec.dtype, "n_slots": ec.n_slots,
                "tensor_parallel": ec.tensor_parallel, "pipeline_parallel": ec.pipeline_parallel}

    def serve(self, curve: Curve, trace):
        llm = self.llm_for(curve.max_bs, max((len(t.prompt) for t in trace), default=None))
        self.warm_up(llm, curve, trace)
        _synchronize(self._engine.device)
        return llm.serve(trace, system=curve.system, mbs=curve.mbs)

    def llm_for(self, max_bs: int, longest: int | None = None) -> LLM:
        """The LLM of ``max_bs`` over the preset's model: a new one (pool, graphs) per run made each
        point pay for them, and the graphs of a run's smaller batches were captured inside its timing.
        On a GPU it is warmed up whole (``LLM.warm_up``) before its first run: graphs, JIT and tuning at
        every shape, not only the first batch's (on an H200, Figure 10's first ORCA curve otherwise ran
        10x its predicted time, and its capacity came out below the baseline's); its prompts up to
        ``longest``, the first run's longest (Figure 9's 32 tokens need no 2,046-token prompt)."""
        if max_bs not in self._llms:
            lent = None if uses_workers(self._engine) else self.llm.kv_pool    # workers hold their own
            llm = self._llms[max_bs] = LLM(gpt=self.llm.model, engine=self._engine.replace(max_bs=max_bs),
                                           kv_pool=lent)
            if self._engine.device.startswith("cuda"):
                llm.warm_up(longest)
        return self._llms[max_bs]

    def warm_up(self, llm, curve: Curve, trace):
        """Run the first ``max_bs`` requests of ``trace`` for two tokens, once per curve and lengths;
        the run (None if already warm). The baseline's prompts are cut to the batch's shortest
        (``warm_up_batch``): its batch feeds a longer prompt one token per iteration, so two tokens of
        the whole prompts took hundreds of iterations (ft(8,8) on gpt2: ~400); cut, they take the two
        the timed run starts with, of the same shapes (``[B, shortest]``, then ``[B, 1]``)."""
        first = list(trace)[:curve.max_bs]
        key = (curve, tuple(len(t.prompt) for t in first))
        if key in self._warm or not first:
            return None
        self._warm.add(key)
        return llm.serve(warm_up_batch(first, curve.system), system=curve.system, mbs=curve.mbs)


def warm_up_batch(first, system: str) -> list[TraceItem]:
    """The untimed copy of a run's first batch ``first``: at t=0, two tokens each (one prefill and one
    decode iteration); for a request-level system (the baseline), every prompt cut to the batch's
    shortest, which is all its first iteration feeds (the rest would be fed one token per iteration)."""
    cut = min(len(t.prompt) for t in first) if resolve_system(system).request_level else None
    return [TraceItem(0.0, tuple(t.prompt)[:cut], min(t.max_gen_tokens, 2)) for t in first]


def _synchronize(device: str):
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize(device)

