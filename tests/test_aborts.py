"""Clients that leave at every moment, on every system: the engine never dies of a client.

First the engine process's loop itself (``EngineLoop``, in this process over real pipes, driven one
message and one turn at a time, so each abort lands at a known moment: waiting, in flight, between
iterations, or finished but held in the request-level baseline's batch). Then the real server under
a crowd of clients, a third of whom drop their requests at random moments."""
import functools
import multiprocessing as mp
import random

import pytest

from orca_lab import LLM, EngineConfig, SamplingParams
from orca_lab.engine.request import RequestState
from orca_lab.serving.engine_core import EngineLoop

from helpers import random_prompts

SYSTEMS = ("orca", "ft", "paged", "chunked")


class LoopOverPipes:
    """An ``EngineLoop`` over two real pipes, driven by hand: ``handle`` a message, ``turn`` once,
    read what it sent."""

    def __init__(self, engine):
        inbox, self._to_engine = mp.Pipe(duplex=False)
        self._from_engine, outbox = mp.Pipe(duplex=False)
        self.loop = EngineLoop(engine, inbox, outbox)
        self.events: dict[int, list[tuple]] = {}          # stream_id -> (token, finish_reason) as sent

    def read(self):
        while self._from_engine.poll():
            msg = self._from_engine.recv()
            assert msg[0] != "failed", msg[1]
            if msg[0] == "out":
                for stream_id, token, reason, *_ in msg[2]:
                    self.events.setdefault(stream_id, []).append((token, reason))

    def close(self):
        self._to_engine.close()                           # the loop's reader thread sees EOF and ends
        self.loop.engine.close()


def moment(req) -> str:
    """Where a request is when its client leaves."""
    if req.t_scheduled is None:
        return "waiting"
    if req.finished:
        return "finished, held"                           # the baseline's batch holds it
    return "in flight" if req.state is RequestState.RUNNING else "between iterations"


@functools.lru_cache(maxsize=None)
def alone(llm, prompt: tuple, n: int) -> list[int]:
    return llm.generate([list(prompt)], max_gen_tokens=n)[0]


@pytest.mark.parametrize("system", SYSTEMS)
def test_the_engine_loop_survives_aborts_at_every_moment(tiny_llm, system):
    """Requests arrive and are cancelled at random between turns of the loop (two batches in flight):
    every stream gets exactly one finish reason, on its last event; a stream not cancelled gets all
    its tokens, those of its request run alone; a cancelled one a prefix of them and "abort"; at the
    end nothing is waiting, running or reserved."""
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=3, n_slots=4096, executor="local",
                                                      pipeline_parallel=2))
    engine = llm.new_engine(system)
    rng = random.Random(0)
    prompts = random_prompts(30, 257, 1, 12, seed=1)
    wanted, cancelled, hit = {}, set(), set()
    lp = LoopOverPipes(engine)
    try:
        for turn in range(400):
            if prompts and rng.random() < 0.5:
                stream_id, prompt, n = len(wanted), prompts.pop(), rng.randint(1, 10)
                lp.loop.handle(("add", stream_id, [(stream_id, prompt, SamplingParams(max_gen_tokens=n), None)]))
                wanted[stream_id] = (prompt, n)
            at = {stream_id: moment(engine.requests[rid]) for stream_id, rid in sorted(lp.loop.rids.items())}
            new = [stream_id for stream_id, m in at.items() if m not in hit]          # a moment not tried yet first
            if new or (at and rng.random() < 0.2):
                stream_id = rng.choice(new or list(at))
                hit.add(at[stream_id])
                cancelled.add(stream_id)
                running = engine.stats().running
                lp.loop.handle(("abort", [stream_id]))
                if at[stream_id] == "finished, held":               # it stays in its batch until it ends
                    assert engine.stats().running == running
            if engine.has_work():
                lp.loop.turn()
            lp.read()
            if not prompts and not engine.has_work():
                break
        assert not engine.has_work() and not lp.loop.rids and not lp.loop.stream_ids
        stats = engine.stats()
        assert (stats.waiting, stats.running, stats.kv_reserved) == (0, 0, 0)
    finally:
        lp.close()
    assert hit >= {"waiting", "in flight", "between iterations"} | ({"finished, held"} if system == "ft" else set())
    assert set(lp.events) == set(wanted)
    for stream_id, (prompt, n) in wanted.items():
        tokens = [t for t, _ in lp.events[stream_id] if t is not None]
        reasons = [r for _, r in lp.events[stream_id]]
        assert reasons[:-1] == [None] * (len(reasons) - 1), (stream_id, reasons)
        if stream_id in cancelled:
            assert reasons[-1] == "abort" and tokens == alone(tiny_llm, tuple(prompt), n)[:len(tokens)]
        else:
            assert reasons[-1] == "length" and tokens == alone(tiny_llm, tuple(prompt), n)
