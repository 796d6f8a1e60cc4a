"""The control plane (ORCA §4.3): small messages on CPU sockets, kept apart from the tensor data plane.

The engine master sends each iteration's ``ControlMessage`` (request ids, positions, lengths, new
token ids, K/V slots of requests new to the workers) to the first stage's workers. Every worker
forwards it to its successor the moment it arrives, before and independently of its own tensor work;
the last stage sends the tokens back in a ``StageReport``. Only Python scalars and lists travel here:
tensors go over torch.distributed (``data_plane.py``), so control never synchronizes a device.

A channel is a TCP connection (loopback on one machine; any address across nodes), framed by
``multiprocessing.connection``. Nothing on it is ever unpickled: a message travels as JSON of plain
types (``encode``/``decode``), behind an HMAC-SHA256 of the pool's shared secret. A frame whose tag does
not match (tampered with, unsigned, or signed with another key) is refused before it is parsed, so a
stranger who can reach a port can neither run code nor inject an iteration. The secret itself never
crosses a channel: a connection opens with a signed ``Hello`` naming its rank.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import selectors
import socket
import struct
import sys
import threading
import time
from collections import deque
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
    yields: tuple[bool, ...]         # which requests the last stage samples (``Batch.yields``)
    padded: bool
    # The worker side of the K/V manager: slots and sampling of requests the workers have not seen
    # yet, and the requests the scheduler finished (their slots may be handed to new requests).
    reserve: dict[int, tuple[tuple[int, ...], SamplingParams]] = field(default_factory=dict)
    release: tuple[int, ...] = ()

    @classmethod
    def of(cls, batch: Batch, iteration: int, reserve, release) -> "ControlMessage":
        return cls(iteration, tuple(r.rid for r in batch.requests), tuple(batch.starts),
                   tuple(batch.q_lens), tuple(tuple(t) for t in batch.tokens), tuple(batch.phases),
                   tuple(batch.yields), batch.padded, reserve, tuple(release))

    def batch(self, requests: dict) -> Batch:
        """The worker's Batch over its own request records (``requests[rid].slots``)."""
        return Batch([requests[rid] for rid in self.rids], list(self.starts), list(self.q_lens),
                     self.padded, self.iteration, [list(t) for t in self.tokens], list(self.phases),
                     list(self.yields))


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


@dataclass(frozen=True)
class Hello:
    """The first frame of every connection: who is calling (-1 = the engine master)."""
    rank: int


# -- the wire format: signed JSON of plain types ---------------------------------------------------
MESSAGES = {cls.__name__: cls for cls in (ControlMessage, Reset, Stop, StageReport, WorkerError, Hello)}
TAG_BYTES = hashlib.sha256().digest_size


class ControlError(ValueError):
    """A frame that is not a valid message signed with this pool's secret."""


def encode(msg, secret: bytes) -> bytes:
    """``tag + JSON``: the tag is the HMAC-SHA256 of the JSON under the pool's secret."""
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    if isinstance(msg, ControlMessage):       # int keys and a dataclass inside: as plain lists
        fields["reserve"] = [[rid, slots, dataclasses.asdict(params)]
                             for rid, (slots, params) in msg.reserve.items()]
    body = json.dumps([type(msg).__name__, fields], separators=(",", ":")).encode()
    return hmac.digest(secret, body, "sha256") + body


def decode(raw: bytes, secret: bytes):
    """The message in ``raw``, once its tag proves it was signed with ``secret``; else ControlError."""
    tag, body = raw[:TAG_BYTES], raw[TAG_BYTES:]
    if len(tag) < TAG_BYTES or not hmac.compare_digest(tag, hmac.digest(secret, body, "sha256")):
        raise ControlError(f"refused a control frame of {len(raw)} bytes: its HMAC does not match the "
                           "pool's secret (tampered with, unsigned or from another pool)")
    try:
        kind, fields = json.loads(body)
        cls = MESSAGES[kind]
        if cls is ControlMessage:
            fields["reserve"] = {rid: (tuple(slots), SamplingParams(**params))
                                 for rid, slots, params in fields["reserve"]}
        return cls(**fields)
    except (ValueError, KeyError, TypeError) as e:
        raise ControlError(f"refused a signed control frame that is not a valid message ({e!r})") from None


# -- channels ------------------------------------------------------------------------------------
def _no_delay(sock: socket.socket) -> socket.socket:
    # Small request/response messages: without this, Nagle + delayed ACKs add ~40 ms per iteration.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(True)
    return sock


class Channel:
    """One end of a control connection: ``send``/``recv`` sign and check every message; ``send_raw``
    and ``recv_raw`` pass signed frames on unchanged (the relay forwards without re-encoding)."""

    def __init__(self, conn: Connection, secret: bytes):
        self.conn, self.secret = conn, secret

    def send(self, msg):
        self.conn.send_bytes(encode(msg, self.secret))

    def send_raw(self, raw: bytes):
        self.conn.send_bytes(raw)

    def recv_raw(self) -> bytes:
        return self.conn.recv_bytes()

    def recv(self):
        return decode(self.recv_raw(), self.secret)

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:            # so that multiprocessing.connection.wait can select on it
        return self.conn.fileno()

    def close(self):
        self.conn.close()


