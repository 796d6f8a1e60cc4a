"""The engine's watchdog: when an iteration has not returned within a bound, it says so and names
where the engine is stuck (a learner's plugged piece first), so that /health can answer 503 and a
person reading the log knows what to fix.

A thread of the engine process reads the loop's thread's stack: a piece that never returns (a
learner's ``select`` that loops forever) holds the loop, never the GIL for long, so the thread runs.
A process that cannot run at all (stopped, or stuck in C code) says nothing; the endpoint's own
bound (``EngineClient.unhealthy``) covers that.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from pathlib import Path

STALL_S = 60.0        # default bound on one turn of the loop (a CPU iteration takes milliseconds)
PACKAGE = Path(__file__).resolve().parent.parent       # orca_lab/


class Watchdog:
    """Times each turn of the engine loop (``with watchdog.turn():``); ``send`` gets ``("stalled",
    why)`` once a turn outlasts ``stall_s``, and ``("progress",)`` when that turn ends after all.
    ``plugins``: the folder of a learner's pieces, named first when the engine is stuck in them."""

    def __init__(self, send, stall_s: float = STALL_S, plugins: str | Path | None = None):
        self.send, self.stall_s = send, stall_s
        self.plugins = None if plugins is None else Path(plugins).resolve()
        self.loop_thread = threading.get_ident()
        self.since: float | None = None        # when the turn under way began (None: between turns)
        self.reported = False
        threading.Thread(target=self._watch, name="orca-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def turn(self):
        # the thread of the turn is the one to read: a learner's loop runs in a thread of its own
        # (``course.guards.watched``), which enters the turns it drives
        self.loop_thread = threading.get_ident()
        self.since = time.monotonic()
        try:
            yield
        finally:
            self.since = None
            if self.reported:
                self.reported = False
                self.send(("progress",))

    def _watch(self):
        while True:
            time.sleep(min(1.0, self.stall_s / 4))
            since = self.since
            if since is not None and not self.reported and time.monotonic() - since > self.stall_s:
                self.reported = True
                why = f"the engine is stuck: no iteration has returned for {self.stall_s:g} s; it is in {self.where()}"
                print(f"orca-lab serve: {why}", file=sys.stderr, flush=True)
                self.send(("stalled", why))

    def where(self) -> str:
        """The frame the loop's thread is in: the innermost frame of a learner's piece, else the
        innermost of this package's, else the innermost of all."""
        frame = sys._current_frames().get(self.loop_thread)
        if frame is None:
            return "an unknown place (the loop's thread is gone)"
        stack = traceback.extract_stack(frame)[::-1]
        for f in stack:
            if self.plugins is not None and _under(f.filename, self.plugins):
                return f"your {f.name} ({f.filename}:{f.lineno}), a piece plugged with --plugins"
        f = next((f for f in stack if _under(f.filename, PACKAGE)), stack[0])
        return f"{f.name} ({f.filename}:{f.lineno})"


def _under(filename: str, folder: Path) -> bool:
    try:
        return Path(filename).resolve().is_relative_to(folder)
    except OSError:
        return False
