"""Beam search over the engine, as vLLM builds it: no model inside, each step's scores come from
whoever drives the search (``LLM.beam_search`` in process, the endpoint over the engine process).

A step scores every live beam with a one-token request asking for the ``2 * beam_width`` most likely
next tokens (the model's raw log-probabilities, ``model/logprobs.py``), adds each to its beam's sum,
and keeps the ``beam_width`` best sequences. A beam whose candidate is EOS (unless ``ignore_eos``) is
finished and set aside, EOS not part of it. After ``max_tokens`` steps, or once no beam is left, the
finished and live beams are ranked by ``cumulative logprob / len(prompt + output) ** length_penalty``
(transformers' and vLLM's score) and the best ``beam_width`` returned. Each step's prompt extends the
last one by one token: a prefix cache makes it cheap, and the result is the same without one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from orca_lab.config import check_range
from orca_lab.engine.detokenizer import undecodable
from orca_lab.engine.fields import MAX_LENGTH_PENALTY, MAX_LOGPROBS, check

MAX_BEAM_WIDTH = 16      # its 2 * width candidates per beam are capped at MAX_LOGPROBS: still width + 4 EOS ids


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` sequences returned, at most ``max_tokens`` each."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self):
        check_range("beam_width", self.beam_width, 1, MAX_BEAM_WIDTH, field="n")      # HTTP's n
        check("max_gen_tokens", self.max_tokens, where="max_tokens")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        check("length_penalty", self.length_penalty)

    @property
    def logprobs(self) -> int:
        """How many most likely next tokens a step asks for, per beam."""
        return min(2 * self.beam_width, MAX_LOGPROBS)


@dataclass(frozen=True)
class Beam:
    """One sequence of the search."""
    tokens: tuple[int, ...]          # the prompt, then the tokens chosen (EOS never included)
    n_prompt: int
    cum_logprob: float = 0.0         # the chosen tokens' log-probabilities, summed
    finish_reason: str | None = None  # "stop" (it chose EOS), "length" (max_tokens), "error", None while it grows
    text: str | None = None          # the output's text, filled in by the driver that has a tokenizer
    error: str | None = None         # why its search failed (finish_reason "error")

    @property
    def output(self) -> list[int]:
        return list(self.tokens[self.n_prompt:])

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / len(self.tokens) ** length_penalty


@dataclass(frozen=True)
class StepFailed:
    """A step of one beam that failed alone (its one-token request's error): that prompt's search
    fails, with this reason, and every other search goes on."""
    error: str


class BeamSearch:
    """The search of one prompt: ``live`` beams to score, ``advance`` with their scores, ``best``."""

    def __init__(self, prompt, params: BeamSearchParams, eos_token_ids=()):
        """Its driver first has the engine check the longest beam it will send (``Engine.check_requests``
        of ``prompt`` with ``max_tokens``): a request too long for the model or its K/V is refused then."""
        self.prompt = prompt = tuple(prompt)
        self.params, self.steps = params, 0
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.live = [Beam(prompt, len(prompt))]
        self.finished: list[Beam] = []
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or not self.live or self.steps == self.params.max_tokens

    def advance(self, tops):
        """One step: ``tops[i]`` is ``[(token, logprob), ...]``, the most likely next tokens of ``live[i]``,
        or ``StepFailed``: then the search fails."""
        failed = next((t for t in tops if isinstance(t, StepFailed)), None)
        if failed is not None:
            self.error = failed.error
            return
        candidates = []
        for beam, top in zip(self.live, tops, strict=True):
            for token, logprob in top:
                total = beam.cum_logprob + logprob
                if token in self.eos:
                    self.finished.append(dataclasses.replace(beam, cum_logprob=total, finish_reason="stop"))
                else:
                    candidates.append((total, token, beam))
        candidates.sort(key=lambda c: -c[0])
        self.live = [dataclasses.replace(b, tokens=b.tokens + (t,), cum_logprob=total)
                     for total, t, b in candidates[:self.params.beam_width]]
        self.steps += 1

    def best(self, decode=None) -> list[Beam]:
        """The ``beam_width`` best beams, best first, with their text if ``decode`` is given; a failed
        search gives ``beam_width`` empty beams that say why."""
        if self.error is not None:
            failed = Beam(self.prompt, len(self.prompt), finish_reason="error", error=self.error,
                          text=None if decode is None else "")
            return [failed] * self.params.beam_width
        ranked = sorted(self.finished + [dataclasses.replace(b, finish_reason="length") for b in self.live],
                        key=lambda b: -b.score(self.params.length_penalty))[:self.params.beam_width]
        if decode is None:
            return ranked
        try:
            return [dataclasses.replace(b, text=decode(b.output)) for b in ranked]
        except Exception as e:          # its tokenizer cannot decode its beams: this search fails alone
            self.error = undecodable(e)
            return self.best(decode)


def pending(searches: list[BeamSearch]) -> list[tuple[int, ...]]:
    """The sequences the next step scores: every live beam of every search not done, in order."""
    return [b.tokens for s in searches if not s.done for b in s.live]


def advance_all(searches: list[BeamSearch], tops: list):
    """Hand each search not done the scores of its own beams (``tops`` in ``pending``'s order)."""
    at = 0
    for s in [s for s in searches if not s.done]:
        n = len(s.live)
        s.advance(tops[at:at + n])
        at += n
