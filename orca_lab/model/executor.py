"""The executor interface (``engine/executor.py``) over the model in this process: one stage, or
``n_workers`` stages run one after another for a pipeline's schedule without its processes.

Threads: orca_lab never calls ``torch.set_num_threads`` (importing or running a library should not
change its process); the caller picks. On a small CPU shared with other processes, one intra-op
thread is the safe choice for this engine: its ops are small, and with two OpenMP threads each op
waits at a barrier for a thread a neighbour may be holding (small ops measured 20-100x slower on a
busy 2-core machine). The benchmarks take ``--threads`` (default 1) and record it with the results.
"""
from __future__ import annotations

from collections import deque

import torch

from orca_lab.engine.batch import Batch
from orca_lab.engine.clock import RealClock, StageClock
from orca_lab.engine.executor import Completion, StageTime, split_layers
from orca_lab.model import logprobs
from orca_lab.model.sampler import sample


class LocalExecutor:
    """The model in this process. With ``n_workers > 1`` it keeps that many batches in flight and
    runs the layers of each as ``n_workers`` stages, one after another: the schedule of a pipeline
    without its concurrency (the worker processes give the concurrency). ``graphs`` (a
    ``DecodeGraphs``) runs decode-only iterations from padded CUDA graphs. It samples in the engine's
    process, on the engine's own ``Request`` objects: penalties and logprobs read and write them."""
    has_logits = True       # the sampling fields that shape or score logits apply (``Engine``)

    def __init__(self, model, kv, n_workers: int = 1, device="cpu", graphs=None):
        self.model, self.kv, self.device = model, kv, torch.device(device)
        self.n_workers = n_workers
        self.stages = split_layers(model.cfg.n_layers, n_workers)
        self.clock = RealClock()
        self.in_flight: deque[Batch] = deque()
        self.graphs = graphs if n_workers == 1 else None

    def submit(self, batch: Batch):
        self.in_flight.append(batch)

    @torch.inference_mode()
    def wait(self, timeout: float | None = None) -> Completion | None:
        batch = self.in_flight.popleft()
        clock = StageClock(self.device, self.clock.now)
        clock.mark()
        logits = self.graphs.run(batch) if self.graphs is not None and self.graphs.takes(batch) else None
        if logits is not None:
            tokens = sample(logits, batch)
            clock.mark()
        else:
            bt, x = batch.tensors(self.device), None
            for s, (lo, hi) in enumerate(self.stages):
                x = self.model.run_layers(self.model.embed(bt) if s == 0 else x, bt, self.kv, lo, hi)
                if s == len(self.stages) - 1:
                    tokens = sample(self.model.head(x, bt), batch)  # .tolist() syncs the device
                    if logprobs.wants_prompt(batch):
                        logprobs.record_prompt(self.model.head_at, x, batch)
                clock.mark()
        t = clock.times()
        return Completion(batch, tokens, [StageTime(s, a, b) for s, (a, b) in enumerate(zip(t, t[1:]))])

    def close(self):
        self.in_flight.clear()

