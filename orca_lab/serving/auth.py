"""Who may call the server, and where its key may travel.

With ``ORCA_LAB_API_KEY`` set, every route but ``/health`` and ``/metrics`` (a supervisor's probe and
Prometheus's scrape, open as vLLM's are) answers 401 unless the request carries
``Authorization: Bearer <key>``, compared in constant time. The key is read from the environment,
never from a flag: a process's arguments are readable by every user of the machine (``ps``).

A key must not cross the network in plain text: with one, the server listens on a loopback address,
or serves HTTPS (``--ssl-certfile``/``--ssl-keyfile``); anything else is refused at start.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from pathlib import Path

from fastapi.responses import JSONResponse

from orca_lab.config import FieldError
from orca_lab.serving.protocol import error_body

KEY_ENV = "ORCA_LAB_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})
log = logging.getLogger("orca_lab.serve")


def key_from_env() -> str | None:
    """The server's key (``ORCA_LAB_API_KEY``), or None where it has none; a set key that is empty
    or holds spaces (it could not be sent in a header as given) is refused, naming the variable."""
    key = os.environ.get(KEY_ENV)
    if key is None:
        return None
    if not key or any(c.isspace() for c in key) or not key.isprintable():
        raise FieldError(f"{KEY_ENV} is set but is not a key: give printable characters without spaces", KEY_ENV)
    return key


def bearer() -> dict:
    """A client's header carrying the key in ``ORCA_LAB_API_KEY`` (``orca-lab bench``), or none."""
    key = key_from_env()
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def check_transport(host: str, key: str | None, certfile: str | None, keyfile: str | None):
    """Refuse a key that would cross the network in plain text, and TLS files given by half or not
    readable; say so (a warning) when the server is open to the network with no key at all."""
    if (certfile is None) != (keyfile is None):
        missing = "--ssl-keyfile" if keyfile is None else "--ssl-certfile"
        raise FieldError(f"{missing} is missing: HTTPS takes a certificate and its private key", missing.lstrip("-"))
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if path is not None and not Path(path).is_file():
            raise FieldError(f"{flag} {path}: no such file", flag.lstrip("-").replace("-", "_"))
    if loopback(host) or certfile is not None:
        return
    if key is not None:
        raise FieldError(f"--host {host} with {KEY_ENV} and no --ssl-certfile: the key would cross the network "
                         "in plain text; serve HTTPS (--ssl-certfile, --ssl-keyfile) or listen on 127.0.0.1", "host")
    log.warning("--host %s with no %s: anyone who can reach this port can use the model", host, KEY_ENV)


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class RequireKey:
    """ASGI middleware: a request to a route not in ``OPEN_PATHS`` without the key is answered 401 in
    OpenAI's error shape, before any route reads it. Its body (already bounded by ``_BodyLimit``,
    outside this one) is read and dropped first: a socket closed on unread bytes is reset, which can
    destroy the answer before the client reads it."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._carries_key(scope):
            return await self.app(scope, receive, send)
        more = True
        while more:
            message = await receive()
            more = message["type"] == "http.request" and message.get("more_body", False)
        message = "this server takes a key: send the header Authorization: Bearer <key> (the openai client's api_key)"
        await JSONResponse(error_body(401, message), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _carries_key(self, scope) -> bool:
        scheme, _, given = next((v for k, v in scope["headers"] if k == b"authorization"), b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given, self.key)   # (a scheme: any case)
