"""The control plane refuses what a signature alone lets through: a frame recorded on a live
connection and played again (on it, or on a new connection), frames swapped in flight, and a stranger
replaying a recorded opening (torchrun's operator secret: ``test_control.py``)."""
import logging
import socket
import threading

import pytest

from orca_lab import LLM, EngineConfig
from orca_lab.distributed.channels import Inbox, connect
from orca_lab.distributed.messages import ControlMessage, Reset, StageReport, Stop
from orca_lab.distributed.pool import WorkerPool
from orca_lab.distributed.wire import ControlError

SECRET = bytes(range(32))


class Tap:
    """A TCP relay between a caller and an inbox that records every byte each way: what an attacker
    on the path (or one who rewrote an address in the open rendezvous store) sees."""

    def __init__(self, target):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = self.server.getsockname()[:2]
        self.sent, self.answered = bytearray(), bytearray()     # the caller's stream, the inbox's
        self.upstream = None
        threading.Thread(target=self._run, args=(target,), daemon=True).start()

    def _run(self, target):
        caller, _ = self.server.accept()
        self.upstream = socket.create_connection(target)
        threading.Thread(target=self._pump, args=(self.upstream, caller, self.answered), daemon=True).start()
        self._pump(caller, self.upstream, self.sent)

    @staticmethod
    def _pump(src, dst, record):
        try:
            while chunk := src.recv(65536):
                record += chunk
                dst.sendall(chunk)
        except OSError:
            pass

    @staticmethod
    def frames(stream) -> list[bytes]:
        """The frames of a recorded stream, each with its 4-byte length: ready to be played again."""
        out, buf = [], bytes(stream)
        while buf:
            n = 4 + int.from_bytes(buf[:4], "big")
            out.append(buf[:n])
            buf = buf[n:]
        return out

    def close(self):
        for s in (self.server, self.upstream):
            if s is not None:
                s.close()


def _challenged_then_closed(sock) -> bool:
    """One frame came (the opening's first answer), then the other side closed (with unread bytes
    left, as a reset)."""
    sock.settimeout(10)
    frame = sock.recv(4096)
    try:
        return bool(frame) and sock.recv(4096) == b""
    except ConnectionResetError:
        return bool(frame)


@pytest.fixture
def opened():
    """An inbox, a caller connected to it through a Tap, and the inbox's end of the channel, with
    one Reset already through (frame 0 of the caller's direction)."""
    inbox = Inbox("127.0.0.1", SECRET)
    tap = Tap(inbox.address)
    caller = connect(tap.address, SECRET, 2)
    got = inbox.accept(30)
    assert got is not None and got[1] == 2
    caller.send(Reset())
    assert got[0].recv() == Reset()
    yield inbox, tap, caller, got[0]
    for c in (caller, got[0], tap, inbox):
        c.close()


def test_a_recorded_frame_played_again_on_its_connection_is_refused(opened, caplog):
    inbox, tap, caller, channel = opened
    hello, proof, reset = tap.frames(tap.sent)
    tap.upstream.sendall(reset)                  # the same signed, sealed bytes, once more
    with caplog.at_level(logging.WARNING, "orca_lab.control"), \
            pytest.raises(ControlError, match=r"refused control frame 0 where frame 1 was due .*\(replayed\)"):
        channel.recv()
    assert "dropped the control connection" in caplog.text
    with pytest.raises(OSError):                 # dropped: nothing more is read from it
        channel.recv()


def test_a_recorded_opening_played_on_a_new_connection_is_dropped(opened, caplog):
    """The whole recorded stream (hello, proof, a Reset) on a fresh connection: the inbox answers a
    fresh challenge, the recorded proof is for the old one. The legitimate peer keeps its channel and
    a new legitimate peer still gets in."""
    inbox, tap, caller, channel = opened
    stranger = socket.create_connection(inbox.address)
    stranger.sendall(b"".join(tap.frames(tap.sent)))
    with caplog.at_level(logging.WARNING, "orca_lab.control"):
        assert inbox.accept(2) is None
    assert "a recorded opening played again" in caplog.text
    assert _challenged_then_closed(stranger)
    stranger.close()
    caller.send(Stop())
    assert channel.recv() == Stop()
    late = connect(inbox.address, SECRET, 5)
    got = inbox.accept(30)
    assert got is not None and got[1] == 5
    late.send(Reset())
    assert got[0].recv() == Reset()
    late.close()
    got[0].close()


