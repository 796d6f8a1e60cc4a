"""``orca-lab serve`` in a child process, for notebooks, tests and benchmarks.

``with ServerProcess("--max-bs", 8) as server: server.url`` starts it on a port the OS chooses, waits
until it accepts requests, and on exit sends SIGTERM and waits for it to be gone (it drains, cancels
the rest and stops its workers itself).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

URL = re.compile(r"orca-lab serve: .* on (https?://\S+)")


class ServerProcess:
    def __init__(self, *args, start_timeout: float = 120.0, env: dict | None = None):
        self.cmd = [sys.executable, "-m", "orca_lab.cli", "serve", "--port", "0", *map(str, args)]
        self.start_timeout, self.env = start_timeout, env
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.lines: list[str] = []              # everything it printed (stdout and stderr)
        self._ready = threading.Event()

    def start(self) -> "ServerProcess":
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(self.env or {})}
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(self.start_timeout) or self.url is None:
            self.kill()
            raise RuntimeError(f"the server did not start: {' '.join(self.cmd)}\n{self.output[-3000:]}")
        return self

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = URL.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()                       # it exited before it served

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def engine_pid(self) -> int:
        """The pid of its engine process: multiprocessing's spawned child, not its resource tracker."""
        pids = [int(d) for d in filter(str.isdigit, os.listdir("/proc")) if _child_of(int(d), self.proc.pid)]
        assert len(pids) == 1, f"expected one engine process under the server, found {pids}"
        return pids[0]

    def stop(self, sig=signal.SIGTERM, timeout: float = 10.0) -> float:
        """Signal it and wait until it has exited; returns the seconds that took."""
        t0 = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(f"the server did not exit within {timeout} s of {sig!r}:\n{self.output[-3000:]}")
        return time.perf_counter() - t0

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _child_of(pid: int, parent: int) -> bool:
    """Whether ``pid`` is a running engine process under ``parent`` (from /proc: no psutil)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmd = Path(f"/proc/{pid}/cmdline").read_text()
    except (OSError, IndexError):
        return False
    return int(stat[1]) == parent and stat[0] != "Z" and "spawn_main" in cmd and "resource_tracker" not in cmd