class Inbox:
    """A listening socket on ``host``; the OS picks a free port (no fixed port to collide or leak).

    A peer's first frame is a signed ``Hello``. Connections are greeted side by side (a selector),
    not one after another: a stranger that says nothing, or half a frame, holds no one up and is
    dropped after ``HELLO_S``; one that says anything else is dropped at once. Only the bytes of the
    hello are read, so what a peer sends right after it stays for its channel."""
    HELLO_S = 10.0              # how long a connection may take to say hello
    MAX_PENDING = 64            # connections greeted at once; the oldest goes first beyond that

    def __init__(self, host: str, secret: bytes):
        self.sock = socket.create_server((host, 0))
        self.sock.setblocking(False)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.secret = secret
        self.clock = time.monotonic
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.sock, selectors.EVENT_READ)
        self._greeting: dict[socket.socket, _Greeting] = {}      # connected, hello not complete
        self._ready: deque[tuple[Channel, int]] = deque()         # greeted, not handed out yet

    def accept(self, timeout: float) -> tuple[Channel, int] | None:
        """The next peer whose first frame is a ``Hello`` signed with the secret, and the rank it
        announced, or None once ``timeout`` s have passed, whatever strangers do meanwhile."""
        deadline = self.clock() + timeout
        while not self._ready:
            self._drop_silent(self.clock())
            left = deadline - self.clock()
            if left <= 0:
                return None
            for key, _ in self._selector.select(min(left, self.HELLO_S)):
                if key.fileobj is self.sock:
                    self._connected()
                else:
                    self._read_hello(key.fileobj)
        return self._ready.popleft()

    def _connected(self):
        try:
            sock, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        if len(self._greeting) >= self.MAX_PENDING:
            self._drop(min(self._greeting, key=lambda s: self._greeting[s].since))
        self._greeting[sock] = _Greeting(self.clock())
        self._selector.register(sock, selectors.EVENT_READ)

    def _read_hello(self, sock: socket.socket):
        """Read what has come of ``sock``'s hello (never past its end); once whole, check it."""
        g = self._greeting[sock]
        try:
            chunk = sock.recv(g.wanted())
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:                               # closed before saying hello
            return self._drop(sock)
        g.buf += chunk
        if len(g.buf) == 4 and not 0 < g.size() <= MAX_HELLO_BYTES:
            return self._drop(sock)                  # no hello is that long: not one of ours
        if g.wanted():
            return
        try:
            hello = decode(g.buf[4:], self.secret)
        except ControlError:
            hello = None
        if not isinstance(hello, Hello):
            return self._drop(sock)
        self._forget(sock)
        self._ready.append((Channel(Connection(_no_delay(sock).detach()), self.secret), hello.rank))

    def _drop_silent(self, now: float):
        for sock in [s for s, g in self._greeting.items() if now - g.since > self.HELLO_S]:
            self._drop(sock)

    def _forget(self, sock: socket.socket):
        self._selector.unregister(sock)
        del self._greeting[sock]

    def _drop(self, sock: socket.socket):
        self._forget(sock)
        sock.close()

    def close(self):
        for sock in list(self._greeting):
            self._drop(sock)
        for channel, _ in self._ready:
            channel.close()
        self._ready.clear()
        self._selector.close()
        self.sock.close()


MAX_HELLO_BYTES = 4096


@dataclass
class _Greeting:
    """A connection's hello as it arrives: ``multiprocessing.connection``'s frame, a 4-byte length
    then the signed bytes."""
    since: float
    buf: bytes = b""

    def size(self) -> int:
        return struct.unpack("!i", self.buf[:4])[0]

    def wanted(self) -> int:
        """Bytes still missing from the frame (its length first)."""
        return 4 - len(self.buf) if len(self.buf) < 4 else 4 + self.size() - len(self.buf)


def connect(address, secret: bytes, rank: int, timeout: float = 30.0) -> Channel:
    """A channel to the Inbox at ``address``, announcing ``rank`` (-1 = the engine master)."""
    sock = socket.create_connection(tuple(address), timeout=timeout)
    channel = Channel(Connection(_no_delay(sock).detach()), secret)
    channel.send(Hello(rank))
    return channel


def encode_address(address) -> str:
    return f"{address[0]}:{address[1]}"


def decode_address(text: bytes | str) -> tuple[str, int]:
    host, port = (text.decode() if isinstance(text, bytes) else text).rsplit(":", 1)
    return host, int(port)


# -- liveness of the engine master ---------------------------------------------------------------
HEARTBEAT_S = 1.0           # how often the master bumps its heartbeat counter in the store


def start_heartbeat(store) -> threading.Event:
    """Bump ``heartbeat`` in the rendezvous store every HEARTBEAT_S until the returned event is set.
    ``store`` should be a client of its own (``store.clone()``): a blocking wait on a shared client
    would hold every other call on it."""
    stop = threading.Event()

    def beat():
        while not stop.wait(HEARTBEAT_S):
            try:
                store.add("heartbeat", 1)
            except Exception:       # the store is gone: nobody is listening any more
                return
    threading.Thread(target=beat, name="orca-master-heartbeat", daemon=True).start()
    return stop


def watch_master(store, timeout: float, rank: int, what: str = "the engine master (rank 0)"):
    """End this worker process with a clear error when the master's heartbeat stops for ``timeout``
    seconds (a master that died or hung: a store hosted elsewhere, such as torchrun's agent, outlives
    it), or when the store itself goes away. Without it a worker would wait for the master at start-up,
    or block in a receive, until torch.distributed's own timeouts (minutes)."""
    def gone(reason: str):
        print(f"worker rank {rank}: {reason}; giving up", file=sys.stderr, flush=True)
        os._exit(1)

    def watch():
        last, since = None, time.monotonic()
        while True:
            try:
                beat = store.add("heartbeat", 0)        # reads the counter, never waits
            except Exception as e:
                gone(f"the rendezvous store that {what} uses is unreachable ({type(e).__name__})")
            if beat != last:
                last, since = beat, time.monotonic()
            elif time.monotonic() - since > timeout:
                gone(f"{what} sent no heartbeat for {timeout:g} s (it died or hung)")
            time.sleep(min(HEARTBEAT_S, timeout / 4))
    threading.Thread(target=watch, name="orca-master-watch", daemon=True).start()
