"""A worker (ORCA §4.1): one process per (pipeline stage, tensor rank) running its share of each iteration.

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
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from orca_lab.config import EngineConfig, ModelConfig
from orca_lab.distributed.channels import Inbox, connect, decode_address, encode_address
from orca_lab.distributed.data_plane import DataPlane
from orca_lab.distributed.heartbeat import watch_master, watch_parent
from orca_lab.distributed.messages import ControlMessage, Reset, StageReport, Stop, WorkerError
from orca_lab.distributed.wire import ControlError, decode
from orca_lab.engine.clock import StageClock
from orca_lab.engine.executor import split_layers
from orca_lab.engine.kv_manager import KVPool
from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.model import logprobs
from orca_lab.model.families import checkpoint_weights
from orca_lab.model.gpt import RandomWeights, StateDictWeights
from orca_lab.model.kv_sizing import rank_shares, size_kv_pool
from orca_lab.model.sampler import sample
from orca_lab.model.tensor_parallel import stage_model

MASTER = -1                 # the rank the engine master announces on the control plane
STORE_TIMEOUT = datetime.timedelta(seconds=300)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to start, picklable (it crosses the process boundary)."""
    cfg: ModelConfig
    engine: EngineConfig
    rank: int
    secret: bytes                        # HMAC key of every control message
    store: tuple[str, int] | None = None  # rendezvous TCPStore (spawned workers connect to it)
    session: str = "orca_lab"            # key prefix of this pool in the store
    weights: str | None = None           # torch state-dict file, GPT-2 checkpoint dir, or None: random(seed)
    seed: int = 0
    host: str = "127.0.0.1"              # where this worker's control inbox listens
    local_rank: int = 0
    threads: int = 1
    master_timeout: float = 30.0         # give up when the master's heartbeat stops this long (s)

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
    """The worker's record of a request: the K/V slots the master reserved for it, and on the last
    stage what the sampler reads and writes, the fields of ``Request`` it shares: ``params``, ``rid``,
    its ``generator``, its ``prompt`` (sent only when its sampling reads it), the ``output`` this
    stage sampled for it, and the log-probabilities computed so far (``penalties.py``, ``logprobs.py``)."""
    rid: int
    slots: torch.Tensor
    params: SamplingParams
    prompt: list[int] = field(default_factory=list)
    generator: object = None
    output: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)


