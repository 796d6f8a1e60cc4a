"""How worker processes are started and kept from outliving the engine: the fork server on CPU,
spawn on CUDA, and a user's ``__main__`` hidden from the children."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import weakref
from multiprocessing import get_context


def exit_text(code: int) -> str:
    if code < 0:
        return f"on signal {signal.Signals(-code).name}"
    return f"with code {code}"


def process_context(device: str):
    """On CPU, workers are forked from a fork server that imported torch and this package once (a
    clean, single-threaded process: safe to fork, unlike this one), so a pool starts in about a second
    instead of paying every worker's imports. ``torch._dynamo`` too: building modules on the meta
    device imports it lazily, ~3 s per worker otherwise. The server lives as long as this process
    (``_stop_fork_server``).

    On CUDA, workers are spawned: a fresh interpreter each, so nothing this process or a preloaded
    import did to the CUDA driver can leave a worker unable to initialize it."""
    if device.startswith("cuda"):
        return get_context("spawn")
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload(["orca_lab.distributed.worker", "torch._dynamo"])
    return ctx


def _stop_fork_server():
    """At exit, once every pool's workers are gone. Left alone, the fork server would stop when this
    process's end closes its pipe, and then spend ~1.4 s tearing down the torch it imported: it
    would outlive this process (and ``orca-lab serve``, which waits for its engine process). Its
    children, the workers, are gone and it holds nothing else, so it is killed and reaped here
    (unless this process still has children: they may be the fork server's too)."""
    from multiprocessing import active_children, forkserver
    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is None or active_children():
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(server._forkserver_pid, signal.SIGKILL)
    with contextlib.suppress(OSError):       # its socket's folder may have been removed first
        server._stop()                       # reaps it, closes its pipe, removes its socket


# Made at import, before any pool's finalizer: at exit, finalizers run newest first, so this one runs
# after every pool still open has stopped its workers.
weakref.finalize(process_context, _stop_fork_server)


@contextlib.contextmanager
def main_hidden():
    """A worker runs library code only, so it need not re-run the user's ``__main__`` script, as
    multiprocessing does by default (which breaks scripts without an ``if __name__ == "__main__"``
    guard and re-does their work in every worker). Without ``__file__`` and ``__spec__`` the child has
    no main module to re-import."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)

