"""The control plane's sockets: one TCP connection per hop, and the inbox that accepts them.

A channel is a TCP connection (loopback on one machine; any address across nodes), framed by
``multiprocessing.connection``; every frame on it is signed and sealed to its place (``wire.py``).
The secret itself never crosses a channel. A connection opens with three frames, each side drawing a
fresh nonce: the caller's ``Hello`` (its rank, its nonce), the listener's ``Challenge`` (its nonce,
its proof over both), the caller's ``Proof``. Both then hold the connection's own key; a recorded
opening or frame played on a new connection, or again on this one, is refused.
"""
from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

from orca_lab.distributed.messages import Challenge, Hello, Proof
from orca_lab.distributed.wire import (CONNECTOR, DOWN, LISTENER, UP, ControlError, Seal, decode, encode, nonce, proof,
                                       proves, session_key)

MAX_HELLO_BYTES = 4096          # no frame of an opening is longer
log = logging.getLogger("orca_lab.control")


def _no_delay(sock: socket.socket) -> socket.socket:
    # Small request/response messages: without this, Nagle + delayed ACKs add ~40 ms per iteration.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(True)
    return sock


class Channel:
    """One end of a control connection: ``send``/``recv`` sign and check every message; ``send_raw``
    and ``recv_raw`` pass signed frames on unchanged (the relay forwards without re-encoding). Either
    way each frame is sealed to its place on this connection, and the first that is not the next one
    is refused: the connection is dropped, with the reason logged."""
    # How long a caller waits for the listener's challenge: a worker reads its inbox only once its
    # process group is up and its stage built (weights read, K/V allocated), minutes for a large model.
    OPEN_S = 300.0

    def __init__(self, conn: Connection, secret: bytes, peer: str):
        self.conn, self.secret, self.peer = conn, secret, peer
        self._out: Seal | None = None
        self._in: Seal | None = None
        self._opened = threading.Event()
        self._failure: str | None = None
        self._sending = threading.Lock()         # a frame's number is its place on the wire
        self._closing = threading.Lock()         # the opening's thread closes on failure, maybe as the owner does

    def _open(self, key: bytes, outgoing: bytes, incoming: bytes):
        self._out, self._in = Seal(key, outgoing), Seal(key, incoming)
        self._opened.set()

    def _answer(self, hello: Hello):
        """The caller's side of the opening, in the background (``connect``): check the listener's
        challenge, send this side's proof, derive the key."""
        try:
            if not self.conn.poll(self.OPEN_S):
                raise ConnectionError(f"no challenge within {self.OPEN_S:g} s")
            challenge = decode(self.conn.recv_bytes(MAX_HELLO_BYTES), self.secret)
            if not isinstance(challenge, Challenge) or not proves(challenge.proof, self.secret, LISTENER, hello,
                                                                  challenge.nonce):
                raise ControlError("it did not prove that it holds the pool's secret")
            self.conn.send_bytes(encode(Proof(proof(self.secret, CONNECTOR, hello, challenge.nonce)), self.secret))
            self._open(session_key(self.secret, hello, challenge.nonce), UP, DOWN)
        except (ControlError, EOFError, OSError) as e:
            why = str(e) or "it closed the connection"             # an EOFError says nothing
            self._failure = f"the control inbox at {self.peer} did not open the connection: {why}"
            log.warning("%s; dropped it", self._failure)
            self.close()
            self._opened.set()

    def _wait_open(self):
        if not self._opened.wait(self.OPEN_S):
            raise ConnectionError(f"the control inbox at {self.peer} did not answer the hello within {self.OPEN_S:g} s")
        if self._failure:
            raise ConnectionError(self._failure)

    def _refuse(self, e: ControlError):
        log.warning("dropped the control connection with %s: %s", self.peer, e)
        self.close()
        raise e

    def send(self, msg):
        self.send_raw(encode(msg, self.secret))

    def send_raw(self, raw: bytes):
        self._wait_open()
        with self._sending:
            self.conn.send_bytes(self._out.wrap(raw))

    def recv_raw(self) -> bytes:
        """The next frame, once its seal proves it is this connection's next one; its own signature
        is still to be checked (``wire.decode``)."""
        self._wait_open()
        try:
            return self._in.unwrap(self.conn.recv_bytes())
        except ControlError as e:
            self._refuse(e)

    def recv(self):
        raw = self.recv_raw()
        try:
            return decode(raw, self.secret)
        except ControlError as e:
            self._refuse(e)

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:            # so that multiprocessing.connection.wait can select on it
        return self.conn.fileno()

    def close(self):
        with self._closing:             # Connection.close is not safe to race: both would close the fd
            self.conn.close()


