"""How a request wants its tokens chosen and when it stops: ``SamplingParams``, checked field by
field where it is made, against the table of request fields (``fields.py``)."""
from __future__ import annotations

from dataclasses import dataclass

from orca_lab.config import FieldError, check_bool, shown
from orca_lab.engine.fields import as_tuple, check, check_count, check_stops, check_token

# the sampling fields that read a request's tokens or write its logprobs, and their "off" value
HOST_STATE = (("logprobs", None), ("prompt_logprobs", None), ("logit_bias", ()), ("presence_penalty", 0.0),
              ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("min_tokens", 0))
GREEDY_BELOW = 1e-5    # a temperature under this is greedy (vLLM's _SAMPLING_EPS): logits / 1e-300 overflow


@dataclass(frozen=True)
class SamplingParams:
    """Greedy by default (and at any temperature below ``GREEDY_BELOW``); EOS ignored by default,
    as in the paper's workload.

    ``top_k`` (0 = off) and ``top_p`` (1 = off) narrow the distribution after ``temperature``;
    ``seed`` makes a sampled request draw the same tokens whatever it is batched with. A request
    stops at ``max_gen_tokens``, at EOS unless ``ignore_eos``, at any of ``stop_token_ids``, or once
    its detokenized output contains one of the ``stop`` strings (the engine needs a tokenizer then);
    a stop string that ends before ``min_tokens`` tokens are out is text like any other. At most
    1,024 ``stop_token_ids`` and ``logit_bias`` entries, 64 ``stop`` strings of up to 1,024 characters
    (``fields.py``: the engine reads them at every token).

    ``logprobs=k`` (0..MAX_LOGPROBS): each generated token's log-probability and the ``k`` most
    likely tokens at its position; ``prompt_logprobs=k``: the same for every prompt token but the
    first (the prefill then computes the logits of all its positions, for this request only). Both
    come from the model's own distribution, ``log_softmax`` of the raw logits in fp32, before any
    penalty, bias, temperature, top-k or top-p (vLLM's default, ``raw_logprobs``): what the model
    thinks, not what the sampler drew from.

    Applied to the logits before sampling, per request, in vLLM's order (``penalties.py``):
    ``min_tokens`` (EOS and the stop token ids are masked until that many tokens are out),
    ``logit_bias`` (``{token id: bias in [-100, 100]}``, added), ``repetition_penalty`` ([0.01, 100], 1 = off;
    over prompt and output), ``frequency_penalty`` and ``presence_penalty`` ([-2, 2], 0 = off; over the
    output), as OpenAI and vLLM define them.
    """
    max_gen_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = True
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def __post_init__(self):
        for name in ("max_gen_tokens", "temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            check(name, getattr(self, name))
        for name in ("seed", "logprobs", "prompt_logprobs", "eos_token_id"):      # None: not asked for
            if getattr(self, name) is not None:
                check(name, getattr(self, name))
        check_bool("ignore_eos", self.ignore_eos)
        check("min_tokens", self.min_tokens, hi=self.max_gen_tokens)
        ids = check_count("stop_token_ids", as_tuple("stop_token_ids", self.stop_token_ids, int))
        for t in ids:
            check_token("stop_token_ids", t)
        object.__setattr__(self, "stop_token_ids", ids)     # tuples: the params stay hashable
        object.__setattr__(self, "stop", check_stops(self.stop))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    @property
    def shapes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before it picks (``penalties.py``)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def needs_host_state(self) -> bool:
        """Whether sampling reads the request's own tokens or writes its logprobs: a worker's last
        stage then needs the prompt too (the simulator, with no logits, cannot)."""
        return any(getattr(self, name) != off for name, off in HOST_STATE)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


def _bias_pairs(value) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted ``(token id, bias)`` pairs, from a dict or pairs (JSON has lists)."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [tuple(p) for p in items]
    except TypeError:
        pairs = None
    if pairs is None or any(len(p) != 2 for p in pairs):
        raise FieldError(f"logit_bias={shown(value)} must map token ids to biases", "logit_bias")
    check_count("logit_bias", pairs)
    out = {}
    for t, b in pairs:
        check("logit_bias", b, where=f"logit_bias[{shown(t)}]")
        out[check_token("logit_bias", t, where="logit_bias token id")] = float(b)
    return tuple(sorted(out.items()))
