"""The control plane's wire format: a message as signed JSON of plain types, sealed to its place on
one connection.

Nothing on a control channel is ever unpickled: a message travels as JSON of plain types
(``encode``/``decode``), behind an HMAC-SHA256 of the pool's shared secret. A frame whose tag does
not match (tampered with, unsigned, or signed with another key) is refused before it is parsed, so a
stranger who can reach a port can neither run code nor inject an iteration.

A signature alone would let a recorded frame be played again, later or on another connection. So
each connection opens with a challenge-response (``channels.py``) in which both ends draw a fresh
nonce, and from which both derive the connection's own key (``session_key``); every frame then
carries its sequence number in its direction and a ``Seal``, an HMAC of both and of the frame's
signature under that key. A frame replayed, reordered, or taken from another connection is refused.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import struct

from orca_lab.distributed.messages import MESSAGES, ControlMessage, Hello
from orca_lab.engine.sampling_params import SamplingParams

TAG_BYTES = hashlib.sha256().digest_size
NONCE_BYTES = 32
SEQ = struct.Struct("!Q")
# What each side proves, and which way a frame goes: distinct labels, so that no HMAC computed for
# one purpose is ever valid for another (a listener's proof is no connector's, nor a frame reflected).
LISTENER, CONNECTOR, KEY = b"orca-lab listener proof", b"orca-lab connector proof", b"orca-lab channel key"
UP, DOWN = b"connector to listener", b"listener to connector"


class ControlError(ValueError):
    """A frame that is not a valid message signed with this pool's secret, or not the next frame of
    its connection."""


def encode(msg, secret: bytes) -> bytes:
    """``tag + JSON``: the tag is the HMAC-SHA256 of the JSON under the pool's secret."""
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    if isinstance(msg, ControlMessage):       # int keys and a dataclass inside: as plain lists
        fields["reserve"] = [[rid, slots, dataclasses.asdict(params), prompt]
                             for rid, (slots, params, prompt) in msg.reserve.items()]
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
            fields["reserve"] = {rid: (tuple(slots), SamplingParams(**params), tuple(prompt))
                                 for rid, slots, params, prompt in fields["reserve"]}
        return cls(**fields)
    except (ValueError, KeyError, TypeError) as e:
        raise ControlError(f"refused a signed control frame that is not a valid message ({e!r})") from None


# -- one connection: the handshake's proofs and key, and each frame's seal -------------------------------
def nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _opening(hello: Hello, listener_nonce: str) -> bytes:
    """What a connection's opening binds: the rank announced and both sides' fresh nonces."""
    return f"{hello.rank}:{hello.nonce}:{listener_nonce}".encode()


def proof(secret: bytes, who: bytes, hello: Hello, listener_nonce: str) -> str:
    """``who`` (LISTENER or CONNECTOR) holds the pool's secret and took part in this very opening:
    computed over a nonce the other side just drew, it cannot be recorded from another."""
    return hmac.digest(secret, who + _opening(hello, listener_nonce), "sha256").hex()


def proves(got, secret: bytes, who: bytes, hello: Hello, listener_nonce: str) -> bool:
    return isinstance(got, str) and hmac.compare_digest(got, proof(secret, who, hello, listener_nonce))


def session_key(secret: bytes, hello: Hello, listener_nonce: str) -> bytes:
    return hmac.digest(secret, KEY + _opening(hello, listener_nonce), "sha256")


class Seal:
    """One direction of one connection: frame ``n`` travels as ``n + HMAC(key, direction, n,
    signature) + frame``. The frame's signature already covers its body, so the seal covers the
    signature: per frame a counter and a fixed-size HMAC, whatever the frame's size."""
    def __init__(self, key: bytes, direction: bytes):
        self.key, self.direction, self.seq = key, direction, 0

    def _tag(self, seq: bytes, frame: bytes) -> bytes:
        return hmac.digest(self.key, self.direction + seq + frame[:TAG_BYTES], "sha256")

    def wrap(self, frame: bytes) -> bytes:
        seq = SEQ.pack(self.seq)
        self.seq += 1
        return seq + self._tag(seq, frame) + frame

    def unwrap(self, sealed: bytes) -> bytes:
        """The frame inside ``sealed`` if it is this direction's next one; else ControlError. The
        frame's own signature is still to be checked (``decode``)."""
        head = SEQ.size + TAG_BYTES
        seq, tag, frame = sealed[:SEQ.size], sealed[SEQ.size:head], sealed[head:]
        if len(sealed) < head or not hmac.compare_digest(tag, self._tag(seq, frame)):
            raise ControlError(f"refused a control frame of {len(sealed)} bytes: its seal does not match this "
                               "connection's key (recorded on another connection, tampered with, or unsealed)")
        n = SEQ.unpack(seq)[0]
        if n != self.seq:
            raise ControlError(f"refused control frame {n} where frame {self.seq} was due on this connection "
                               f"({'replayed' if n < self.seq else 'reordered or one lost'})")
        self.seq += 1
        return frame
