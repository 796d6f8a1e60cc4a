"""What the endpoint holds between requests: the engine client, the metrics, the HTTP records of
the last completions (for ``/debug/run``, with ``--debug`` only), whether it is draining, and the
thread that tokenizes prompts."""
from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from orca_lab.serving.engine_client import EngineClient
from orca_lab.serving.metrics import ServerMetrics


# -- the endpoint --------------------------------------------------------------------------------
@dataclass
class ServerState:
    model_name: str
    system: str
    pool: EngineClient
    metrics: ServerMetrics
    draining: bool = False
    # how many completions' HTTP records /debug/run keeps: the engine's HISTORY with --debug, else
    # none, so a server's memory does not grow with what it served (as the engine's own records)
    history: int = 0
    completions: OrderedDict = field(default_factory=OrderedDict)   # completion id -> HTTPRecord
    # prompts are tokenized here, not on the event loop (megabytes of text take seconds, and the loop
    # serves every stream's tokens meanwhile); one thread: in arrival order, and no tokenizer is called
    # from two threads at once (not every one may be)
    tokenizing: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "orca-tokenize"))

    async def tokenized(self, fn, *args):
        """``fn(*args)`` (tokenizing, and checking the ids) on the tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn, *args)

    def record(self, cid: str, rec: "HTTPRecord"):
        if self.history:
            self.completions[cid] = rec
            if len(self.completions) > self.history:
                self.completions.popitem(last=False)

    async def completions_json(self, since: float) -> bytes:
        """The completions not finished by ``since`` (engine clock), as JSON, encoded in a thread:
        there may be ``history`` of them, and the event loop has streams to serve."""
        records = list(self.completions.items())           # a snapshot: the loop adds more meanwhile
        encode = lambda: json.dumps({c: vars(r) for c, r in records if r.finish is None or r.finish > since})
        return (await asyncio.to_thread(encode)).encode()


@dataclass
class HTTPRecord:
    """One completion as the endpoint served it (engine clock): arrival at the app, the first chunk
    holding a token handed to the connection (streams only), the last byte handed over (or when
    its client left)."""
    rids: list[int]
    arrival: float
    first_token: float | None = None
    finish: float | None = None

