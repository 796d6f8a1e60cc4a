"""``orca-lab serve``: an OpenAI-compatible endpoint over the engine loop (ORCA §3, Figure 4).

The endpoint (FastAPI on an asyncio event loop) checks each request and hands it to the request
pool; the engine, in a process of its own (``engine_core``), runs Algorithm 1's iterations over
that pool. They meet at two pipes: endpoint -> engine (add, abort, call, stop) and engine ->
endpoint (one message per iteration with its tokens, read by the event loop as it arrives). No
engine work runs on the event loop, so a long iteration never stalls the HTTP side, and the engine
never waits on a slow client or on the GIL the event loop holds.

This module runs the endpoint under uvicorn: the port, the signals and the drain at shutdown. The
app and its routes are ``app.py``; a completion's answer, whole or streamed, ``completions.py``; the
endpoint's side of the engine process, ``engine_client.py``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from fastapi import FastAPI

from orca_lab.config import check_range
from orca_lab.serving.app import build_app
from orca_lab.serving.auth import check_tls, check_transport, key_from_env
from orca_lab.serving.engine_core import HISTORY, EngineArgs, EngineProcess

log = logging.getLogger("orca_lab.serve")


# -- running it ----------------------------------------------------------------------------------
ABORT_GRACE_S = 3.0     # after the drain, for the aborted requests' last chunks and error bodies


class EngineDied(RuntimeError):
    """The engine process died while serving. The server stops and its process exits non-zero, so
    that a supervisor (systemd's Restart=, Kubernetes) starts a new one, as vLLM's does: a server
    that answers 503 forever is restarted by nobody."""


class _Server:
    """uvicorn's server, told about SIGINT/SIGTERM: the endpoint stops accepting at once (503),
    uvicorn closes the port and waits up to ``drain_s`` for requests in flight; then every request
    still running is aborted through the engine, so its client reads the end (a stream its
    ``finish_reason: "abort"`` and ``[DONE]``, a non-streaming request a JSON 503), and the
    lifespan's end stops the engine and its workers. uvicorn cancels only what is left
    ``ABORT_GRACE_S`` later (a client that does not read)."""

    def __init__(self, app: FastAPI, sock, drain_s: float, **tls):
        import uvicorn
        state = app.state.orca

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                state.draining = True
                super().handle_exit(sig, frame)

            async def shutdown(self, sockets=None):
                state.draining = True
                timer = asyncio.get_running_loop().call_later(drain_s, state.pool.abort_all)
                try:
                    await super().shutdown(sockets)
                finally:
                    timer.cancel()

        config = uvicorn.Config(app, timeout_graceful_shutdown=drain_s + ABORT_GRACE_S, log_level="warning",
                                lifespan="on", access_log=False, **tls)
        self.server, self.sock = Server(config), sock
        self.died: str | None = None
        state.pool.on_dead = self._engine_died

    def _engine_died(self, why: str):
        self.died = why
        self.server.should_exit = True

    def run(self):
        # uvicorn raises the signal it drained for again once it is done (the engine stopped and
        # joined by then): SIGTERM then ends the process with code 0, as fast as the signal's
        # default action did (no interpreter teardown), instead of "killed by SIGTERM"
        signal.signal(signal.SIGTERM, _exit_0)
        self.server.run(sockets=[self.sock])
        if self.died is not None:
            raise EngineDied(self.died)


def _exit_0(sig, frame):
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def listen(host: str, port: int):
    """A bound socket; port 0 lets the OS choose (read it back with ``getsockname``). An address it
    cannot take (a port in use, a host not of this machine) is a ValueError naming both."""
    import socket
    check_range("port", port, 0, 65535)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:    # (socket.gaierror too: a host name that does not resolve)
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    sock.listen(2048)       # now: a client that read the printed URL connects before uvicorn accepts
    return sock


def url_of(host: str, port: int, tls: bool) -> str:
    """The URL a client reaches the server at (an IPv6 address in brackets, as URLs write it)."""
    return f"{'https' if tls else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"


def serve(recipe: EngineArgs, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 1024,
          drain_s: float = 5.0, model_name: str | None = None, debug: bool = False, chat_template: str | None = None,
          ssl_certfile: str | None = None, ssl_keyfile: str | None = None):
    """Serve the model of ``recipe`` until SIGINT/SIGTERM, or until its engine dies (``EngineDied``);
    prints its URL once it accepts requests. The key (``auth.KEY_ENV``) and the TLS files are checked
    first, then the port is taken (a busy one fails at once) and where the key may travel judged by the
    address bound, then the engine process builds the model. HTTPS with ``ssl_certfile`` and
    ``ssl_keyfile``."""
    key = key_from_env()
    check_tls(ssl_certfile, ssl_keyfile)
    sock = listen(host, port)
    address, bound = sock.getsockname()[:2]
    tls = ssl_certfile is not None
    try:
        check_transport(host, key, tls, address)
        core = EngineProcess(recipe, history=HISTORY if debug else 0)
    except BaseException:
        sock.close()
        raise
    url = url_of(host, bound, tls)
    ready = lambda app: print(f"orca-lab serve: {app.state.orca.model_name} ({recipe.system}) on {url}", flush=True)
    try:
        app = build_app(core, recipe.system, max_queue, model_name, ready, debug=debug, chat_template=chat_template,
                        api_key=key)
        _Server(app, sock, drain_s, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile).run()
    except KeyboardInterrupt:          # uvicorn re-raises the SIGINT it drained for: we are done
        pass
    finally:
        sock.close()
        core.join(5.0)                 # already gone unless uvicorn never ran the lifespan's end

