"""Who may call the server, and where its key may travel.

With ``ORCA_LAB_API_KEY`` set, every route but ``/health`` and ``/metrics`` (a supervisor's probe and
Prometheus's scrape, open as vLLM's are) answers 401 unless the request carries
``Authorization: Bearer <key>``, compared in constant time. The key is read from the environment,
never from a flag: a process's arguments are readable by every user of the machine (``ps``).

A key must not cross the network in plain text: with one, the server listens on a loopback address,
or serves HTTPS (``--ssl-certfile``/``--ssl-keyfile``); anything else is refused at start. The check
at the door is ``app._RequireKey``'s, outside the body limit: a request without the key is refused
before any of its body is held.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import ssl
from pathlib import Path

from orca_lab.config import FieldError

KEY_ENV = "ORCA_LAB_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})
log = logging.getLogger("orca_lab.serve")


def key_from_env() -> str | None:
    """The server's key (``ORCA_LAB_API_KEY``), or None where it has none; a set key that is empty or
    holds anything but visible ASCII (no client sends it in a header as given) is refused, naming
    the variable."""
    key = os.environ.get(KEY_ENV)
    if key is None:
        return None
    if not key or not all("!" <= c <= "~" for c in key):           # what a header carries as it is given
        raise FieldError(f"{KEY_ENV} is set but is not a key: give visible ASCII characters, no spaces", KEY_ENV)
    return key


def bearer() -> dict:
    """A client's header carrying the key in ``ORCA_LAB_API_KEY`` (``orca-lab bench``), or none."""
    key = key_from_env()
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def check_tls(certfile: str | None, keyfile: str | None):
    """HTTPS's two files, both or neither, loaded here as uvicorn will load them: a file missing, not
    PEM, a key of another certificate, or an encrypted key (it would ask for a passphrase once the
    model is built) is refused before anything starts, naming the flag."""
    if (certfile is None) != (keyfile is None):
        missing = "--ssl-keyfile" if keyfile is None else "--ssl-certfile"
        raise FieldError(f"{missing} is missing: HTTPS takes a certificate and its private key", missing.lstrip("-"))
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if path is not None and not Path(path).is_file():
            raise FieldError(f"{flag} {path}: no such file", flag.lstrip("-").replace("-", "_"))
    if certfile is not None:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile, password=b"")
        except (ssl.SSLError, OSError) as e:
            raise FieldError(f"--ssl-certfile {certfile} --ssl-keyfile {keyfile}: cannot serve HTTPS with them ({e}); "
                             "give a PEM certificate and its own unencrypted key", "ssl_certfile") from None


def check_transport(host: str, key: str | None, tls: bool, address: str | None = None):
    """Refuse a key that would cross the network in plain text: served on ``host`` without TLS, judged
    by ``address`` (the one its socket is bound to: a host name by what it resolved to; default
    ``host``). Say so (a warning) when the server is open to the network with no key at all."""
    where = host if address in (None, host) else f"{host} ({address})"
    if loopback(address or host) or tls:
        return
    if key is not None:
        raise FieldError(f"--host {where} with {KEY_ENV} and no --ssl-certfile: the key would cross the network "
                         "in plain text; serve HTTPS (--ssl-certfile, --ssl-keyfile) or listen on 127.0.0.1", "host")
    log.warning("--host %s with no %s: anyone who can reach this port can use the model", where, KEY_ENV)


def loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def carries_key(headers, key: bytes) -> bool:
    """Whether ASGI ``headers`` hold ``Authorization: Bearer <key>``: the scheme in any case, the key
    compared in constant time."""
    scheme, _, given = next((v for k, v in headers if k == b"authorization"), b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.lstrip(b" "), key)
