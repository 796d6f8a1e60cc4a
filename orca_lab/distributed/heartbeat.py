"""Liveness of the engine master: it bumps a counter in the rendezvous store, and every worker
watches the counter, so a master that dies (even by SIGKILL) takes its workers with it."""
from __future__ import annotations

import os
import sys
import threading
import time

HEARTBEAT_S = 1.0           # how often the master bumps its heartbeat counter in the store


def start_heartbeat(store) -> threading.Event:
    """Bump ``heartbeat`` in the rendezvous store every HEARTBEAT_S until the returned event is set.
    ``store`` should be a client of its own (``store.clone()``): a blocking wait on a shared client
    would hold every other call on it."""
    stop = threading.Event()

    def beat():
        while not stop.wait(HEARTBEAT_S):
            try:
                store.add("heartbeat", 1)
            except Exception:       # the store is gone: nobody is listening any more
                return
    threading.Thread(target=beat, name="orca-master-heartbeat", daemon=True).start()
    return stop


def watch_parent(rank: int):
    """End this worker when the process that started it ends (a pool's master: forkserver and spawn
    both hand the child a pipe its parent holds open). It covers the start, before the store and its
    heartbeat are reached: a master interrupted while starting its workers leaves none waiting for
    the store's connect timeout (minutes)."""
    import multiprocessing
    from multiprocessing.connection import wait
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        wait([parent.sentinel])
        print(f"worker rank {rank}: the process that started it ended; giving up", file=sys.stderr, flush=True)
        os._exit(1)
    threading.Thread(target=watch, name="orca-parent-watch", daemon=True).start()


def watch_master(store, timeout: float, rank: int, what: str = "the engine master (rank 0)"):
    """End this worker process with a clear error when the master's heartbeat stops for ``timeout``
    seconds (a master that died or hung: a store hosted elsewhere, such as torchrun's agent, outlives
    it), or when the store itself goes away. Without it a worker would wait for the master at start-up,
    or block in a receive, until torch.distributed's own timeouts (minutes)."""
    def gone(reason: str):
        print(f"worker rank {rank}: {reason}; giving up", file=sys.stderr, flush=True)
        os._exit(1)

    def watch():
        last, since = None, time.monotonic()
        while True:
            try:
                beat = store.add("heartbeat", 0)        # reads the counter, never waits
            except Exception as e:
                gone(f"the rendezvous store that {what} uses is unreachable ({type(e).__name__})")
            if beat != last:
                last, since = beat, time.monotonic()
            elif time.monotonic() - since > timeout:
                gone(f"{what} sent no heartbeat for {timeout:g} s (it died or hung)")
            time.sleep(min(HEARTBEAT_S, timeout / 4))
    threading.Thread(target=watch, name="orca-master-watch", daemon=True).start()

