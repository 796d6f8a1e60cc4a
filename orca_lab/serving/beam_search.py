"""Beam search on ``/v1/completions`` (vLLM's ``use_beam_search``, ``n`` the beam width): the search
of ``engine/beam_search.py`` driven over the engine process, as vLLM drives it over its engine.

Each step sends every live beam of every prompt as a one-token request asking for the ``2n`` most
likely next tokens (greedy, EOS ignored: only its log-probabilities are read), one batch for the
engine. The answer holds ``n`` choices per prompt, best first, each with its text and finish reason
("stop": it chose EOS, which its text and ``token_ids`` leave out, as vLLM's; "length"). It is whole
only: ``stream=true`` is refused, as vLLM refuses it. The fields that shape sampling or read each
token (``logprobs``, stop strings and ids, penalties, ``logit_bias``, ``top_p``, ``top_k``,
``min_tokens``) are refused with it rather than ignored; ``temperature`` and ``seed`` change nothing
(the log-probabilities are the model's raw ones, vLLM's too).
"""
from __future__ import annotations

import asyncio

from orca_lab.engine.beam_search import BeamSearch, BeamSearchParams, StepFailed, advance_all, pending
from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.serving.completions import events_of
from orca_lab.serving.engine_client import HTTPError, Stream
from orca_lab.serving.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from orca_lab.serving.state import ServerState

# what beam search does not do, and the value that says so (the request's, once checked)
NOT_WITH_BEAM = {"stream": False, "logprobs": None, "prompt_logprobs": None, "stop": [], "stop_token_ids": [],
                 "logit_bias": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                 "top_p": 1.0, "top_k": 0, "min_tokens": 0}


def check(body: CompletionRequest):
    """Refuse, naming it, a field beam search would otherwise ignore."""
    for name, off in NOT_WITH_BEAM.items():
        value = getattr(body, name)
        if value is not None and value != off and value != {}:       # None, {}: left out
            why = "the beams are known only at the end (vLLM refuses it too)" if name == "stream" else \
                "beam search ranks the model's raw log-probabilities and does not sample"
            raise HTTPError(400, f"{name}={value!r} is not supported with use_beam_search=true: {why}", name)
    if body.max_tokens == 0:
        raise HTTPError(400, "max_tokens=0 leaves beam search nothing to search: allowed >= 1 with "
                        "use_beam_search=true", "max_tokens")


async def beam_answer(state: ServerState, body: CompletionRequest, cid: str, prompts: list[Stream]):
    """The ``n`` best beams of each prompt (``prompts``: one stream per prompt, its ids and echo text)."""
    check(body)
    info = state.pool.core.info
    params = BeamSearchParams(beam_width=body.n, max_tokens=body.max_tokens, ignore_eos=body.ignore_eos,
                              length_penalty=body.length_penalty)
    await state.pool.call("check_requests", [(p.prompt, p.params) for p in prompts])   # the longest beams
    searches = [BeamSearch(p.prompt, params, info.eos_token_ids) for p in prompts]
    while seqs := pending(searches):
        advance_all(searches, await _step(state, seqs, params.logprobs))
    ids, best = body.return_token_ids, [s.best(state.pool.decode or (lambda _: "")) for s in searches]
    choices = [CompletionChoice(index=i * body.n + j, text=p.prompt_text + beam.text, finish_reason=beam.finish_reason,
                                token_ids=beam.output if ids else None, prompt_token_ids=p.prompt if ids else None,
                                error=beam.error)
               for i, (p, beams) in enumerate(zip(prompts, best)) for j, beam in enumerate(beams)]
    prompt, completion = sum(len(p.prompt) for p in prompts), sum(len(b.output) for beams in best for b in beams)
    return CompletionResponse(id=cid, model=state.model_name, choices=choices,
                              usage=Usage(prompt_tokens=prompt, completion_tokens=completion,
                                          total_tokens=prompt + completion))


async def _step(state: ServerState, seqs: list[tuple[int, ...]], k: int) -> list:
    """The ``k`` most likely next tokens of each sequence, ``[(token, logprob), ...]`` each."""
    params = SamplingParams(max_gen_tokens=1, logprobs=k, ignore_eos=True)
    q, now = asyncio.Queue(), state.pool.clock.now()
    streams = [Stream(i, list(s), params, now, q) for i, s in enumerate(seqs)]
    tops, left = [None] * len(streams), set(range(len(streams)))
    try:
        await state.pool.submit(streams)
        async for i, ev in events_of(streams):
            if ev.finish_reason == "error":          # this beam's step failed alone: its prompt's search fails
                tops[i] = StepFailed(ev.error)
                left.discard(i)
                continue
            if ev.error is not None:                 # the engine died: no answer, not a partial one
                raise HTTPError(503, ev.error)
            if ev.finish_reason == "abort":          # only the drain aborts a step the search still waits for
                raise HTTPError(503, "the server is shutting down: the beam search was aborted")
            if ev.finish_reason not in (None, "length"):
                raise HTTPError(500, f"a beam search step ended with finish_reason={ev.finish_reason!r}")
            if ev.logprob is not None:
                tops[i] = ev.logprob.top
            if ev.finish_reason is not None:
                left.discard(i)
    finally:
        if left:                                     # the client left (cancelled), or refused: free their slots
            state.pool.cancel([streams[i] for i in left])
    return tops
