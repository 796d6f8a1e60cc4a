"""A worker (ORCA §4.3): one process per (pipeline stage, tensor rank) running its share of each iteration.

Two threads. The relay forwards every control message to the next stage the moment it arrives, so the
control plane never waits for tensor work. The tensor thread then runs the iteration: build the
metadata (``BatchTensors``), take the activations (embed on the first stage, receive them from the
previous stage otherwise), run this stage's layers over this rank's heads, and either send the
activations on or, on the last stage, sample the tokens. Tensor rank 0 of each stage reports its
start and end to the master; the last stage's report carries the tokens.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from orca_lab.config import EngineConfig, ModelConfig
from orca_lab.engine.control import (ControlMessage, Inbox, Reset, StageReport, Stop, WorkerError, connect,
                                     decode_address, encode_address)
from orca_lab.engine.data_plane import DataPlane
from orca_lab.engine.executor import StageClock, split_layers
from orca_lab.engine.kv_manager import KVSlotManager
from orca_lab.engine.model import GPT
from orca_lab.engine.request import SamplingParams
from orca_lab.engine.sampler import sample
from orca_lab.engine.tensor_parallel import stage_model

MASTER = -1                 # the rank the engine master announces on the control plane
STORE_TIMEOUT = datetime.timedelta(seconds=300)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to start, picklable (it crosses the process boundary)."""
    cfg: ModelConfig
    engine: EngineConfig
    rank: int
    secret: bytes                        # first frame of every control connection
    store: tuple[str, int] | None = None  # rendezvous TCPStore (spawned workers connect to it)
    session: str = "orca_lab"            # key prefix of this pool in the store
    weights: str | None = None           # torch state-dict file, GPT-2 checkpoint dir, or None: random(seed)
    seed: int = 0
    host: str = "127.0.0.1"              # where this worker's control inbox listens
    local_rank: int = 0
    threads: int = 1

    @property
    def tp(self) -> int:
        return self.engine.tensor_parallel

    @property
    def pp(self) -> int:
        return self.engine.pipeline_parallel

    @property
    def device(self) -> torch.device:
        cuda = self.engine.device.startswith("cuda")
        return torch.device(f"cuda:{self.local_rank}" if cuda else "cpu")


@dataclass(eq=False)
class RemoteRequest:
    """The worker's record of a request: the K/V slots the master reserved for it, and what the
    sampler reads (``params``, ``rid``, its ``generator``) on the last stage."""
    rid: int
    slots: torch.Tensor
    params: SamplingParams
    generator: object = None


