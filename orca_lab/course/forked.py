"""A chapter's grader run in a fork of the process that calls it (a notebook's kernel), as nbgrader
runs a notebook in a kernel of its own: the learner's code there can end its process (``os._exit``,
a crash in C such as a recursion past the C stack) or allocate without end, and the kernel lives on
to name how the grader's process ended. A thread (``bounded.run_bounded``) still bounds each case
inside the fork and names it; this adds what a thread cannot bound.

- ``@grader`` wraps a ``check_*`` that runs the learner's code. Its call forks; the child caps its
  memory (``MEMORY`` past the caller's), runs the grader, and hands back what it printed (cut at
  ``MAX_PRINTED`` characters) and the error it raised, if any, as JSON: the caller reads no pickle,
  so nothing of the learner's runs in it. The caller prints the one and raises the other again (its
  type when it is a builtin's or the course's, else ``Raised``), with the child's traceback as a note.
- A child that ends without a verdict raises ``Ended``, saying how (``how_it_ended``); one still
  running after ``BOUND_S`` (a C call that never returns to Python, where a case's thread cannot
  stop it) is killed, ``Stuck``.
- No fork off Linux (Windows has none; on macOS a fork of a process that used Apple's libraries, as
  torch's BLAS does, may crash), inside a grading process already (``inside``: a fork, or
  ``regrade``'s child), or once CUDA has started (a forked child cannot use it): there the grader
  runs in its caller, each case bounded by its thread alone.
"""
from __future__ import annotations

import builtins
import faulthandler
import functools
import io
import json
import os
import select
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from orca_lab.course.harness import Stuck, as_text

BOUND_S = 300.0             # a grader's whole run in its fork (each of its cases has its own, shorter bound)
MEMORY = 4 << 30            # memory a grading process may allocate past its parent's (the graders' models are tiny)
MAX_PRINTED = 20_000        # characters of what a grading process printed that come back
MAX_TRACE = 4_000           # characters of the child's traceback shown (and of each note)
MAX_NOTES = 8               # notes of the child's error shown
MAX_REPORT = 1 << 20        # bytes a child may send (a report's parts are capped well below): past it, it is killed

inside = False              # this process grades apart already: its graders run here


class Ended(AssertionError):
    """The grader's process ended before it gave a verdict."""


class Raised(AssertionError):
    """The learner's code raised an exception of a type of its own (named in the message)."""


def grader(check):
    """``check`` (a chapter's grader, which prints ``correct`` or raises) run in a fork of its caller."""
    @functools.wraps(check)
    def apart(*args, **kwargs):
        if inside or sys.platform != "linux" or torch.cuda.is_initialized():
            return check(*args, **kwargs)
        return _in_fork(check, args, kwargs)
    return apart


def _in_fork(check, args, kwargs):
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(w, check, args, kwargs)          # never returns
    os.close(w)
    try:
        report, ended = _read(r)
    except BaseException:                       # the kernel interrupted (Ctrl-C): the grader goes too
        _kill(pid)
        raise
    finally:
        os.close(r)
    code = _status(os.waitpid(pid, 0)[1]) if ended else _kill(pid)
    if not ended and len(report) <= MAX_REPORT:
        raise Stuck(f"the grader's process ran past {BOUND_S:g} s and was killed: your code is stuck where no "
                    "case's bound can stop it (a C call that never returns to Python: a sleep, a lock, a "
                    "blocking read)")
    try:
        done = json.loads(report)
    except ValueError:
        how = f"sent more than {MAX_REPORT:,} bytes and was killed" if len(report) > MAX_REPORT else how_it_ended(code)
        raise Ended(f"the grader's process ended before its verdict: it {how}") from None
    print(done["printed"], end="")
    if done["error"] is not None:
        raise _rebuilt(done["error"])


def _child(w: int, check, args, kwargs):
    """The fork: grade, report, exit (``os._exit``: nothing of the caller's, its atexit, its kernel's
    sockets, runs here)."""
    global inside
    inside = True
    try:
        torch.set_num_threads(1)        # the caller's OpenMP threads are not in the fork: a parallel region would hang
        faulthandler.disable()          # a crash is named by the caller; the kernel's log gets no dump of it
        sys.stdout = sys.stderr = printed = _Printed()
        bound_memory(MEMORY)
        error = None
        try:
            check(*args, **kwargs)
        except BaseException as e:      # noqa: BLE001  (reported, raised again in the caller)
            error = _reduced(e)
        report = json.dumps({"printed": printed.text(), "error": error}).encode()
        with os.fdopen(w, "wb") as out:
            out.write(report)
    finally:
        os._exit(0)


