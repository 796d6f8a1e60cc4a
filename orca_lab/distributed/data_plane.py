"""The data plane (ORCA §4.1): tensors between workers over torch.distributed, never over control.

Ranks are laid out stage-major: worker ``(stage s, tensor rank t)`` is rank ``s * T + t``. Activations
``[sum L, H]`` go point to point from ``(s, t)`` to ``(s + 1, t)``; within a stage the tensor-parallel
ranks all-reduce their partial sums and all-gather the vocabulary-split logits. NCCL on GPUs (the
device is ``cuda:<local rank>``; written for it, not tested on this project's CPU machines), gloo on CPU.
"""
from __future__ import annotations

import datetime
from collections import deque

import torch
import torch.distributed as dist


class DataPlane:
    def __init__(self, rank: int, tp: int, pp: int, store, device: torch.device, timeout_s: float = 300.0):
        self.rank, self.tp, self.pp, self.device = rank, tp, pp, device
        self.stage, self.tp_rank = divmod(rank, tp)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("data_plane", store), rank=rank,
                                world_size=tp * pp, timeout=datetime.timedelta(seconds=timeout_s))
        # new_group is collective over the whole world: every rank creates every stage's group,
        # in the same order, and keeps its own.
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        self.tp_group = groups[self.stage]
        self._sends: deque = deque()       # (work, tensor): a tensor must live until its send is done

    # -- tensor parallelism, inside a stage --------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.tp_group)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' pieces of ``t`` concatenated along the last dimension, in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return torch.cat(parts, -1)

    # -- pipeline parallelism, between stages ------------------------------------------------------
    def send_next(self, x: torch.Tensor):
        """Hand ``x`` to the next stage without waiting for it to be received: the next stage may
        still be busy with the previous iteration."""
        x = x.contiguous()
        self._sends.append((dist.isend(x, dst=self.rank + self.tp), x))
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()

    def recv_prev(self, shape, dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, src=self.rank - self.tp)
        return x

    def close(self):
        while self._sends:
            self._sends.popleft()[0].wait()
        dist.destroy_process_group()
