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
fresh child. The parent watches each grader's start (the child's records): one that outlives its
bound where no thread's stop can land (a C call holding the interpreter) is killed, named so. The
child's memory is capped (``forked.MEMORY`` past its start-up), so a piece that allocates
without end fails with MemoryError; and what it grades with is taken before the package is imported,
so a package replacing the graders in ``sys.modules`` changes nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orca_lab.course import forked, mine
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


# ``run``: the bound as this module was imported (a default, taken then): a package that replaces
# ``run_bounded`` in ``sys.modules`` when it is imported does not unbound its own grading.
def _verdict(grader, objects, what: str, chapter: str, timeout_s: float | None, run=run_bounded) -> str:
    try:
        with contextlib.redirect_stdout(io.StringIO()):          # each grader's "correct: ..." line
            run(grader, *objects, timeout_s=GRADE_S if timeout_s is None else timeout_s,
                case=f"chapter {chapter}'s grader", what=what)
    except MemoryError:
        return f"failed: MemoryError: it ran out of memory (a grading child may allocate {forked.MEMORY >> 30} GiB past its start)"
    except Exception as e:                  # noqa: BLE001  (any failure of the learner's code is a verdict)
        return f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return PASSED


def _takes(name: str, table=PIECES) -> tuple:
    """The pieces ``name``'s grader takes: itself, or those its chapter grades with it."""
    return table[name].graded or (name,)


def _graders():
    """What grading reads of this module and ``plug.PIECES``, taken apart from them: a package whose
    import replaces ``_verdict`` or a grader there (``sys.modules``) changes nothing taken before."""
    return dict(PIECES), _verdict           # (a harness.Piece is frozen: the copy of the table is enough)


def _graded(pieces: dict, names, timeout_s: float | None, before=lambda takes: None, graders=None):
    """(name, its grader's verdict now) for each of ``names``, each grader run once on ``pieces``;
    ``before(takes)`` is told which pieces a grader is about to take; ``graders``: ``_graders()``,
    taken before the package was imported (default: now)."""
    table, verdict = graders or _graders()
    runs = {}
    for name in names:
        piece, takes = table[name], _takes(name, table)
        if any(n not in pieces for n in takes):
            yield name, "missing"
            continue
        if (piece.check, takes) not in runs:
            before(takes)
            runs[piece.check, takes] = verdict(piece.check, [pieces[n] for n in takes], " and ".join(takes),
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
    (``os._exit``, a crash in C), or is killed for a grader stuck past its bound, fails the pieces that
    grader takes, saying how it ended; the rest are graded in a fresh child."""
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
            code, overran = _watch(proc, out, bound)
        records = _records(out)
        nows.update((r["name"], r["now"]) for r in records if "name" in r)
        started = any("grading" in r for r in records)
        if overran:
            return started, (f"its grader ran past its bound of {bound:g} s and its process was killed (a call "
                             "that never came back to Python, which a thread cannot stop: a long C call, a sleep)")
        return started, _ended(code, err.read_bytes()[-4000:].decode(errors="replace"), started)


START_S = 60.0      # a grading child's start-up: importing torch, the package and the graders
SLACK_S = 10.0      # past a grader's own bound (its thread's stop, then its verdict), before the kill


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")] if out.exists() else []


def _watch(proc, out: Path, bound: float) -> tuple[int, bool]:
    """Wait for a grading child, each grader within its own bound (``out``'s records say when each
    began): a grader past ``bound + SLACK_S`` is stuck where its thread's stop cannot land (a C call
    holding the interpreter), so the child is killed. Its exit code, and whether it was killed so."""
    seen, since = 0, time.monotonic()
    while True:
        try:
            return proc.wait(timeout=0.5), False
        except subprocess.TimeoutExpired:
            pass
        n = len(_records(out))
        if n != seen:
            seen, since = n, time.monotonic()
        if time.monotonic() - since > (bound + SLACK_S if seen else START_S):
            proc.kill()
            return proc.wait(), True


def _ended(code: int, stderr: str, started: bool) -> str:
    """How a grading child ended, in words: its exit code or signal, and its last error line."""
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    where = "while grading it" if started else "before any grader ran: importing the package"
    return f"its grader's process {forked.how_it_ended(code)}, {where}" + (
        f"; its last error line: {last[:300]}" if last else "")


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
    graders = _graders()                # before the package's own code runs
    forked.inside = True                # this child is the graders' process: they need no fork of their own
    forked.bound_memory(forked.MEMORY)
    pieces = mine.load(args.where)
    with open(args.out, "a") as out:
        def note(**record):
            out.write(json.dumps(record) + "\n")
            out.flush()

        for name, now in _graded(pieces, args.names, args.timeout, lambda takes: note(grading=list(takes)), graders):
            note(name=name, now=now)


if __name__ == "__main__":
    _main()
