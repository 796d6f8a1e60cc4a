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
  stop it) is killed, ``Stuck``. The child leads a process group of its own, killed whole once the
  verdict is in: what the learner's code started goes with it, and a signal it sends its group
  never reaches the kernel.
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
    _own_group(pid)
    try:
        report, code = _wait(r, pid)
    finally:            # a verdict, a bound passed or Ctrl-C: the grader goes, with whatever it started
        os.close(r)
        _kill_group(pid)
    if code is OVERRAN:
        raise Stuck(f"the grader's process ran past {BOUND_S:g} s and was killed: your code is stuck where no "
                    "case's bound can stop it (a C call that never returns to Python: a sleep, a lock, a "
                    "blocking read)")
    done = _parsed(report)
    if done is None:
        how = (f"sent more than {MAX_REPORT:,} bytes and was killed" if code is TOO_MUCH else
               "exited without one: your code wrote into, or closed, the pipe its verdict goes through"
               if code == 0 else how_it_ended(code))
        raise Ended(f"the grader's process ended before its verdict: it {how}")
    print(done["printed"], end="")
    if done["error"] is not None:
        raise _rebuilt(done["error"])


OVERRAN, TOO_MUCH = "overran", "too much"       # how a child ended when the caller killed it
NO_REPORT = 70                                  # a child's exit code when even its report failed


def _own_group(pid: int):
    """The child leads a process group of its own (set on both sides: whichever runs first): what
    it starts goes with it, and a signal it sends to its group never reaches the caller."""
    try:
        os.setpgid(pid, pid)
    except OSError:                 # it has set it already, or ended
        pass


def _kill_group(pid: int):
    """The child's group killed (what the learner's code started, the child if still there), the
    child reaped."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:                 # the group is gone
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:       # reaped already
        pass


def _child(w: int, check, args, kwargs):
    """The fork: grade, report, exit (``os._exit``: nothing of the caller's, its atexit, its kernel's
    sockets, runs here)."""
    global inside
    inside = True
    code = NO_REPORT
    try:
        os.setpgid(0, 0)
        torch.set_num_threads(1)        # the caller's OpenMP threads are not in the fork: a parallel region would hang
        faulthandler.disable()          # a crash is named by the caller; the kernel's log gets no dump of it
        sys.stdout = sys.stderr = printed = _Printed()
        bound_memory(MEMORY)
        error = None
        try:
            check(*args, **kwargs)
        except BaseException as e:      # noqa: BLE001  (reported, raised again in the caller)
            error = _reduced(e)
        with os.fdopen(w, "wb") as out:
            out.write(json.dumps({"printed": printed.text(), "error": error}).encode())
        code = 0
    finally:
        os._exit(code)


class _Printed(io.TextIOBase):
    """What a grading process prints, its first ``MAX_PRINTED`` characters kept, the rest counted."""

    def __init__(self):
        self.kept, self.lost = io.StringIO(), 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        room = max(MAX_PRINTED - self.kept.tell(), 0)
        self.kept.write(s[:room])
        self.lost += max(len(s) - room, 0)
        return len(s)

    def text(self) -> str:
        more = f"\n... and {self.lost:,} characters more, not shown\n" if self.lost else ""
        return self.kept.getvalue() + more


def _reduced(e: BaseException) -> dict:
    """``e`` as plain text: its type's place, its message (its own ``__str__`` run under a bound),
    its notes, and the traceback's last ``MAX_TRACE`` characters. Reading ``e`` runs the learner's
    code: what fails to read is said so."""
    try:
        kind = type(e)
        module, name = getattr(kind, "__module__", None), getattr(kind, "__qualname__", None)
        notes = getattr(e, "__notes__", None)
        notes = [n[:MAX_TRACE] for n in notes if type(n) is str][:MAX_NOTES] if isinstance(notes, list) else []
        trace = "".join(traceback.format_tb(e.__traceback__))
        traceback.clear_frames(e.__traceback__)     # what the frames held (all of memory, after a MemoryError) goes
        if isinstance(e, MemoryError):
            notes.append(f"(a grader's process may allocate {MEMORY >> 30} GiB past what its caller holds)")
        return {"module": _name(module), "name": _name(name), "notes": notes, "trace": trace[-MAX_TRACE:],
                "text": as_text(str, e, "its error")[:MAX_PRINTED]}
    except Exception as failed:       # noqa: BLE001
        return {"module": "", "name": "an exception", "notes": [], "trace": "",
                "text": f"its type or traceback could not be read ({type(failed).__name__})"}


def _name(x) -> str:
    return x[:200] if type(x) is str else "?"


REPORT = {"printed": str, "error": (dict, type(None))}
ERROR = {"module": str, "name": str, "text": str, "notes": list, "trace": str}


def _parsed(report: bytes) -> dict | None:
    """The child's report, or None where it is not one (cut, forged in another shape, no JSON)."""
    try:
        done = json.loads(report)
    except (ValueError, RecursionError):
        return None
    shaped = lambda d, shape: type(d) is dict and all(isinstance(d.get(k), t) for k, t in shape.items())  # noqa: E731
    if not shaped(done, REPORT) or (done["error"] is not None and not (
            shaped(done["error"], ERROR) and all(type(n) is str for n in done["error"]["notes"]))):
        return None
    return done


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


