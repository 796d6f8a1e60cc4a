"""Executors run a Batch and hand back one token per request; the scheduler cannot tell them apart.

Interface: ``submit(batch)`` never waits; ``wait(timeout)`` returns the oldest batch in flight once it
is done (or None at the timeout); ``clock`` is the time the engine lives in; ``close()`` frees all.
Three implement it: the model in this process (``model/executor.py``), worker processes
(``distributed/executor.py``) and the simulator's cost model (``sim/executor.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

from orca_lab.config import check_range
from orca_lab.engine.batch import Batch


@dataclass(frozen=True)
class StageTime:
    stage: int
    start: float
    end: float


@dataclass
class Completion:
    batch: Batch
    tokens: list[int]
    stages: list[StageTime]


def split_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Equal contiguous partitions of the layers, one per pipeline stage (ORCA §4.1)."""
    check_range("pipeline_parallel", n_stages, 1, n_layers)
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))

