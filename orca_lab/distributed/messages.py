"""The control plane's messages (ORCA §4.1): what the engine master and the workers tell each other.

The engine master sends each iteration's ``ControlMessage`` (request ids, positions, lengths, new
token ids, K/V slots of requests new to the workers) to the first stage's workers. Every worker
forwards it to its successor the moment it arrives, before and independently of its own tensor work;
the last stage sends the tokens back in a ``StageReport``. Only Python scalars and lists travel here:
tensors go over torch.distributed (``data_plane.py``), so control never synchronizes a device. How a
message is framed and signed is ``wire.py``; the sockets it travels on are ``channels.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from orca_lab.engine.batch import Batch
from orca_lab.engine.sampling_params import SamplingParams


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
    # yet, and the requests the scheduler finished (their slots may be handed to new requests). The
    # prompt travels only with a request whose sampling reads it (``SamplingParams.needs_host_state``).
    reserve: dict[int, tuple[tuple[int, ...], SamplingParams, tuple[int, ...]]] = field(default_factory=dict)
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


def reservation(req) -> tuple:
    """What the workers learn of a request new to them, or whose blocks changed: its K/V slots, its
    sampling, and its prompt when its sampling reads it (``SamplingParams.needs_host_state``)."""
    slots = req.slots.tolist() if hasattr(req.slots, "tolist") else req.slots
    return tuple(slots), req.params, tuple(req.prompt) if req.params.needs_host_state else ()


@dataclass(frozen=True)
class Reset:
    """A new engine takes the workers over: forget every request of the previous one."""


@dataclass(frozen=True)
class Stop:
    """Shut down: each worker forwards it, finishes its data-plane sends and exits."""


@dataclass(frozen=True)
class StageReport:
    """A stage finished an iteration: its times (wall clock, seconds) and, from the last stage, the
    tokens, and the log-probabilities it computed for the requests that ask (``[rid, that token's
    entry or None, new prompt entries]``, each entry ``logprobs.to_plain``). Earlier stages report
    only their times, for the pipeline trace."""
    iteration: int
    stage: int
    start: float
    end: float
    tokens: list[int] | None = None
    scores: list = field(default_factory=list)


@dataclass(frozen=True)
class WorkerError:
    rank: int
    text: str


@dataclass(frozen=True)
class Hello:
    """The first frame of every connection: who is calling (-1 = the engine master), and the
    caller's fresh nonce for this connection (``wire.py``)."""
    rank: int
    nonce: str


@dataclass(frozen=True)
class Challenge:
    """The listener's answer to a ``Hello``: its own fresh nonce, and its proof that it holds the
    pool's secret (``wire.proof``)."""
    nonce: str
    proof: str


@dataclass(frozen=True)
class Proof:
    """The caller's last frame of the opening: its proof over both nonces."""
    proof: str


# The kinds a frame may name (``wire.decode`` builds nothing else).
MESSAGES = {cls.__name__: cls for cls in (ControlMessage, Reset, Stop, StageReport, WorkerError, Hello,
                                          Challenge, Proof)}

