"""ORCA's distributed execution engine (§4.1): worker processes driven by the engine master.

``EngineConfig(tensor_parallel=T, pipeline_parallel=P)`` makes ``LLM.new_engine`` start a
``WorkerPool`` of T x P workers (``worker.py``) and drive it through a ``WorkerExecutor``:
- ``submit(batch)`` sends the iteration's control message to the first stage (``control.py``) and
  returns at once; the scheduler keeps ``n_workers = P`` batches in flight, so no stage idles;
- ``wait()`` takes the oldest batch's tokens from the last stage, with every stage's start and end
  (wall clock, turned into this executor's clock) for the pipeline trace;
- activations never pass through the master: they go worker to worker (``data_plane.py``).

Lifecycle: the pool picks its ports on 127.0.0.1 (the OS chooses them), stops its workers on
``close()``, on leaving a ``with`` block, when garbage-collected or at interpreter exit; while waiting
it polls the workers' liveness, so a worker that dies makes ``wait`` raise ``RuntimeError`` within
about a second, after stopping the others. Engines of one LLM can share a pool
(``with WorkerPool(llm): llm.serve(...)``) instead of starting one each.

Across nodes, with torchrun (env:// rendezvous; rank 0 is the engine master and also worker 0)::

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank $NODE --master-addr $HOST0 --master-port 29500 \\
        -m orca_lab.torchrun --model tiny --tp 2 --pp 2 --n-requests 32 --out results/torchrun

(see ``torchrun.py`` and docs/distributed.md).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import wait as wait_any

import torch
import torch.distributed as dist

from orca_lab.config import check_degrees
from orca_lab.distributed.channels import Inbox, connect, decode_address, encode_address
from orca_lab.distributed.heartbeat import start_heartbeat
from orca_lab.distributed.messages import Reset, StageReport, Stop, WorkerError
from orca_lab.distributed.processes import exit_text, main_hidden, process_context
from orca_lab.distributed.wire import ControlError, encode
from orca_lab.distributed.worker import MASTER, STORE_TIMEOUT, Worker, WorkerSpec, worker_process
from orca_lab.engine.kv_manager import KVMemory

POLL_S = 0.25               # liveness is checked at least this often while waiting


# -- the pool -------------------------------------------------------------------------------------
_ATTACHED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # LLM -> WorkerPool


def attached(llm) -> "WorkerPool | None":
    """The pool ``WorkerPool(llm)`` attached to ``llm`` while it can serve (a pool closed or broken
    detaches itself), else None."""
    pool = _ATTACHED.get(llm)
    return pool if pool is not None and not pool.broken and pool._finalizer.alive else None


class WorkerPool(KVMemory):
    """T x P workers serving one model, their control channels and their liveness.

    ``WorkerPool(llm)`` starts the workers on this machine and attaches the pool to ``llm``: its
    engines use it until it is closed. ``threads`` is the torch thread count of each worker
    (``OMP_NUM_THREADS``): 1 keeps processes that share few cores from stalling one another.
    The workers hold the K/V; the pool keeps the prefix cache over it (``KVMemory``), lent with the
    workers to whichever engine drives them, and dropped when the pool closes or breaks.
    """

    def __init__(self, llm, *, threads: int = 1, attach: bool = True, start_timeout: float = 180.0,
                 stall_timeout: float = 300.0, _torchrun: tuple | None = None):
        ec = llm.engine_config
        check_degrees(llm.cfg, ec)
        self.cfg, self.engine, self.model_ref = llm.cfg, ec, weakref.ref(llm.model)
        # what the workers build their weights from, when the master holds shapes only (a meta model
        # shared by several LLMs can name other seeds or checkpoints): each LLM attached must name it
        self.weights = llm.weights if llm.model.wte.weight.is_meta else None
        self.tp, self.pp = ec.tensor_parallel, ec.pipeline_parallel
        self.stall_timeout = stall_timeout
        self.owner = None                                 # the executor now driving the workers
        self.broken: str | None = None
        self._iteration = 0
        self._got: dict[int, dict[int, StageReport]] = {}
        self._procs, self._thread, self._control, self._reports = [], [], [], {}
        self._cleanup: list = []
        self._store_port: list[int] = []               # when this process hosts the rendezvous store
        self._store_box: list = []                     # that store (and its prefix view), until teardown
        self._weights_dir: str | None = None          # the weights file's folder, until the workers are ready
        self._grace = {"s": 10.0}                      # how long workers get to stop by themselves
        # runs on close(), on garbage collection and at interpreter exit: never a worker left behind
        self._finalizer = weakref.finalize(self, _teardown, self._procs, self._thread, self._control,
                                           self._reports, self._cleanup, self._grace)
        try:
            store = self._start(llm, threads, _torchrun)
            self._handshake(store, time.monotonic() + start_timeout)
        except BaseException:
            self._grace["s"] = 0
            self._finalizer()
            raise
        if attach:
            self.attach(llm)

    @classmethod
    def rank0(cls, llm, store, spec) -> "WorkerPool":
        """Under torchrun: the other ranks are already running ``Worker.serve``; this process is rank 0,
        the engine master, and runs worker 0 in a thread (``torchrun.py``)."""
        return cls(llm, _torchrun=(store, spec))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def ports(self) -> list[int]:
        """The loopback ports this process listens on for the pool (freed by ``close``)."""
        return [self._inbox.address[1]] + self._store_port

    def _start(self, llm, threads, torchrun):
        """Spawn the workers here (or start rank 0's worker thread under torchrun); return the
        rendezvous store."""
        if torchrun is not None:
            store, spec = torchrun
            self._secret = spec.secret
            self._open_inbox(store, spec.host)
            self._thread.append(_start_thread(spec, store))
            return store
        self._secret, session = secrets.token_bytes(32), f"pool-{secrets.token_hex(4)}"
        weights, seed = self._weights_for_workers(llm)
        tcp = _loopback_store()
        store = dist.PrefixStore(session, tcp)
        self._store_box, self._store_port = [tcp, store], [tcp.port]   # dropping them frees the port
        self._cleanup.append(self._store_box.clear)
        self._cleanup.append(start_heartbeat(store.clone()).set)     # the workers watch it (control.py)
        self._open_inbox(store, "127.0.0.1")
        ctx = process_context(self.engine.device)
        for rank in range(self.tp * self.pp):
            spec = WorkerSpec(self.cfg, self.engine, rank, self._secret, ("127.0.0.1", tcp.port), session,
                              weights, seed, host="127.0.0.1", local_rank=rank, threads=threads)
            proc = ctx.Process(target=worker_process, args=(spec,), name=f"orca-worker-{rank}", daemon=True)
            self._procs.append(proc)       # before start: an interrupt inside it still tears it down
            with main_hidden():
                proc.start()
        return store

    def _weights_for_workers(self, llm) -> tuple[str | None, int]:
        """``(weights, seed)`` of the WorkerSpec: the LLM's checkpoint or seed when its master holds
        shapes only; else its model's weights, written once to a file the workers memory-map (removed
        once they are ready: their maps outlive the name, and a master killed later leaves no file)."""
        if llm.model.wte.weight.is_meta:
            return llm.weights
        tmp = tempfile.mkdtemp(prefix="orca_lab_workers_")
        self._weights_dir = tmp
        self._cleanup.append(lambda: shutil.rmtree(tmp, ignore_errors=True))
        path = os.path.join(tmp, "weights.pt")
        torch.save({k: v.detach().cpu() for k, v in llm.model.state_dict().items()}, path)
        return path, 0

    def _open_inbox(self, store, host):
        self._inbox = Inbox(host, self._secret)
        self._cleanup.append(self._inbox.close)
        store.set("n_slots", str(self.engine.n_slots))         # for workers started with n_slots=None
        store.set("master", encode_address(self._inbox.address))

    def _handshake(self, store, deadline):
        """Connect to every stage-0 worker, accept one report channel per stage, and wait until
        every worker says it is ready; a worker that dies meanwhile fails the start at once."""
        for t in range(self.tp):
            address = decode_address(self._await(store, [f"inbox/{t}"], deadline, "open its control inbox")[0])
            self._control.append(self._connect_stage0(address, deadline))
        while len(self._reports) < self.pp:
            got = self._inbox.accept(POLL_S)
            if got is not None:
                self._reports[got[0]] = got[1]
            self._check_alive("during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(self._reports)} of {self.pp} stages connected to the master in time")
        self._await(store, [f"ready/{r}" for r in range(self.tp * self.pp)], deadline, "start")
        if self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)

    def _connect_stage0(self, address, deadline):
        """A worker may open its inbox and die just after (a start-up error): a refused connection
        then means it is gone, and its own error, read when its process exits, is the one to report."""
        try:
            return connect(address, self._secret, MASTER)
        except OSError as e:
            end = min(deadline, time.monotonic() + 5.0)
            while time.monotonic() < end:
                self._check_alive("during start-up")
                time.sleep(0.05)
            raise RuntimeError(f"a worker's control inbox at {address} refused the master: {e}") from e

    def _await(self, store, keys, deadline, what):
        while not store.check(keys):
            self._check_alive("during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not {what} in time ({keys[0]} ...)")
            time.sleep(0.02)
        return [store.get(k) for k in keys]

    # -- attachment: engines of these LLMs borrow this pool ----------------------------------------
    def attach(self, llm):
        """Lend this pool, and the prefix cache over its K/V, to ``llm`` too: only an LLM of the model
        whose weights the workers loaded, so that every K/V they hold comes from one set of weights."""
        if llm.model is not self.model_ref() or llm.cfg != self.cfg or _worker_fields(llm.engine_config) != \
                _worker_fields(self.engine):
            raise ValueError("this worker pool serves another model or another parallel/K/V configuration")
        if self.weights is not None and llm.weights != self.weights:
            raise ValueError(f"this worker pool's workers built their weights from (checkpoint, seed) = "
                             f"{self.weights}, not {llm.weights}")
        _ATTACHED[llm] = self

    def _detach_all(self):
        """Closed or broken: no LLM uses the pool any more, and its cache goes with its K/V."""
        for llm in [k for k, v in _ATTACHED.items() if v is self]:
            del _ATTACHED[llm]
        self.reset_prefix_cache()

    # -- the control plane, master side ----------------------------------------------------------
    def claim(self, executor):
        """``executor`` drives the workers from now on; they forget the previous engine's requests."""
        self._check_usable()
        self.owner = executor
        self.send(Reset())

    def next_iteration(self) -> int:
        self._iteration += 1
        return self._iteration

    def send(self, msg):
        raw = encode(msg, self._secret)             # signed once, the same bytes to every tensor rank
        try:
            for conn in self._control:
                conn.send_raw(raw)
        except OSError as e:
            self._fail_naming_the_dead(f"the control channel to stage 0 broke ({e})")
        except BaseException:       # an interrupt: some tensor ranks may hold the message and others
            self._break("a send to the workers was interrupted, so their tensor ranks may be out of step")
            raise                   # not, and would wait on each other's collectives: the pool ends

    def collect(self, iteration: int, timeout: float | None) -> list[StageReport] | None:
        """Every stage's report of ``iteration`` (tokens in the last), or None after ``timeout``."""
        self._check_usable()
        end = None if timeout is None else time.monotonic() + timeout
        stall = time.monotonic() + self.stall_timeout
        while len(self._got.get(iteration, ())) < self.pp:
            left = POLL_S if end is None else max(0.0, min(POLL_S, end - time.monotonic()))
            for conn in wait_any(list(self._reports), left):
                self._take(conn)
                stall = time.monotonic() + self.stall_timeout
            self._check_alive("")
            if time.monotonic() > stall:
                self._fail(f"no stage reported for {self.stall_timeout:.0f} s while iteration {iteration} was in flight")
            if end is not None and time.monotonic() >= end and len(self._got.get(iteration, ())) < self.pp:
                return None
        reports = self._got.pop(iteration)
        for stale in [i for i in self._got if i < iteration]:   # left by an engine that was abandoned
            del self._got[stale]
        return [reports[s] for s in range(self.pp)]

    def _take(self, conn):
        try:
            msg = conn.recv()
        except ControlError as e:
            self._fail(f"worker rank {self._reports[conn]} sent a frame that was refused: {e}")
        except (EOFError, OSError):
            self._fail_naming_the_dead(f"worker rank {self._reports[conn]} closed its control channel")
        if isinstance(msg, WorkerError):
            self._fail(f"worker rank {msg.rank} failed:\n{msg.text}")
        self._got.setdefault(msg.iteration, {})[msg.stage] = msg

    # -- liveness and shutdown -------------------------------------------------------------------
    def _check_alive(self, when: str):
        dead = [f"worker rank {r} (stage {r // self.tp}, tensor rank {r % self.tp}, pid {p.pid}) exited "
                f"{exit_text(p.exitcode)}{self._error_of(r)}" for r, p in enumerate(self._procs) if p.exitcode is not None]
        dead += [f"worker rank 0 (thread) ended" for th in self._thread if not th.is_alive()]
        if dead:
            self._fail("; ".join(dead) + (f" {when}" if when else ""))

    def _fail_naming_the_dead(self, reason: str, within: float = 5.0):
        """A channel that broke most often means its worker died: wait (at most ``within`` s, less as
        soon as one is reaped) for its exit status, so the failure names its exit code or signal
        rather than the broken pipe it caused. Not on the sentinel alone: a worker's sentinel closes
        before its CUDA context is torn down, and it is reaped only after (seen on an H100 and an H200:
        the pipe broke, the sentinel was ready, the exit status was not)."""
        end = time.monotonic() + within
        while self._procs and all(p.exitcode is None for p in self._procs) and time.monotonic() < end:
            time.sleep(POLL_S / 10)
        self._check_alive("")
        self._fail(reason)

    def _error_of(self, rank: int) -> str:
        """The last line of the error a worker left in the store before exiting (start-up errors come
        before its report channel exists), or ''."""
        store = self._store_box[1] if self._store_box else None
        if store is None or not store.check([f"error/{rank}"]):
            return ""
        return ": " + store.get(f"error/{rank}").decode().strip().splitlines()[-1]

    def _check_usable(self):
        if self.broken:
            raise RuntimeError(self.broken)
        if not self._finalizer.alive:
            raise RuntimeError("this worker pool is closed")

    def _fail(self, reason: str):
        self._break(reason)
        raise RuntimeError(self.broken)

    def _break(self, reason: str):
        self.broken = f"{reason}; the other workers were stopped"
        self._detach_all()
        self._grace["s"] = 0                       # the others may be stuck waiting for the dead one
        self._finalizer()

    def close(self):
        """Stop every worker: Stop travels down the control plane; stragglers are terminated."""
        self._detach_all()
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _teardown(procs, threads, control, reports, cleanup, grace):
    """Let the workers stop (Stop down the control plane, up to ``grace["s"]``), make sure none
    outlives the pool, close every channel, free ports and files."""
    if grace["s"]:
        with contextlib.suppress(OSError):
            for conn in control:
                conn.send(Stop())
        end = time.monotonic() + grace["s"]
        for member in [p for p in procs if p.pid is not None] + list(threads):
            member.join(max(0.0, end - time.monotonic()))
    for conn in list(control) + list(reports):
        conn.close()
    started = [p for p in procs if p.pid is not None]      # (one interrupted in its start never ran)
    for p in started:
        if p.is_alive():
            p.terminate()
    for p in started:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
        p.close()                                          # its sentinel pipe, now, not at collection
    procs.clear()                                          # (a closed process has no exit code to read)
    for f in cleanup:
        f()


def _loopback_store() -> dist.TCPStore:
    """The pool's rendezvous store, listening on 127.0.0.1 only: TCPStore's own server binds every
    interface, where anyone on the network could write keys into this process. It takes the socket."""
    sock = socket.create_server(("127.0.0.1", 0))
    return dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, wait_for_workers=False,
                         timeout=STORE_TIMEOUT, master_listen_fd=sock.detach())


def _worker_fields(ec) -> tuple:
    """The settings the workers depend on (max_bs is the scheduler's alone)."""
    return (ec.n_slots, ec.dtype, ec.device, ec.tensor_parallel, ec.pipeline_parallel,
            ec.attention_backend, ec.fused_ops_backend)


def _start_thread(spec, store) -> threading.Thread:
    """Rank 0's worker under torchrun: a thread of the master's process."""
    th = threading.Thread(target=lambda: Worker(spec, store).serve(), name="orca-worker-0", daemon=True)
    th.start()
    return th

