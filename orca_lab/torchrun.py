"""The engine across nodes with torchrun (env:// rendezvous): every rank is a worker, rank 0 is also the
engine master (ORCA §4.1's engine master plus worker 1, in one process: the worker runs in a thread).

Two nodes, a pipeline stage per node, tensor parallel inside each node (ORCA's 175B setup, scaled)::

    ORCA_LAB_SECRET_FILE=~/.orca_lab_secret \\
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank $NODE --master-addr $HOST0 --master-port 29500 \\
        -m orca_lab.torchrun --model tiny --tp 2 --pp 2 --n-requests 32 --out results/torchrun

One machine, no GPU (gloo)::

    ORCA_LAB_SECRET=$(python -c "import secrets; print(secrets.token_hex(32))") \\
    OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node 4 \\
        -m orca_lab.torchrun --tp 2 --pp 2 --device cpu

Every rank needs the control plane's secret from the operator, the same on every node: in
``ORCA_LAB_SECRET`` (at least 32 characters), or in a file named by ``ORCA_LAB_SECRET_FILE`` (readable
by the operator only, e.g. ``python -c "import secrets; print(secrets.token_hex(32))" > ~/.orca_lab_secret;
chmod 600 ~/.orca_lab_secret``; a file its group or others may open is refused, as ssh refuses such a
private key). It signs every control message, and never travels through the
rendezvous store, which anyone who reaches ``--master-port`` can read. A rank without one refuses to
start.

Ranks are stage-major (rank = stage * tp + tensor rank), so with ``--nproc-per-node tp`` each node is
one stage. Control channels listen on ``ORCA_LAB_CONTROL_HOST`` if set, else on the local address that
routes to ``MASTER_ADDR``; set ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` for the data plane as
usual. Every rank builds the same weights (``--model`` and ``--seed``, or ``--checkpoint``).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import stat
from pathlib import Path

import torch
import torch.distributed as dist

from orca_lab.config import EngineConfig, check_degrees, model_config
from orca_lab.distributed.heartbeat import start_heartbeat, watch_master
from orca_lab.distributed.pool import WorkerPool
from orca_lab.distributed.worker import STORE_TIMEOUT, Worker, WorkerSpec
from orca_lab.engine.policies import REGISTRY, system
from orca_lab.llm import LLM
from orca_lab.model.families import checkpoint_config


def control_host() -> str:
    """The address peers reach this node's control inboxes at."""
    if os.environ.get("ORCA_LAB_CONTROL_HOST"):
        return os.environ["ORCA_LAB_CONTROL_HOST"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:   # connecting UDP sends no packet
        s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), 1))
        return s.getsockname()[0]


SECRET_ENV, SECRET_FILE_ENV = "ORCA_LAB_SECRET", "ORCA_LAB_SECRET_FILE"
MIN_SECRET_CHARS = 32


def operator_secret(environ) -> bytes:
    """The control plane's secret, as the operator gave it to every rank; ValueError naming the
    variables when it is missing, ambiguous or too short to resist guessing, or its file when others
    than its owner may open it."""
    text, path = environ.get(SECRET_ENV), environ.get(SECRET_FILE_ENV)
    if text and path:
        raise ValueError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set: set one")
    if path:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
            if mode & 0o077:       # as ssh refuses a private key others can open
                raise ValueError(f"{SECRET_FILE_ENV}={path} has mode {mode:04o}: its group or others can open it, "
                                 f"and the control secret must be the operator's alone: run chmod 600 {path}")
            text = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{SECRET_FILE_ENV}={path} cannot be read ({e})") from None
    if not text:
        raise ValueError(f"no control secret: set {SECRET_ENV} (or {SECRET_FILE_ENV}, a file holding it) to the "
                         "same secret on every rank")
    if len(text) < MIN_SECRET_CHARS:
        where = SECRET_ENV if not path else f"the file {SECRET_FILE_ENV}={path}"
        raise ValueError(f"{where} holds {len(text)} characters; a control secret has at least {MIN_SECRET_CHARS}")
    return text.encode()


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="torchrun ... -m orca_lab.torchrun", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--checkpoint", default=None, help="a local GPT-2, Llama or Qwen2 directory (Hugging Face layout: "
                                                      "config.json, safetensors; else --model's random weights)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (the paper's n_workers)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-bs", type=int, default=8)
    p.add_argument("--mbs", type=int, default=None, help="micro-batch size of the request-level systems (ft)")
    p.add_argument("--n-slots", type=int, default=None,
                   help="K/V slots (default: 16384 on CPU, what fits in GPU memory on CUDA)")
    p.add_argument("--systems", default="orca,ft", help=f"comma-separated, of {', '.join(REGISTRY)}")
    p.add_argument("--n-requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals (req/s); default: all at 0")
    p.add_argument("--scale", type=float, default=0.1, help="multiplies the paper's lengths")
    p.add_argument("--master-timeout", type=float, default=30.0,
                   help="seconds without the master's heartbeat before a rank gives up")
    p.add_argument("--out", default=None, help="directory for torchrun.json (runs + environment)")
    return p, p.parse_args(argv)


def main(argv=None):
    p, args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != args.tp * args.pp:
        p.error(f"WORLD_SIZE={world} must equal --tp x --pp = {args.tp * args.pp}")
    try:
        secret = operator_secret(os.environ)
    except ValueError as e:
        p.error(str(e))
    try:        # refused here, before the rendezvous, as the secret is: every rank says the same
        ec = EngineConfig(max_bs=args.max_bs, n_slots=args.n_slots, device=args.device, executor="workers",
                          tensor_parallel=args.tp, pipeline_parallel=args.pp)
        cfg = checkpoint_config(args.checkpoint) if args.checkpoint else model_config(args.model)
        check_degrees(cfg, ec)
        for name in args.systems.split(","):
            system(name)
    except (ValueError, OSError) as e:
        p.error(str(e))
    store, _, _ = next(dist.rendezvous("env://", timeout=STORE_TIMEOUT))
    store = dist.PrefixStore("orca_lab", store)
    if rank == 0:       # from here on, a master that dies or hangs ends every rank within --master-timeout
        start_heartbeat(store.clone())
    else:
        watch_master(store.clone(), args.master_timeout, rank)
    spec = WorkerSpec(cfg, ec, rank, secret, weights=args.checkpoint, seed=args.seed, host=control_host(),
                      local_rank=int(os.environ.get("LOCAL_RANK", 0)), master_timeout=args.master_timeout)
    if rank != 0:
        Worker(spec, store).serve()
        return
    # the master holds shapes only (executor="workers"): every rank reads its own shard
    llm = LLM(cfg, args.seed, engine=ec, checkpoint=args.checkpoint)
    with WorkerPool.rank0(llm, store, spec):
        serve_and_report(llm, args)


def serve_and_report(llm, args):
    from orca_lab.environment import environment
    from orca_lab.metrics import compare_table
    from orca_lab.workload import paper_trace

    trace = paper_trace(args.n_requests, rate=args.rate, seed=args.seed, scale=args.scale,
                        vocab_size=llm.cfg.vocab_size)
    results = [llm.serve(trace, system=s, mbs=args.mbs if system(s).request_level else None)
               for s in args.systems.split(",")]
    print(compare_table(results).to_string(float_format=lambda v: f"{v:,.3f}"))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"args": vars(args), "environment": environment(), "runs": [r.to_json() for r in results]}
        (out / "torchrun.json").write_text(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