def test_frames_swapped_in_flight_are_refused(opened):
    inbox, tap, caller, channel = opened
    held, real_send = [], caller.conn.send_bytes
    caller.conn.send_bytes = held.append         # hold the next two frames, as a relay on the path could
    caller.send(StageReport(1, 0, 0.0, 1.0))
    caller.send(StageReport(2, 0, 1.0, 2.0))
    for frame in reversed(held):
        real_send(frame)
    with pytest.raises(ControlError, match=r"refused control frame 2 where frame 1 was due .*\(reordered"):
        channel.recv()


def test_a_frame_reflected_back_to_its_sender_is_refused(opened):
    """The listener's direction has its own key label and counter: a frame it sent cannot be
    reflected back to it as the caller's."""
    inbox, tap, caller, channel = opened
    sent = []
    real = channel.conn.send_bytes
    channel.conn.send_bytes = lambda b: (sent.append(b), real(b))
    channel.send(Reset())
    assert caller.recv() == Reset()
    tap.upstream.sendall(len(sent[0]).to_bytes(4, "big") + sent[0])    # reflected towards the listener
    with pytest.raises(ControlError, match="does not match this connection's key"):
        channel.recv()


@pytest.mark.parametrize("key", [None, b"another pool's secret, 32 bytes!"], ids=["no-secret", "wrong-secret"])
def test_a_stranger_is_dropped_and_the_peer_served(key, caplog):
    """A stranger on the right port, without the secret (raw bytes) or with a wrong one, connects
    before the real peer: it is dropped with the reason logged, and the peer's channel works."""
    inbox = Inbox("127.0.0.1", SECRET)
    try:
        if key is None:
            stranger = socket.create_connection(inbox.address)
            stranger.sendall((40).to_bytes(4, "big") + b"x" * 40)
        else:
            stranger = connect(inbox.address, key, -1)
        peer = connect(inbox.address, SECRET, -1)
        with caplog.at_level(logging.WARNING, "orca_lab.control"):
            got = inbox.accept(30)
        assert got is not None and got[1] == -1
        assert "dropped a connection" in caplog.text and "HMAC does not match" in caplog.text
        peer.send(Reset())
        assert got[0].recv() == Reset()
        if key is not None:                      # the stranger learns nothing it could use: no challenge
            with pytest.raises(ConnectionError, match="did not open the connection"):
                stranger.send(Reset())
        for c in (stranger, peer, got[0]):
            c.close()
    finally:
        inbox.close()


def test_a_caller_refuses_an_inbox_that_plays_a_recorded_challenge(opened):
    """The proof goes both ways: an impostor listening where the caller was sent (an address rewritten
    in the store) answers with a challenge recorded from a real inbox; the caller sends it nothing."""
    challenge = Tap.frames(opened[1].answered)[0]
    impostor = socket.create_server(("127.0.0.1", 0))
    caller = connect(impostor.getsockname()[:2], SECRET, 1)
    conn, _ = impostor.accept()
    conn.sendall(challenge)
    with pytest.raises(ConnectionError, match=r"did not open the connection: it did not prove that it holds"):
        caller.send(Reset())
    assert _challenged_then_closed(conn)         # the hello, then closed: no proof, no frame
    for s in (caller, conn, impostor):
        s.close()


def test_a_worker_refuses_a_frame_of_its_connection_played_again(tiny_llm):
    """A real frame the master sent to a live worker process, captured and played again on the
    same connection: the worker stops, and the master reports why."""
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=2, n_slots=256, executor="workers"))
    with WorkerPool(llm, attach=False) as pool:
        conn = pool._control[0].conn
        captured, real_send = [], conn.send_bytes
        conn.send_bytes = lambda b: (captured.append(b), real_send(b))
        pool.send(Reset())
        real_send(captured[0])
        with pytest.raises(RuntimeError, match=r"(?s)worker rank 0 failed:.*ControlError: refused control frame "
                                               r"\d+ where frame \d+ was due .*\(replayed\)"):
            pool.collect(1, timeout=60)


def test_a_worker_refuses_an_iteration_it_has_run(tiny_llm):
    """An iteration's message sent again, sealed anew (so the frame's sequence number is right): the
    worker refuses an iteration number that does not increase, rather than sample its requests twice."""
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=2, n_slots=256, executor="workers"))
    with WorkerPool(llm) as pool:
        sent, real_send = [], pool.send
        pool.send = lambda msg: (sent.append(msg), real_send(msg))
        assert llm.generate([[1, 2, 3]], max_gen_tokens=3) == LLM(gpt=tiny_llm.model).generate([[1, 2, 3]], 3)
        first = next(m for m in sent if isinstance(m, ControlMessage))
        real_send(first)
        with pytest.raises(RuntimeError, match=rf"(?s)worker rank 0 failed:.*refused iteration {first.iteration} "
                                               rf"after iteration {pool._iteration} \(iterations must increase\)"):
            pool.collect(first.iteration, timeout=60)