class Worker:
    def __init__(self, spec: WorkerSpec, store):
        self.spec, self.rank = spec, spec.rank
        self.stage, self.tp_rank = divmod(spec.rank, spec.tp)
        self.first, self.last = self.stage == 0, self.stage == spec.pp - 1
        self.device = spec.device
        torch.set_num_threads(spec.threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # listen first: peers find this address in the store as soon as it is there
        self.inbox = Inbox(spec.host, spec.secret)
        store.set(f"inbox/{self.rank}", encode_address(self.inbox.address))
        self.data = DataPlane(self.rank, spec.tp, spec.pp, store, self.device)
        self._build_stage()
        self.requests: dict[int, RemoteRequest] = {}
        self._connect(store)
        store.set(f"ready/{self.rank}", "1")

    def _build_stage(self):
        spec, cfg, ec = self.spec, self.spec.cfg, self.spec.engine
        lo, hi = split_layers(cfg.n_layers, spec.pp)[self.stage]
        full = load_model(spec)
        part = stage_model(full, (lo, hi), self.tp_rank, spec.tp, first=self.first, last=self.last,
                           all_reduce=self.data.all_reduce)
        del full
        dtype = getattr(torch, ec.dtype)
        self.model = part.to(self.device, dtype)
        self.dtype = dtype
        # this rank's K/V pool: its own heads, its stage's layers, all of the engine's slots
        self.kv = KVSlotManager(ec.n_slots, hi - lo, cfg.n_heads // spec.tp, cfg.head_dim, self.device, dtype)

    def _connect(self, store):
        """Connect downstream first (connecting never waits for the peer to accept), then accept
        the one upstream peer: the master for stage 0, the same tensor rank of the previous stage."""
        secret = self.spec.secret
        self.downstream = None if self.last else \
            connect(decode_address(store.get(f"inbox/{self.rank + self.spec.tp}")), secret, self.rank)
        self.report = connect(decode_address(store.get("master")), secret, self.rank) if self.tp_rank == 0 else None
        expected = MASTER if self.first else self.rank - self.spec.tp
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while time.monotonic() < deadline:
            got = self.inbox.accept(1.0)
            if got is not None and got[1] == expected:
                self.upstream = got[0]
                return
        raise RuntimeError(f"worker rank {self.rank}: no control connection from upstream rank {expected}")

    # -- the loop -------------------------------------------------------------------------------
    def serve(self):
        """Run iterations until Stop; on failure, tell the master (if this rank reports) and raise."""
        inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._relay, args=(inbox,), name=f"relay-{self.rank}", daemon=True).start()
        try:
            with torch.inference_mode():
                while not isinstance(msg := inbox.get(), Stop):
                    if msg is None:
                        raise RuntimeError(f"worker rank {self.rank}: the control channel from upstream closed")
                    if isinstance(msg, Reset):
                        self.requests.clear()
                    else:
                        self.run(msg)
        except BaseException:
            if self.report is not None:
                try:
                    self.report.send(WorkerError(self.rank, traceback.format_exc()))
                except OSError:
                    pass
            raise
        self.close()

    def _relay(self, out: queue.Queue):
        """Forward each control frame downstream as it arrives (still pickled: no decoding on the
        way), then hand it to the tensor thread. ``None`` tells it the upstream is gone."""
        try:
            while True:
                raw = self.upstream.recv_bytes()
                if self.downstream is not None:
                    self.downstream.send_bytes(raw)
                msg = pickle.loads(raw)
                out.put(msg)
                if isinstance(msg, Stop):
                    return
        except (EOFError, OSError):
            out.put(None)

    def run(self, msg: ControlMessage):
        """This stage's share of one iteration."""
        for rid in msg.release:
            self.requests.pop(rid, None)
        for rid, (slots, params) in msg.reserve.items():
            self.requests[rid] = RemoteRequest(rid, torch.tensor(slots, dtype=torch.int64), params)
        batch = msg.batch(self.requests)
        bt = batch.tensors(self.device)
        # Busy from the moment its input is here. On a GPU a recv returns once queued, so the stage
        # clock marks the stream (CUDA events) and reads the host clock at one synchronized point.
        clock = StageClock(self.device, time.time)
        if self.first:
            clock.mark()
            x = self.model.embed(bt)
        else:
            x = self.data.recv_prev((batch.n_tokens, self.spec.cfg.d_model), self.dtype)
            clock.mark()
        x = self.model.run_layers(x, bt, self.kv, 0, len(self.model.blocks))
        tokens = None
        if self.last:
            tokens = self._sample(x, bt, batch.requests)
        else:
            self.data.send_next(x)
        if self.report is not None:
            clock.mark()
            start, end = clock.times()
            self.report.send(StageReport(msg.iteration, self.stage, start, end, tokens))

    def _sample(self, x, bt, requests):
        logits = self.model.head(x, bt)                     # this rank's vocabulary rows
        if self.spec.tp > 1:
            logits = self.data.all_gather_last(logits)[:, :self.spec.cfg.vocab_size]
        return sample(logits, requests) if self.tp_rank == 0 else None

    def close(self):
        self.data.close()
        for conn in (self.upstream, self.downstream, self.report):
            if conn is not None:
                conn.close()
        self.inbox.close()


def load_model(spec: WorkerSpec) -> GPT:
    """The full model on CPU, from which this worker cuts its part."""
    ec = spec.engine
    backends = dict(attention_backend=ec.attention_backend, fused_ops_backend=ec.fused_ops_backend)
    if spec.weights is None:
        return GPT.random(spec.cfg, spec.seed, **backends)
    if Path(spec.weights).is_dir():
        return GPT.from_pretrained(spec.weights, **backends)
    with torch.device("meta"):
        model = GPT(spec.cfg, **backends)
    # mmap: each worker reads only the slices it keeps
    model.load_state_dict(torch.load(spec.weights, mmap=True, weights_only=True), assign=True)
    return model


def worker_process(spec: WorkerSpec):
    """Entry point of a worker process on this machine: join the pool's store, serve, exit."""
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)      # before the first parallel op starts OpenMP
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")      # the data plane stays on loopback
    try:
        tcp = dist.TCPStore(*spec.store, is_master=False, timeout=STORE_TIMEOUT)
        Worker(spec, dist.PrefixStore(spec.session, tcp)).serve()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)            # never linger in interpreter shutdown next to a broken process group
