"""A completion's answer, from its streams' events: one JSON body, or server-sent events (a chunk
per token of each choice, the usage chunk if asked, ``[DONE]``).

A choice that failed alone inside the engine (its sampling or stop check raised: ``Request.fail``)
ends with finish_reason "error": in a whole answer its choice says why (``error``), the others are
whole; a stream sends that choice's last chunk, then an error event and ``[DONE]``, as vLLM does."""
from __future__ import annotations

import json

from orca_lab.serving.engine_client import Event, HTTPError, Stream
from orca_lab.serving.logprob_text import LogprobText, TokenNames, prompt_entries
from orca_lab.serving.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage, error_body
from orca_lab.serving.state import HTTPRecord, ServerState


async def events_of(streams: list[Stream]):
    """``(index, Event)`` until every stream has finished."""
    left = len(streams)
    q = streams[0].out
    while left:
        index, ev = await q.get()
        left -= ev.finish_reason is not None
        yield index, ev


def usage_of(streams, outputs, n: int) -> Usage:
    """The prompt counted once per prompt whatever ``n`` (as OpenAI, vLLM and SGLang count it): the
    ``n`` choices of one prompt are consecutive streams."""
    prompt = sum(len(s.prompt) for s in streams[::n])
    completion = sum(len(o) for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class ChoiceWriter:
    """What one choice's events add to its answer: the echoed prompt before its first event, its
    log-probabilities if asked, in the shape ``form`` writes (``logprob_text.py``: the completions'
    or the chat's), and vLLM's ``prompt_logprobs`` if asked, the same for a stream's chunks and a
    whole answer."""

    def __init__(self, stream: Stream, body: CompletionRequest, tokenizer, form=LogprobText):
        self.stream, self.started, self.echo = stream, False, body.echo
        as_ids = body.return_tokens_as_token_ids
        self.logprobs = form(tokenizer, as_ids, body.logprobs) if body.logprobs is not None else None
        self.prompt_k, self.names = body.prompt_logprobs, TokenNames(tokenizer, as_ids)

    def text(self, ev: Event) -> str:
        return ev.text if self.started else self.stream.prompt_text + ev.text

    def logprobs_of(self, ev: Event) -> dict | None:
        """This event's entries (the prompt's too with its first, for echo); marks the choice started."""
        first, self.started = not self.started, True
        if self.logprobs is None:
            return None
        pairs = list(zip(self.stream.prompt, _prompt_entries(ev))) if first and self.echo else []
        if ev.token is not None:
            pairs.append((ev.token, ev.logprob))
        return self.logprobs.chunk(pairs)

    def prompt_logprobs_of(self, ev: Event) -> list | None:
        """vLLM's ``prompt_logprobs``, with the choice's first event (None with the others)."""
        if self.prompt_k is None or self.started:
            return None
        return prompt_entries(self.names, self.stream.prompt, _prompt_entries(ev), self.prompt_k)


def _prompt_entries(ev: Event) -> list:
    """The prompt's entries with a choice's first event: the engine scores none of a one-token
    prompt, whose first (and only) token has no entry all the same."""
    return ev.prompt_logprobs or [None]


async def whole_answer(state: ServerState, body: CompletionRequest, cid: str, streams: list[Stream], form=LogprobText):
    outputs, texts, reasons = [[] for _ in streams], [[] for _ in streams], [None] * len(streams)
    writers = [ChoiceWriter(s, body, state.pool.tokenizer, form) for s in streams]
    logprobs, prompt_logprobs, matched = [[] for _ in streams], [None] * len(streams), [None] * len(streams)
    errors = [None] * len(streams)
    async for i, ev in events_of(streams):
        if ev.error is not None and ev.finish_reason == "abort":   # the engine died: no partial answer
            raise HTTPError(503, ev.error)
        errors[i] = ev.error
        if ev.token is not None:
            outputs[i].append(ev.token)
        texts[i].append(writers[i].text(ev))
        prompt_logprobs[i] = prompt_logprobs[i] or writers[i].prompt_logprobs_of(ev)
        logprobs[i].append(writers[i].logprobs_of(ev))
        reasons[i], matched[i] = ev.finish_reason, ev.matched_stop
    if state.draining and "abort" in reasons:    # cut short at shutdown: say so, not a partial answer
        raise HTTPError(503, "the server is shutting down: the request was aborted once --drain-s ran out")
    ids = body.return_token_ids
    choices = [CompletionChoice(index=i, text="".join(texts[i]), finish_reason=reasons[i],
                                logprobs=None if body.logprobs is None else form.whole(logprobs[i]),
                                token_ids=outputs[i] if ids else None,
                                prompt_token_ids=streams[i].prompt if ids else None,
                                prompt_logprobs=prompt_logprobs[i], matched_stop=matched[i], error=errors[i])
               for i in range(len(streams))]
    return CompletionResponse(id=cid, model=state.model_name, choices=choices,
                              usage=usage_of(streams, outputs, body.n))


async def sse_answer(state: ServerState, body: CompletionRequest, cid: str, streams: list[Stream], rec: HTTPRecord,
                     form=LogprobText):
    """Server-sent events: one chunk per token of each choice, its finish reason on its last chunk,
    the usage chunk if asked, then ``[DONE]``. With ``return_token_ids``, each chunk's ``token_ids``
    and the choice's ``prompt_token_ids`` with its first; with ``continuous_usage_stats``, each
    chunk's ``usage``: its choice's prompt and tokens so far (vLLM's). A client that disconnects (the
    stream is cancelled) cancels its unfinished requests: their slots are free within one iteration."""
    outputs, done, continuous = [[] for _ in streams], [False] * len(streams), body.continuous_usage
    writers = [ChoiceWriter(s, body, state.pool.tokenizer, form) for s in streams]
    head = CompletionResponse(id=cid, model=state.model_name, choices=[]).model_dump(exclude={"choices", "usage"})
    head = json.dumps(head)[:-1] + ', "choices": ['       # every token chunk starts the same way
    try:
        async for i, ev in events_of(streams):
            if ev.token is not None:
                outputs[i].append(ev.token)
            done[i] = ev.finish_reason is not None
            plp, first = writers[i].prompt_logprobs_of(ev), not writers[i].started
            choice = {"index": i, "text": writers[i].text(ev), "logprobs": writers[i].logprobs_of(ev),
                      "finish_reason": ev.finish_reason, "matched_stop": ev.matched_stop}
            if plp is not None:
                choice["prompt_logprobs"] = plp
            if body.return_token_ids:
                choice["token_ids"] = [] if ev.token is None else [ev.token]
                if first:
                    choice["prompt_token_ids"] = streams[i].prompt
            # a CompletionResponse with this one choice, written by hand: a token's chunk is the
            # server's hottest path (pydantic took ~15x longer)
            usage = _usage_json(len(streams[i].prompt), len(outputs[i])) if continuous else "null"
            data = f"data: {head}{json.dumps(choice)}], \"usage\": {usage}}}\n\n"
            if rec.first_token is None and ev.token is not None:
                rec.first_token = state.pool.clock.now()
            yield data
            if ev.finish_reason == "error":          # this choice failed: the stream ends here
                yield f"data: {json.dumps(error_body(500, f'choice {i} failed: {ev.error}'))}\n\n"
                break
        else:
            if body.include_usage:
                yield sse_chunk(CompletionResponse(id=cid, model=state.model_name, choices=[],
                                                   usage=usage_of(streams, outputs, body.n)))
        yield "data: [DONE]\n\n"
    finally:
        rec.finish = state.pool.clock.now()            # [DONE] has been handed over, or the client left
        left = [s for s, d in zip(streams, done) if not d]
        if left:
            state.pool.cancel(left)


def _usage_json(prompt: int, completion: int) -> str:
    return f'{{"prompt_tokens": {prompt}, "completion_tokens": {completion}, "total_tokens": {prompt + completion}}}'


def sse_chunk(resp: CompletionResponse) -> str:
    return f"data: {resp.model_dump_json()}\n\n"

