"""The control plane never unpickles: messages are signed JSON, and frames that are tampered with,
unsigned or signed with another pool's key are refused before they are parsed."""
import pickle
import socket
import time

import pytest

from orca_lab import LLM, EngineConfig
from orca_lab.engine.control import (ControlError, ControlMessage, Hello, Inbox, Reset, StageReport, Stop,
                                     WorkerError, connect, decode, encode)
from orca_lab.engine.parallel import WorkerPool
from orca_lab.engine.request import SamplingParams

SECRET = bytes(range(32))
MESSAGES = [
    ControlMessage(7, (3, 9), (0, 12), (5, 1), ((1, 2, 3, 4, 5), (8,)), ("initiation", "increment"), False,
                   {3: ((0, 1, 2, 3, 4, 5, 6), SamplingParams(max_gen_tokens=3, temperature=0.5, top_k=4, seed=1))},
                   (2,)),
    Reset(), Stop(), StageReport(7, 1, 1.5, 2.25, [4, 5]), StageReport(7, 0, 1.0, 1.5), WorkerError(3, "Traceback"),
    Hello(-1),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    got = decode(encode(msg, SECRET), SECRET)
    assert type(got) is type(msg)
    if isinstance(msg, ControlMessage):        # tuples come back as lists: compare what workers read
        assert got.reserve == msg.reserve and got.iteration == msg.iteration
        assert [list(t) for t in got.tokens] == [list(t) for t in msg.tokens] and list(got.rids) == list(msg.rids)
    else:
        assert got == msg


class Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled!')",))


@pytest.mark.parametrize("frame", [
    lambda raw: raw[:40] + bytes([raw[40] ^ 1]) + raw[41:],                 # one bit of the body flipped
    lambda raw: bytes([raw[0] ^ 1]) + raw[1:],                              # the tag flipped
    lambda raw: raw[32:],                                                   # unsigned JSON
    lambda raw: bytes(32) + raw[32:],                                       # a zero tag
    lambda raw: encode(Stop(), b"another pool's secret, 32 bytes!"),        # another key
    lambda raw: pickle.dumps(Stop()),                                       # a pickle
    lambda raw: bytes(32) + pickle.dumps(Boom()),                           # a malicious pickle
    lambda raw: b"",
], ids=["body", "tag", "unsigned", "zero-tag", "other-key", "pickle", "evil-pickle", "empty"])
def test_tampered_or_unsigned_frames_are_refused(frame):
    raw = encode(MESSAGES[0], SECRET)
    with pytest.raises(ControlError, match="refused"):
        decode(frame(raw), SECRET)


def test_a_signed_frame_that_is_no_message_is_refused():
    import hmac
    for body in (b'["Boom", {}]', b'["Stop", {"x": 1}]', b'not json'):
        with pytest.raises(ControlError, match="not a valid message"):
            decode(hmac.digest(SECRET, body, "sha256") + body, SECRET)


def test_the_inbox_drops_strangers_and_accepts_a_signed_hello():
    inbox = Inbox("127.0.0.1", SECRET)
    try:
        stranger = socket.create_connection(inbox.address)       # a raw pickle, then nothing
        stranger.sendall(len(pickle.dumps(Hello(0))).to_bytes(4, "big") + pickle.dumps(Hello(0)))
        other = connect(inbox.address, b"x" * 32, 1)             # signed with another key
        ours = connect(inbox.address, SECRET, 2)
        got = inbox.accept(5)
        assert got is not None and got[1] == 2                   # the first two were dropped
        ours.send(Reset())
        assert got[0].recv() == Reset()
        for c in (stranger, other, ours, got[0]):
            c.close()
    finally:
        inbox.close()


def test_a_worker_refuses_a_tampered_control_frame(tiny_llm):
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=2, n_slots=256, executor="workers"))
    with WorkerPool(llm, attach=False) as pool:
        raw = encode(Reset(), pool._secret)
        pool._control[0].send_raw(raw.replace(b"Reset", b"Stop"))  # a valid Stop, but not what was signed
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"(?s)worker rank 0 failed:.*ControlError: refused a control frame"):
            pool.collect(1, timeout=30)
        assert time.monotonic() - t0 < 10
