"""The control plane (ORCA §4.3): small messages on CPU sockets, kept apart from the tensor data plane.

The engine master sends each iteration's ``ControlMessage`` (request ids, positions, lengths, new
token ids, K/V slots of requests new to the workers) to the first stage's workers. Every worker
forwards it to its successor the moment it arrives, before and independently of its own tensor work;
the last stage sends the tokens back in a ``StageReport``. Only Python scalars and lists travel here:
tensors go over torch.distributed (``data_plane.py``), so control never synchronizes a device.

A channel is a TCP connection (loopback on one machine; any address across nodes) framed and pickled
by ``multiprocessing.connection``; the first frame of every connection is a shared secret, so a
stranger on the same host cannot inject messages.
"""
from __future__ import annotations

import hmac
import socket
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from orca_lab.engine.batch import Batch
from orca_lab.engine.request import SamplingParams


@dataclass(frozen=True)
class ControlMessage:
    """One iteration, as the workers need it: what ``BatchTensors.build`` reads, nothing more."""
    iteration: int
    rids: tuple[int, ...]
    starts: tuple[int, ...]          # tokens already cached per request (positions start here)
    q_lens: tuple[int, ...]          # new tokens per request
    tokens: tuple[tuple[int, ...], ...]
    phases: tuple[str, ...]
    padded: bool
    # The worker side of the K/V manager: slots and sampling of requests the workers have not seen
    # yet, and the requests the scheduler finished (their slots may be handed to new requests).
    reserve: dict[int, tuple[tuple[int, ...], SamplingParams]] = field(default_factory=dict)
    release: tuple[int, ...] = ()

    @classmethod
    def of(cls, batch: Batch, iteration: int, reserve, release) -> "ControlMessage":
        return cls(iteration, tuple(r.rid for r in batch.requests), tuple(batch.starts),
                   tuple(batch.q_lens), tuple(tuple(t) for t in batch.tokens), tuple(batch.phases),
                   batch.padded, reserve, tuple(release))

    def batch(self, requests: dict) -> Batch:
        """The worker's Batch over its own request records (``requests[rid].slots``)."""
        return Batch([requests[rid] for rid in self.rids], list(self.starts), list(self.q_lens),
                     self.padded, self.iteration, [list(t) for t in self.tokens], list(self.phases))


@dataclass(frozen=True)
class Reset:
    """A new engine takes the workers over: forget every request of the previous one."""


@dataclass(frozen=True)
class Stop:
    """Shut down: each worker forwards it, finishes its data-plane sends and exits."""


@dataclass(frozen=True)
class StageReport:
    """A stage finished an iteration: its times (wall clock, seconds) and, from the last stage, the
    tokens. Earlier stages report only their times, for the pipeline trace."""
    iteration: int
    stage: int
    start: float
    end: float
    tokens: list[int] | None = None


@dataclass(frozen=True)
class WorkerError:
    rank: int
    text: str


# -- channels ------------------------------------------------------------------------------------
def _no_delay(sock: socket.socket) -> socket.socket:
    # Small request/response messages: without this, Nagle + delayed ACKs add ~40 ms per iteration.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(True)
    return sock


class Inbox:
    """A listening socket on ``host``; the OS picks a free port (no fixed port to collide or leak)."""

    def __init__(self, host: str, secret: bytes):
        self.sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.secret = secret

    def accept(self, timeout: float) -> tuple[Connection, int] | None:
        """The next authenticated peer and the rank it announced, or None after ``timeout`` s."""
        self.sock.settimeout(timeout)
        try:
            sock, _ = self.sock.accept()
        except (socket.timeout, BlockingIOError):
            return None
        conn = Connection(_no_delay(sock).detach())
        try:
            if conn.poll(10) and hmac.compare_digest(conn.recv_bytes(64), self.secret) and conn.poll(10):
                return conn, int(conn.recv_bytes(32))
        except (OSError, EOFError, ValueError):
            pass
        conn.close()                      # not one of ours: drop it and keep listening
        return self.accept(timeout)

    def close(self):
        self.sock.close()


def connect(address, secret: bytes, rank: int, timeout: float = 30.0) -> Connection:
    """A channel to the Inbox at ``address``, announcing ``rank`` (-1 = the engine master)."""
    sock = socket.create_connection(tuple(address), timeout=timeout)
    conn = Connection(_no_delay(sock).detach())
    conn.send_bytes(secret)
    conn.send_bytes(str(rank).encode())
    return conn


def encode_address(address) -> str:
    return f"{address[0]}:{address[1]}"


def decode_address(text: bytes | str) -> tuple[str, int]:
    host, port = (text.decode() if isinstance(text, bytes) else text).rsplit(":", 1)
    return host, int(port)
