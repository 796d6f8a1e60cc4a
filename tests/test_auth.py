"""The server's key and where it may travel (``orca_lab/serving/auth.py``): one server over HTTPS
(a certificate made here with Debian's ``openssl``) asking for ``ORCA_LAB_API_KEY``, called by the
official ``openai`` client; and the start-up rules that keep a key off plain HTTP on the network."""
import json
import os
import re
import shutil
import subprocess
import socket
import ssl
import sys
from pathlib import Path

import httpx
import openai
import pytest

from orca_lab import LLM, EngineConfig
from orca_lab.config import FieldError
from orca_lab.serving.auth import check_tls, check_transport
from orca_lab.serving.launch import ServerProcess
from orca_lab.serving.server import url_of

KEY = "sk-orca-lab-test-0123456789"


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl (Debian's, to make a certificate)")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", d / "key.pem", "-out", d / "cert.pem", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


@pytest.fixture(scope="module")
def server(tls):
    cert, key = tls
    with ServerProcess("--max-bs", 4, "--ssl-certfile", cert, "--ssl-keyfile", key,
                       env={"ORCA_LAB_API_KEY": KEY}) as s:
        yield s


def test_the_key_opens_the_server_over_https(server, tls):
    assert server.url.startswith("https://")
    with httpx.Client(verify=str(tls[0])) as http:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, http_client=http, max_retries=0)
        got = client.completions.create(model="tiny", prompt="a key", max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
    want = LLM("tiny", seed=0, engine=EngineConfig(max_bs=4)).complete(["a key"], 5, ignore_eos=True)[0].text
    assert got.choices[0].text == want


@pytest.mark.parametrize("key", [KEY + "x", KEY[:-1], KEY.upper(), "Bearer"], ids=["longer", "shorter", "upper", "word"])
def test_a_wrong_key_is_refused_and_the_connection_goes_on(server, tls, key):
    with httpx.Client(verify=str(tls[0])) as http:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="Authorization: Bearer <key>"):
            client.completions.create(model="tiny", prompt="x" * 100_000, max_tokens=1)
        assert http.get(server.url + "/health").status_code == 200       # (its body drained: no reset ate the 401)


