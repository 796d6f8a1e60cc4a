"""What the serving tests share: reading a server's gauges, waiting (bounded) for a condition,
pausing a server's engine process, and checking that a server left no process and no port behind."""
import contextlib
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from orca_lab.serving.metrics import parse_metrics


def metrics(url) -> dict:
    return parse_metrics(httpx.get(url + "/metrics").text)


def wait_for(cond, timeout=10.0, every=0.02):
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        if cond():
            return True
        time.sleep(every)
    return cond()


def assert_port_free(s):
    with pytest.raises(httpx.ConnectError):  # nothing listens on its port...
        httpx.get(s.url + "/health")
    with socket.socket() as sock:            # ...and a new server may take it (closed connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # stay in TIME_WAIT a while)
        sock.bind(("127.0.0.1", s.port))
        sock.listen()


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> dict[int, tuple[str, str]]:
    """Every process under ``pid`` (from /proc: psutil is not a dependency), as pid -> (start time,
    command line): the start time tells it from a later process given the same pid."""
    children: dict[int, list[int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        if (st := _stat(int(d))) is not None:
            children.setdefault(int(st[1]), []).append(int(d))
    out, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            with contextlib.suppress(OSError, TypeError):
                out[child] = (_stat(child)[19], Path(f"/proc/{child}/cmdline").read_text().replace("\0", " "))
            todo.append(child)
    return out


def running(tree: dict[int, tuple[str, str]]) -> dict[int, str]:
    """Those of ``tree`` not exited yet (a zombie has: it holds no port, memory or file any more)."""
    return {pid: cmd for pid, (start, cmd) in tree.items()
            if (st := _stat(pid)) is not None and st[0] != "Z" and st[19] == start}


def kill_left(tree: dict):
    """A failed test leaves nothing running behind it either."""
    for pid in running(tree):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def engine_pid(s) -> int:
    """The pid of the engine process under server ``s``."""
    return s.engine_pid()


@contextlib.contextmanager
def paused(pid: int):
    """The process stopped (SIGSTOP) for the block: a test that needs a request still running holds
    it this way, by something that cannot finish on its own, never by the host being slow enough."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