class Inbox:
    """A listening socket on ``host``; the OS picks a free port (no fixed port to collide or leak).

    A peer's first frame is a signed ``Hello``, answered by a ``Challenge``; its second, the ``Proof``
    over both nonces. Connections are greeted side by side (a selector), not one after another: a
    stranger that says nothing, or half a frame, holds no one up and is dropped after ``HELLO_S``; one
    that says anything else, or plays a recorded hello (it has no proof for the new nonce), is dropped
    at once, with the reason logged. Only the bytes of the opening are read, so what a peer sends
    right after it stays for its channel."""
    HELLO_S = 10.0              # how long a connection may take to open
    MAX_PENDING = 64            # connections greeted at once; the oldest goes first beyond that

    def __init__(self, host: str, secret: bytes):
        self.sock = socket.create_server((host, 0))
        self.sock.setblocking(False)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.secret = secret
        self.clock = time.monotonic
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.sock, selectors.EVENT_READ)
        self._greeting: dict[socket.socket, _Greeting] = {}      # connected, opening not complete
        self._ready: deque[tuple[Channel, int]] = deque()         # opened, not handed out yet

    def accept(self, timeout: float) -> tuple[Channel, int] | None:
        """The next peer that opened its connection with the secret, and the rank it announced, or
        None once ``timeout`` s have passed, whatever strangers do meanwhile."""
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
                    self._read_frame(key.fileobj)
        return self._ready.popleft()

    def _connected(self):
        try:
            sock, peer = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        if len(self._greeting) >= self.MAX_PENDING:
            self._drop(min(self._greeting, key=lambda s: self._greeting[s].since),
                       f"more than {self.MAX_PENDING} connections were opening at once")
        self._greeting[sock] = _Greeting(self.clock(), encode_address(peer))
        self._selector.register(sock, selectors.EVENT_READ)

    def _read_frame(self, sock: socket.socket):
        """Read what has come of ``sock``'s next opening frame (never past its end); once whole, take it."""
        g = self._greeting[sock]
        try:
            chunk = sock.recv(g.wanted())
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            return self._drop(sock, "it closed before opening")
        g.buf += chunk
        if len(g.buf) == 4 and not 0 < g.size() <= MAX_HELLO_BYTES:
            return self._drop(sock, f"it announced a frame of {g.size()} bytes; an opening frame has 1 to "
                                    f"{MAX_HELLO_BYTES}")
        if g.wanted():
            return
        frame, g.buf = g.buf[4:], b""
        try:
            msg = decode(frame, self.secret)
        except ControlError as e:
            return self._drop(sock, str(e))
        if g.hello is None:
            self._challenge(sock, g, msg)
        else:
            self._check_proof(sock, g, msg)

    def _challenge(self, sock: socket.socket, g: "_Greeting", hello):
        if not isinstance(hello, Hello):
            return self._drop(sock, f"its first frame is a {type(hello).__name__}, not a Hello")
        g.hello, g.nonce = hello, nonce()
        frame = encode(Challenge(g.nonce, proof(self.secret, LISTENER, hello, g.nonce)), self.secret)
        try:                    # a few hundred bytes on a fresh connection: its send buffer takes them at once
            sock.sendall(struct.pack("!i", len(frame)) + frame)
        except OSError as e:
            self._drop(sock, f"the challenge could not be sent ({e})")

    def _check_proof(self, sock: socket.socket, g: "_Greeting", msg):
        if not isinstance(msg, Proof) or not proves(msg.proof, self.secret, CONNECTOR, g.hello, g.nonce):
            return self._drop(sock, f"its hello (rank {g.hello.rank}) was not followed by a proof over this "
                                    "connection's nonces (a recorded opening played again?)")
        self._forget(sock)
        channel = Channel(Connection(_no_delay(sock).detach()), self.secret, g.peer)
        channel._open(session_key(self.secret, g.hello, g.nonce), DOWN, UP)
        self._ready.append((channel, g.hello.rank))

    def _drop_silent(self, now: float):
        for sock in [s for s, g in self._greeting.items() if now - g.since > self.HELLO_S]:
            self._drop(sock, f"it did not open within {self.HELLO_S:g} s")

    def _forget(self, sock: socket.socket):
        self._selector.unregister(sock)
        del self._greeting[sock]

    def _drop(self, sock: socket.socket, reason: str | None = None):
        if reason is not None:
            log.warning("control inbox %s dropped a connection from %s: %s", encode_address(self.address),
                        self._greeting[sock].peer, reason)
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
    """A connection's opening as it arrives: each frame ``multiprocessing.connection``'s, a 4-byte
    length then the signed bytes; the hello and this side's nonce once the hello is in."""
    since: float
    peer: str
    buf: bytes = b""
    hello: Hello | None = None
    nonce: str = ""

    def size(self) -> int:
        return struct.unpack("!i", self.buf[:4])[0]

    def wanted(self) -> int:
        """Bytes still missing from the frame (its length first)."""
        return 4 - len(self.buf) if len(self.buf) < 4 else 4 + self.size() - len(self.buf)


def connect(address, secret: bytes, rank: int, timeout: float = 30.0) -> Channel:
    """A channel to the Inbox at ``address``, announcing ``rank`` (-1 = the engine master). It returns
    once connected and the hello is sent: peers connect to each other in any order, and the listener
    may itself still be starting or connecting elsewhere before it reads its inbox, so the rest of
    the opening runs in the background; the channel's first send or receive waits for it."""
    sock = socket.create_connection(tuple(address), timeout=timeout)
    channel = Channel(Connection(_no_delay(sock).detach()), secret, encode_address(address))
    hello = Hello(rank, nonce())
    channel.conn.send_bytes(encode(hello, secret))
    threading.Thread(target=channel._answer, args=(hello,), name=f"control-open-{channel.peer}", daemon=True).start()
    return channel


def encode_address(address) -> str:
    return f"{address[0]}:{address[1]}"


def decode_address(text: bytes | str) -> tuple[str, int]:
    host, port = (text.decode() if isinstance(text, bytes) else text).rsplit(":", 1)
    return host, int(port)

