"""A request, its states in Algorithm 1 and its sampling parameters."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from orca_lab.config import check_range


class RequestState(enum.Enum):
    INITIATION = "initiation"   # never scheduled: its prompt has not been processed yet
    RUNNING = "running"         # in a batch that is in flight on the engine
    INCREMENT = "increment"     # back from an iteration, waiting for its next one
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """Greedy by default; EOS ignored by default, as in the paper's workload."""
    max_gen_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = True
    eos_token_id: int | None = None

    def __post_init__(self):
        check_range("max_gen_tokens", self.max_gen_tokens, 1, 1 << 20)
        check_range("temperature", self.temperature, 0.0, 100.0, kind=float)
        check_range("top_k", self.top_k, 0, 1 << 24)
        if self.seed is not None:
            check_range("seed", self.seed, 0, 2 ** 63 - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(eq=False)
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    arrival: float = 0.0
    state: RequestState = RequestState.INITIATION
    output: list[int] = field(default_factory=list)
    n_cached: int = 0                 # tokens whose K/V are in the slot pool
    slots: object = None              # torch int64 tensor of reserved slot ids, set by the K/V manager
    t_scheduled: float | None = None  # first time in a batch
    t_first_token: float | None = None
    t_finish: float | None = None
    n_iterations: int = 0             # iterations this request has run (FCFS property)
    eos_seen: bool = False
    generator: object = None          # torch.Generator of a sampled (non-greedy) request
    n_preemptions: int = 0            # times its K/V was freed to be recomputed (paged policies)

    @property
    def max_tokens(self) -> int:
        """Algorithm 1's max_tokens: the K/V slots the request may ever need."""
        return len(self.prompt) + self.params.max_gen_tokens

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.params.max_gen_tokens or self.eos_seen

    def pending_tokens(self) -> list[int]:
        """Tokens this request feeds into its next iteration: its whole prompt first, then its last token."""
        n_prompt = len(self.prompt)
        if self.n_cached < n_prompt:
            return self.prompt[self.n_cached:] + self.output
        return self.output[self.n_cached - n_prompt:]

    def append(self, token: int, now: float | None):
        """A generated token. ``now``: when the client receives it; None when it is held back (the
        request-level baseline delivers a request's tokens when its whole batch ends)."""
        if self.t_first_token is None and now is not None:
            self.t_first_token = now
        self.output.append(token)
        p = self.params
        self.eos_seen = (not p.ignore_eos) and p.eos_token_id is not None and token == p.eos_token_id
