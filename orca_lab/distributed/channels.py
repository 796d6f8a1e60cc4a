"""The control plane's sockets: one TCP connection per hop, and the inbox that accepts them.

A channel is a TCP connection (loopback on one machine; any address across nodes), framed by
``multiprocessing.connection``; every frame on it is signed (``wire.py``). The secret itself never
crosses a channel: a connection opens with a signed ``Hello`` naming its rank.
"""
from __future__ import annotations

import selectors
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

from orca_lab.distributed.messages import Hello
from orca_lab.distributed.wire import ControlError, decode, encode

MAX_HELLO_BYTES = 4096


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