class _Printed(io.TextIOBase):
    """What a grading process prints, its first ``MAX_PRINTED`` characters kept, the rest counted."""

    def __init__(self):
        self.kept, self.lost = io.StringIO(), 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        room = MAX_PRINTED - self.kept.tell()
        self.kept.write(s[:max(room, 0)])
        self.lost += max(len(s) - max(room, 0), 0)
        return len(s)

    def text(self) -> str:
        more = f"\n... and {self.lost:,} characters more, not shown\n" if self.lost else ""
        return self.kept.getvalue() + more


def _reduced(e: BaseException) -> dict:
    """``e`` as plain text: its type's place, its message (its own ``__str__`` run under a bound),
    its notes, and the traceback's last ``MAX_TRACE`` characters."""
    notes = getattr(e, "__notes__", None)
    notes = [n[:MAX_TRACE] for n in notes if type(n) is str][:MAX_NOTES] if isinstance(notes, list) else []
    trace = "".join(traceback.format_tb(e.__traceback__))
    traceback.clear_frames(e.__traceback__)     # what the frames held (all of memory, after a MemoryError) goes
    if isinstance(e, MemoryError):
        notes.append(f"(a grader's process may allocate {MEMORY >> 30} GiB past what its caller holds)")
    return {"module": type(e).__module__, "name": type(e).__qualname__, "notes": notes, "trace": trace[-MAX_TRACE:],
            "text": as_text(str, e, "its error")[:MAX_PRINTED]}


def _rebuilt(error: dict) -> BaseException:
    """The child's error again: of its own type where that is a builtin's or the course's (made from
    its message alone), else ``Raised`` naming it."""
    kind = _known(error["module"], error["name"])
    try:
        e = kind(error["text"]) if kind is not None else None
    except Exception:                   # noqa: BLE001  (a type that takes more than a message)
        e = None
    if e is None:
        e = Raised(f"{error['name']}: {error['text']}")
    for note in error["notes"]:
        e.add_note(note)
    if error["trace"]:
        e.add_note("in the grader's process:\n" + error["trace"].rstrip())
    return e


def _known(module: str, name: str):
    """The exception type named, where it is a builtin's or the course's own (``orca_lab``): an
    ``Exception``, never one that would end the kernel's cell some other way."""
    if module == "builtins":
        kind = getattr(builtins, name, None)
    elif module.split(".")[0] == "orca_lab" and module in sys.modules:
        kind = sys.modules[module]
        for part in name.split("."):
            kind = getattr(kind, part, None)
    else:
        return None
    return kind if isinstance(kind, type) and issubclass(kind, Exception) else None


def _read(fd: int) -> tuple[bytes, bool]:
    """What the child sent, and whether it closed its end (it ended) before ``BOUND_S`` passed and
    before it sent more than ``MAX_REPORT`` bytes."""
    report, deadline = bytearray(), time.monotonic() + BOUND_S
    while (left := deadline - time.monotonic()) > 0 and len(report) <= MAX_REPORT:
        if select.select([fd], [], [], min(left, 1.0))[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return bytes(report), True
            report += chunk
    return bytes(report), False


def _kill(pid: int) -> int:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return _status(os.waitpid(pid, 0)[1])


def _status(status: int) -> int:
    """A ``waitpid`` status as ``Popen.returncode`` reads it: the exit code, or minus the signal."""
    return os.waitstatus_to_exitcode(status)


def how_it_ended(code: int) -> str:
    """How a grading process ended, in words, from its exit code (minus a signal's number)."""
    if code < 0:
        name = signal.Signals(-code).name
        return f"was killed by {name}" + (
            " (a crash in C: a recursion past the C stack, or memory it may not touch)" if name == "SIGSEGV" else
            " (by the system: out of memory?)" if name == "SIGKILL" else "")
    return f"exited with code {code} (os._exit, sys.exit from a thread, or a crash)"


def bound_memory(extra: int):
    """This process's memory capped at what it holds now plus ``extra``, for good (the hard limit too):
    code that allocates without end gets MemoryError (torch: "can't allocate memory"), not the
    machine's memory. The data limit, not the address space: CUDA and torch reserve address space
    they never fill."""
    import resource
    data = int(Path("/proc/self/statm").read_text().split()[5]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_DATA, (data + extra, data + extra))
