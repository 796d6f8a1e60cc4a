"""The capstone's check of the learner's package before it is assembled: every piece graded again by
its chapter's grader, bounded, beside the verdict its chapter's grader gave when the piece was saved
(``mine.verdicts``). A piece is done when both passed; any other (missing, a stub, a grader that
failed or was never run, one that fails now) stops the capstone naming the piece and its chapter.

Which grader checks which piece is the chapters' own declaration (``plug.PIECES``: each piece's
chapter, grader and the pieces the grader takes). Pieces graded together (``split_linear`` and
``all_reduce``) share one run of their grader.

The capstone grades the saved package apart (``apart``), in a child process, as nbgrader grades in a
kernel of its own: a thread can stop a loop but not code that ends its process (``os._exit``, a crash
in C such as a recursion past the C stack), and what the learner prints goes nowhere. A child that
ends fails the piece it was grading, named with how it ended; the pieces after it are graded in a
fresh child.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from orca_lab.course import mine
from orca_lab.course.bounded import run_bounded
from orca_lab.course.mine import PASSED
from orca_lab.course.plug import PIECES

GRADE_S = 120.0      # one grader's whole run (each of its cases has its own, shorter bound)


class NotDone(AssertionError):
    """Pieces of the learner's package that are not done, each named with its chapter."""


@dataclasses.dataclass
class Verdict:
    name: str
    chapter: str
    saved: str          # its chapter's verdict when it was saved ("passed", "failed: ...", "not graded", "missing")
    now: str            # its grader's verdict now ("passed", "failed: ...", "missing")

    @property
    def done(self) -> bool:
        return self.saved == PASSED and self.now == PASSED

    def line(self) -> str:
        if self.done:
            return f"  {self.name:14s} chapter {self.chapter}  passed"
        why = "missing" if self.now == "missing" else (
            f"its chapter's grader: {self.saved}" if self.saved != PASSED else f"graded again: {self.now}")
        return f"  {self.name:14s} chapter {self.chapter}  NOT DONE ({why})"


def _verdict(grader, objects, what: str, chapter: str, timeout_s: float | None) -> str:
    try:
        with contextlib.redirect_stdout(io.StringIO()):          # each grader's "correct: ..." line
            run_bounded(grader, *objects, timeout_s=GRADE_S if timeout_s is None else timeout_s,
                        case=f"chapter {chapter}'s grader", what=what)
    except Exception as e:                  # noqa: BLE001  (any failure of the learner's code is a verdict)
        return f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return PASSED


def _takes(name: str) -> tuple:
    """The pieces ``name``'s grader takes: itself, or those its chapter grades with it."""
    return PIECES[name].graded or (name,)


def _graded(pieces: dict, names, timeout_s: float | None, before=lambda takes: None):
    """(name, its grader's verdict now) for each of ``names``, each grader run once on ``pieces``;
    ``before(takes)`` is told which pieces a grader is about to take."""
    runs = {}
    for name in names:
        piece, takes = PIECES[name], _takes(name)
        if any(n not in pieces for n in takes):
            yield name, "missing"
            continue
        if (piece.check, takes) not in runs:
            before(takes)
            runs[piece.check, takes] = _verdict(piece.check, [pieces[n] for n in takes], " and ".join(takes),
                                                piece.chapter, timeout_s)
        yield name, runs[piece.check, takes]


def regrade(pieces: dict, saved: dict, names=tuple(PIECES), timeout_s: float | None = None) -> list[Verdict]:
    """Each of ``names``: its verdict when saved (``saved``: ``mine.verdicts()``) and its grader's now,
    run in this process on ``pieces`` (``mine.load()``), bounded by ``timeout_s`` (default ``GRADE_S``)
    per grader."""
    return [Verdict(name, PIECES[name].chapter, saved.get(name, "missing"), now)
            for name, now in _graded(pieces, names, timeout_s)]