def test_only_health_and_metrics_are_open(server, tls):
    with httpx.Client(verify=str(tls[0])) as http:
        for path in ("/health", "/metrics"):
            assert http.get(server.url + path).status_code == 200, path
        for method, path in (("GET", "/v1/models"), ("POST", "/tokenize"), ("GET", "/openapi.json"), ("GET", "/docs")):
            r = http.request(method, server.url + path, json={"prompt": "x"})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            assert r.json()["error"]["code"] == 401
        for scheme in ("Bearer", "bearer"):             # a scheme's name is case-insensitive (RFC 9110)
            r = http.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
        assert http.get(server.url + "/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401


def test_bench_sends_the_key_it_is_given_over_https(server, tls, tmp_path, monkeypatch, capsys):
    """``orca-lab bench`` carries ``ORCA_LAB_API_KEY`` to the server; without it, it names the variable.
    The server's certificate is trusted through ``SSL_CERT_FILE``, as httpx reads it."""
    from orca_lab.cli import main
    monkeypatch.setenv("SSL_CERT_FILE", str(tls[0]))
    args = ["bench", "--base-url", server.url, "--n-requests", "2", "--dataset", "fixed", "--input-len", "4",
            "--output-len", "3", "--out", str(tmp_path)]
    monkeypatch.delenv("ORCA_LAB_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="2"):
        main(args)
    assert "answered 401: set ORCA_LAB_API_KEY to the server's key" in capsys.readouterr().err
    monkeypatch.setenv("ORCA_LAB_API_KEY", KEY)
    main(args)
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [(row["n_requests"], row["n_failed"]) for row in report["summary"]] == [(2, 0)]


def _raw(server, tls, request: bytes, body_chunks=()) -> bytes:
    """``request`` sent over TLS as it is, then ``body_chunks`` as HTTP chunks; the first answer's head."""
    port = int(server.url.rsplit(":", 1)[1])
    context = ssl.create_default_context(cafile=str(tls[0]))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        s.sendall(request)
        for chunk in body_chunks:
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        return s.recv(4096).split(b"\r\n\r\n")[0]


def test_a_body_without_the_key_is_never_gathered_nor_invited(server, tls):
    """Refused before the body limit gathers a chunked body: 16 MiB of one never ended is answered once
    read and dropped (the limit, outside, would wait for more, holding it); a client waiting for 100
    Continue gets the 401 instead, sending nothing."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    got = _raw(server, tls, head + b"Transfer-Encoding: chunked\r\n\r\n", [b"x" * (1 << 20)] * 16)
    assert got.startswith(b"HTTP/1.1 401") and b"connection: close" in got.lower(), got
    got = _raw(server, tls, head + b"Content-Length: 10000000\r\nExpect: 100-continue\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 401"), got


def test_plain_http_to_the_https_port_gets_no_answer(server):
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url.replace("https://", "http://") + "/health", timeout=5).raise_for_status()


@pytest.mark.parametrize("host, address, key, tls, refused", [
    ("127.0.0.1", None, KEY, False, None),
    ("::1", None, KEY, False, None),
    ("::ffff:127.0.0.1", None, KEY, False, None),
    ("localhost", "127.0.0.1", KEY, False, None),         # a name: judged by the address it bound
    ("0.0.0.0", None, None, False, None),                # open to anyone, said in a warning
    ("0.0.0.0", None, KEY, True, None),
    ("0.0.0.0", None, KEY, False, "the key would cross the network in plain text"),
    ("::", None, KEY, False, "the key would cross the network in plain text"),
    ("myhost", "10.1.2.3", KEY, False, r"--host myhost \(10.1.2.3\) .* in plain text"),
])
def test_a_key_never_crosses_the_network_in_plain_text(host, address, key, tls, refused):
    if refused is None:
        check_transport(host, key, tls, address)
    else:
        with pytest.raises(FieldError, match=refused):
            check_transport(host, key, tls, address)


def test_the_printed_url_is_one_a_client_can_use():
    assert url_of("::1", 8000, tls=False) == "http://[::1]:8000"
    assert url_of("127.0.0.1", 443, tls=True) == "https://127.0.0.1:443"
    assert httpx.URL(url_of("::1", 8000, tls=True)).port == 8000


def test_tls_files_are_loaded_before_anything_starts(tls, tmp_path):
    cert, key = map(str, tls)
    other, locked, junk = (str(tmp_path / n) for n in ("other.pem", "locked.pem", "junk.pem"))
    subprocess.run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-out", other], check=True, capture_output=True)
    subprocess.run(["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:secret", "-out", locked],
                   check=True, capture_output=True)
    Path(junk).write_text("not a certificate")
    check_tls(cert, key)
    check_tls(None, None)
    for c, k in ((junk, key), (cert, other), (cert, locked)):
        with pytest.raises(FieldError, match="cannot serve HTTPS with them"):
            check_tls(c, k)


def test_the_cli_refuses_a_bad_key_or_half_of_tls_before_it_starts(tmp_path):
    cases = [({"ORCA_LAB_API_KEY": KEY}, ["--host", "0.0.0.0"], "in plain text"),
             ({"ORCA_LAB_API_KEY": "two words"}, [], "ORCA_LAB_API_KEY is set but is not a key"),
             ({"ORCA_LAB_API_KEY": "sk-ключ"}, [], "visible ASCII"),      # no client sends it in a header
             ({}, ["--ssl-certfile", str(tmp_path / "none.pem"), "--ssl-keyfile", str(tmp_path / "none.pem")],
              "--ssl-certfile .*none.pem: no such file"),
             ({}, ["--ssl-certfile", __file__], "--ssl-keyfile is missing")]
    for env, flags, message in cases:
        mine = {k: v for k, v in os.environ.items() if k != "ORCA_LAB_API_KEY"}
        r = subprocess.run([sys.executable, "-m", "orca_lab.cli", "serve", "--port", "0", *flags], env={**mine, **env},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (flags, r.stderr[-2000:])
        assert re.search(message, r.stderr), (message, r.stderr[-2000:])
