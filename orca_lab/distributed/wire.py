"""The control plane's wire format: a message as signed JSON of plain types.

Nothing on a control channel is ever unpickled: a message travels as JSON of plain types
(``encode``/``decode``), behind an HMAC-SHA256 of the pool's shared secret. A frame whose tag does
not match (tampered with, unsigned, or signed with another key) is refused before it is parsed, so a
stranger who can reach a port can neither run code nor inject an iteration.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json

from orca_lab.distributed.messages import MESSAGES, ControlMessage
from orca_lab.engine.sampling_params import SamplingParams

TAG_BYTES = hashlib.sha256().digest_size


class ControlError(ValueError):
    """A frame that is not a valid message signed with this pool's secret."""


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