def apart(where=None, saved: dict | None = None, names=tuple(PIECES), timeout_s: float | None = None) -> list[Verdict]:
    """``regrade`` of the package at ``where`` (as ``mine.load``; default ``mine.home()``) in child
    processes, beside ``saved`` (default: its own ``mine.verdicts``). A child that ends while grading
    (``os._exit``, a crash in C) or outlives every grader's bound fails the pieces that grader takes,
    saying how it ended; the rest are graded in a fresh child."""
    where = mine.resolve(where if where is not None else mine.home())
    saved = mine.verdicts(where) if saved is None else saved
    bound = GRADE_S if timeout_s is None else timeout_s
    nows, left = {}, list(names)
    while left:
        started, how = _child(where, left, bound, nows)
        left = [n for n in left if n not in nows]
        if left:      # the grader running when it ended takes the first piece left (names run in order)
            for name in left if not started else [n for n in left if _takes(n) == _takes(left[0])]:
                nows[name] = f"failed: {how}"
            left = [n for n in left if n not in nows]
    return [Verdict(name, PIECES[name].chapter, saved.get(name, "missing"), nows[name]) for name in names]


def _child(where: str, names: list, bound: float, nows: dict) -> tuple[bool, str]:
    """One child grading ``names`` in order, their verdicts landing in ``nows`` as it gives them:
    whether it started a grader, and how it ended, in words (read only if a verdict is missing)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "verdicts.jsonl"), Path(tmp, "stderr")
        cmd = [sys.executable, "-m", "orca_lab.course.regrade", where, str(out), "--timeout", str(bound), *names]
        with err.open("wb") as stderr:      # its printing goes nowhere; its errors, to say how it ended
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
            try:      # every grader's own bound, and the start-up's: what only a stuck C call outlives
                code = proc.wait(timeout=len(names) * (bound + 10) + 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        nows.update((r["name"], r["now"]) for r in records if "name" in r)
        started = any("grading" in r for r in records)
        return started, _ended(code, err.read_bytes()[-4000:].decode(errors="replace"), started)


def _ended(code: int, stderr: str, started: bool) -> str:
    """How a grading child ended, in words: its exit code or signal, and its last error line."""
    if code < 0:
        name = signal.Signals(-code).name
        how = f"its grader's process was killed by {name}" + (
            " (a crash in C: a recursion past the C stack, or memory it may not touch)" if name == "SIGSEGV" else "")
    else:
        how = f"its grader's process exited with code {code} (os._exit, sys.exit from a thread, or a crash)"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    where = "while grading it" if started else "before any grader ran: importing the package"
    return f"{how}, {where}" + (f"; its last error line: {last[:300]}" if last else "")


def check(report: list[Verdict]) -> list[Verdict]:
    """A ``regrade`` or ``apart`` report, printed piece by piece; ``NotDone`` naming each piece not done
    and its chapter."""
    print("\n".join(p.line() for p in report))
    left = [p for p in report if not p.done]
    if left:
        raise NotDone("not done: " + "; ".join(f"{p.name} (chapter {p.chapter})" for p in left)
                      + ". Run each one's %%exercise cell, then the check after it until it prints correct")
    return report


def _main(argv=None):
    """The child of ``apart``: grade the named pieces of the package at ``where``, one JSON line per
    grader about to run and per verdict, flushed as each is known (a child that ends keeps them)."""
    parser = argparse.ArgumentParser(prog="python -m orca_lab.course.regrade")
    parser.add_argument("where")
    parser.add_argument("out")
    parser.add_argument("--timeout", type=float, default=GRADE_S)
    parser.add_argument("names", nargs="+", choices=list(PIECES))
    args = parser.parse_args(argv)
    pieces = mine.load(args.where)
    with open(args.out, "a") as out:
        def note(**record):
            out.write(json.dumps(record) + "\n")
            out.flush()

        for name, now in _graded(pieces, args.names, args.timeout, before=lambda takes: note(grading=list(takes))):
            note(name=name, now=now)


if __name__ == "__main__":
    _main()
