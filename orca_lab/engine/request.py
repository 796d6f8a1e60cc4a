"""A request, its states in Algorithm 1 and why it finished (its sampling parameters:
``sampling_params.py``)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from orca_lab.engine.detokenizer import Detokenizer, undecodable
from orca_lab.engine.sampling_params import SamplingParams

# OpenAI's and vLLM's names; "error": this request failed inside an iteration (``Request.fail``)
FINISH_REASONS = ("length", "stop", "abort", "error")


class RequestState(enum.Enum):
    INITIATION = "initiation"   # never scheduled: its prompt has not been processed yet
    RUNNING = "running"         # in a batch that is in flight on the engine
    # Algorithm 1's name: in its increment (decode) phase, back from its last iteration and ready
    # for the next one (not in flight); every request the scheduler holds between iterations
    INCREMENT = "increment"
    FINISHED = "finished"


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
    finish_reason: str | None = None  # one of FINISH_REASONS once it is done
    generator: object = None          # torch.Generator of a sampled (non-greedy) request
    n_preemptions: int = 0            # times its K/V was freed to be recomputed (paged policies)
    n_prefix_hit: int = 0             # prompt tokens found cached at its first admission (prefix caching)
    block_hashes: list = field(default_factory=list, repr=False)   # its context's full blocks (prefix_cache.py)
    detokenize: object = None         # the tokenizer's decode: stop strings and ``text`` need it
    stop_at: int | None = None        # where a stop string begins in the detokenized output
    error: str | None = None          # why it failed, with finish_reason "error"
    logprobs: list = field(default_factory=list)         # TokenLogprob of each sampled token (if asked)
    prompt_logprobs: list = field(default_factory=list)  # of each prompt token, None for the first (if asked)
    _detokenizer: Detokenizer | None = field(default=None, repr=False)

    @property
    def max_tokens(self) -> int:
        """Algorithm 1's max_tokens: the K/V slots the request may ever need."""
        return len(self.prompt) + self.params.max_gen_tokens

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

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
        self.finish_reason = self._stop_reason(token)

    def fail(self, why: str):
        """This request's own failure inside an iteration (its sampling, its stop checks, its text):
        it ends with finish_reason "error" and ``why``; its scheduler frees its K/V, and the batch
        goes on without it (vLLM's per-request errors)."""
        self.finish_reason, self.error = "error", why

    def _stop_reason(self, token: int) -> str | None:
        """vLLM's order: EOS, stop token ids, stop strings, then the length limit. Before
        ``min_tokens`` tokens are out nothing stops it but the length (vLLM checks stops only past
        it; the sampler also masks EOS and the stop ids until then): a stop string that ends
        earlier is text like any other."""
        p = self.params
        stops = len(self.output) >= p.min_tokens
        if stops and ((not p.ignore_eos and token == p.eos_token_id) or token in p.stop_token_ids):
            return "stop"
        if p.stop:
            self.stop_at = self.detokenizer.add(token)
            if self.stop_at is not None:
                return "stop"
        return "length" if len(self.output) >= p.max_gen_tokens else None

    @property
    def detokenizer(self) -> Detokenizer:
        """Its text, made token by token (with stop strings as each token comes, else when asked)."""
        if self._detokenizer is None:
            if self.detokenize is None:
                raise RuntimeError(f"request {self.rid} has no tokenizer: its output is token ids only")
            self._detokenizer = Detokenizer(self.detokenize, self.params.stop, self.params.min_tokens)
        return self._detokenizer

    def text_or_fail(self) -> str | None:
        """Its ``text``, or None: it has no tokenizer, it failed, or it fails now because its tokenizer
        cannot decode its tokens (alone: ``fail``)."""
        if self.detokenize is None or self.error:
            return None
        try:
            return self.text
        except Exception as e:
            self.fail(undecodable(e))
            return None

    @property
    def text(self) -> str:
        """The output as text a client may be shown now: without the stop string or the stop/EOS
        token that ended it (as OpenAI and vLLM return it); while it runs, without an incomplete
        last character or an end that could begin a stop string. Each call's text extends the
        previous one."""
        d = self.detokenizer
        d.update(self.output[len(d.ids):], self.finish_reason, self.stop_at)
        return d.text