def _wait(fd: int, pid: int) -> tuple[bytes, int | str | None]:
    """What the child sent, and how it ended: its exit code (minus a signal's number); None where
    that is lost (this process ignores SIGCHLD); ``OVERRAN`` past ``BOUND_S`` or ``TOO_MUCH`` past
    ``MAX_REPORT`` bytes, still running. Its end is watched, not only its pipe's: a process the
    learner's code started may hold the pipe open after the child is gone."""
    poller, report, deadline, closed = select.poll(), bytearray(), time.monotonic() + BOUND_S, False
    poller.register(fd, select.POLLIN)
    while len(report) <= MAX_REPORT:
        if not closed and poller.poll(100):
            chunk = os.read(fd, 1 << 16)
            report += chunk
            closed = not chunk
            continue
        ended, code = _ended(pid)
        if ended:
            while len(report) <= MAX_REPORT and poller.poll(0) and (chunk := os.read(fd, 1 << 16)):
                report += chunk
            return bytes(report), code if len(report) <= MAX_REPORT else TOO_MUCH
        if time.monotonic() > deadline:
            return bytes(report), OVERRAN
        if closed:
            time.sleep(0.05)
    return bytes(report), TOO_MUCH


def _ended(pid: int) -> tuple[bool, int | None]:
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:       # reaped by the system: this process ignores SIGCHLD
        return True, None
    return got == pid, os.waitstatus_to_exitcode(status) if got == pid else None


def how_it_ended(code: int | None) -> str:
    """How a grading process ended, in words, from its exit code (minus a signal's number; None: lost)."""
    if code is None:
        return "ended, and how is lost: this process ignores SIGCHLD, so the system reaped it"
    if code < 0:
        name = signal.Signals(-code).name
        return f"was killed by {name}" + (
            " (a crash in C: a recursion past the C stack, or memory it may not touch)" if name == "SIGSEGV" else
            " (from outside: the system out of memory, or a limit it set itself)" if name == "SIGKILL" else "")
    if code == NO_REPORT:
        return f"exited with code {code}: it could not write its verdict"
    return f"exited with code {code} (os._exit, sys.exit from a thread, or a crash)"


def bound_memory(extra: int):
    """This process's memory capped at what it holds now plus ``extra``, for good (the hard limit too):
    code that allocates without end gets MemoryError (torch: "can't allocate memory"), not the
    machine's memory. The data limit, not the address space: CUDA and torch reserve address space
    they never fill."""
    import resource
    data = int(Path("/proc/self/statm").read_text().split()[5]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_DATA, (data + extra, data + extra))