class Worker:
    def __init__(self, spec: WorkerSpec, store):
        self.spec, self.rank = spec, spec.rank
        self.stage, self.tp_rank = divmod(spec.rank, spec.tp)
        self.first, self.last = self.stage == 0, self.stage == spec.pp - 1
        self.device = spec.device
        torch.set_num_threads(spec.threads)
        if self.device.type == "cuda":
            if spec.local_rank >= torch.cuda.device_count():
                raise RuntimeError(f"worker rank {spec.rank}: LOCAL_RANK={spec.local_rank} but this node has "
                                   f"{torch.cuda.device_count()} GPU(s): start at most that many ranks per node")
            torch.cuda.set_device(self.device)
        # listen first: peers find this address in the store as soon as it is there
        self.inbox = Inbox(spec.host, spec.secret)
        store.set(f"inbox/{self.rank}", encode_address(self.inbox.address))
        self.data = DataPlane(self.rank, spec.tp, spec.pp, store, self.device)
        self._build_stage(store)
        self.requests: dict[int, RemoteRequest] = {}
        self.last_iteration = 0             # the pool's first is 1
        self._connect(store)
        store.set(f"ready/{self.rank}", "1")

    def _build_stage(self, store):
        """This rank's layers and slices only, read straight onto its device (never the full model),
        once its GPU is known to hold them and the K/V pool the master sized."""
        spec, cfg, ec = self.spec, self.spec.cfg, self.spec.engine
        lo, hi = split_layers(cfg.n_layers, spec.pp)[self.stage]
        self.dtype = getattr(torch, ec.dtype)
        n_slots = ec.n_slots if ec.n_slots is not None else int(store.get("n_slots"))
        if self.device.type == "cuda":
            share = rank_shares(cfg, spec.tp, [(lo, hi)], self.dtype.itemsize)
            size_kv_pool(f"worker rank {self.rank}'s share of {cfg.name}", share, n_slots, n_slots, self.device,
                         ec.gpu_memory_utilization)
        self.model = stage_model(weight_source(spec, self.device, self.dtype), cfg, (lo, hi), self.tp_rank, spec.tp,
                                 first=self.first, last=self.last, all_reduce=self.data.all_reduce,
                                 attention_backend=ec.attention_backend, fused_ops_backend=ec.fused_ops_backend, tf32=ec.tf32)
        # this rank's K/V pool: its own heads, its stage's layers, all of the engine's slots; allocated
        # once for the worker's life (a new engine resets the requests it knows, not the memory)
        self.kv = KVPool(n_slots, hi - lo, cfg.kv_heads_on(spec.tp), cfg.head_dim, self.device, self.dtype)

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
                    if isinstance(msg, ControlError):
                        raise msg
                    if isinstance(msg, Reset):
                        self.requests.clear()
                    else:
                        self._check_order(msg.iteration)
                        self.run(msg)
        except BaseException:
            if self.report is not None:
                try:
                    self.report.send(WorkerError(self.rank, traceback.format_exc()))
                except OSError:
                    pass
            raise
        self.close()

    def _check_order(self, iteration: int):
        """The pool numbers iterations in one increasing sequence across engines: an iteration at or
        below the last one run is a replay the frame seals could not see (the same message signed
        again), and running it would sample a request twice."""
        if iteration <= self.last_iteration:
            raise ControlError(f"worker rank {self.rank}: refused iteration {iteration} after iteration "
                               f"{self.last_iteration} (iterations must increase)")
        self.last_iteration = iteration

    def _relay(self, out: queue.Queue):
        """Check each control frame's signature and forward it downstream as it arrives (the same
        signed bytes), then hand the message to the tensor thread. ``None`` tells it the upstream is
        gone; a refused frame is handed over as its error, which stops this worker."""
        try:
            while True:
                raw = self.upstream.recv_raw()
                msg = decode(raw, self.spec.secret)
                if self.downstream is not None:
                    self.downstream.send_raw(raw)
                out.put(msg)
                if isinstance(msg, Stop):
                    return
        except (EOFError, OSError):
            out.put(None)
        except ControlError as e:
            out.put(e)

    def run(self, msg: ControlMessage):
        """This stage's share of one iteration."""
        for rid in msg.release:
            self.requests.pop(rid, None)
        for rid, (slots, params, prompt) in msg.reserve.items():
            slots = torch.tensor(slots, dtype=torch.int64)
            if rid in self.requests:        # a paged request's blocks changed: keep its generator and tokens
                self.requests[rid].slots = slots
            else:
                self.requests[rid] = RemoteRequest(rid, slots, params, list(prompt))
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
        tokens, scores = None, []
        if self.last:
            tokens, scores = self._sample(x, bt, batch)
        else:
            self.data.send_next(x)
        if self.report is not None:
            clock.mark()
            start, end = clock.times()
            self.report.send(StageReport(msg.iteration, self.stage, start, end, tokens, scores))

    def _sample(self, x, bt, batch):
        """The tokens and the new log-probabilities of the requests that ask, as the last stage's
        tensor rank 0 reports them. Every rank of the stage gathers the logits, so each joins every
        collective; rank 0 alone draws (and so alone keeps a request's output)."""
        logits = self._logits_at(x, bt.last_idx)
        before = [(len(r.logprobs), len(r.prompt_logprobs)) for r in batch.requests]
        tokens = None
        if self.tp_rank == 0:
            tokens = sample(logits, batch)
            for r, token in zip(batch.requests, tokens):
                if isinstance(token, int):      # (a str: the request failed, ``sampler.sample``)
                    r.output.append(token)
        if logprobs.wants_prompt(batch):
            logprobs.record_prompt(self._logits_at, x, batch)
        return tokens, new_scores(batch.requests, before) if self.tp_rank == 0 else []

    def _logits_at(self, x, rows):
        """The logits of the rows ``rows`` of ``x`` over the whole vocabulary (each tensor rank
        projects onto its own rows of it)."""
        logits = self.model.head_at(x, rows)
        if self.spec.tp > 1:
            logits = self.data.all_gather_last(logits)[:, :self.spec.cfg.vocab_size]
        return logits

    def close(self):
        self.data.close()
        for conn in (self.upstream, self.downstream, self.report):
            if conn is not None:
                conn.close()
        self.inbox.close()


def new_scores(requests, before) -> list:
    """``[rid, sampled entry or None, prompt entries]`` of each request whose log-probabilities
    grew past its ``before`` counts, as plain lists for a ``StageReport``."""
    scores = []
    for r, (n, n_prompt) in zip(requests, before):
        if len(r.logprobs) > n or len(r.prompt_logprobs) > n_prompt:
            sampled = logprobs.to_plain(r.logprobs[n]) if len(r.logprobs) > n else None
            scores.append([r.rid, sampled, [logprobs.to_plain(e) for e in r.prompt_logprobs[n_prompt:]]])
    return scores


def weight_source(spec: WorkerSpec, device, dtype):
    """Where this worker reads its slices from: ``random(seed)``, a checkpoint directory, or a
    state-dict file the master wrote (memory-mapped: only the pages of this worker's slices are read)."""
    if spec.weights is None:
        return RandomWeights(spec.seed, device, dtype)
    if Path(spec.weights).is_dir():
        return checkpoint_weights(spec.weights, device, dtype)
    return StateDictWeights(torch.load(spec.weights, mmap=True, weights_only=True), device, dtype)


def worker_process(spec: WorkerSpec):
    """Entry point of a worker process on this machine: join the pool's store, serve, exit."""
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)      # before the first parallel op starts OpenMP
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")      # the data plane stays on loopback
    store = None
    watch_parent(spec.rank)
    try:
        tcp = dist.TCPStore(*spec.store, is_master=False, timeout=STORE_TIMEOUT)
        store = dist.PrefixStore(spec.session, tcp)
        watch_master(store.clone(), spec.master_timeout, spec.rank)
        Worker(spec, store).serve()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        if store is not None:           # the master names it when it sees this process exit
            try:
                store.set(f"error/{spec.rank}", traceback.format_exc()[-4000:])
            except Exception:
                pass
        os._exit(1)            # never linger in interpreter shutdown next to a broken process group
