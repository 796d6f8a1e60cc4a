"""The capstone's check of the learner's package before it is assembled: every piece graded again by
its chapter's grader, bounded, beside the verdict its chapter's grader gave when the piece was saved
(``mine.verdicts``). A piece is done when both passed; any other (missing, a stub, a grader that
failed or was never run, one that fails now) stops the capstone naming the piece and its chapter.

Which grader checks which piece is the chapters' own declaration (``plug.PIECES``: each piece's
chapter, grader and the pieces the grader takes). Pieces graded together (``split_linear`` and
``all_reduce``) share one run of their grader.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io

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


def regrade(pieces: dict, saved: dict, names=tuple(PIECES), timeout_s: float | None = None) -> list[Verdict]:
    """Each of ``names``: its verdict when saved (``saved``: ``mine.verdicts()``) and its grader's now,
    run on ``pieces`` (``mine.load()``), bounded by ``timeout_s`` (default ``GRADE_S``) per grader."""
    runs, out = {}, []
    for name in names:
        piece = PIECES[name]
        chapter, grader, takes = piece.chapter, piece.check, piece.graded or (name,)
        if any(n not in pieces for n in takes):
            out.append(Verdict(name, chapter, saved.get(name, "missing"), "missing"))
            continue
        if (grader, takes) not in runs:
            runs[grader, takes] = _verdict(grader, [pieces[n] for n in takes], " and ".join(takes), chapter, timeout_s)
        out.append(Verdict(name, chapter, saved.get(name, "missing"), runs[grader, takes]))
    return out


def check(pieces: dict, saved: dict, **kwargs) -> list[Verdict]:
    """``regrade``, printed piece by piece; ``NotDone`` naming each piece not done and its chapter."""
    report = regrade(pieces, saved, **kwargs)
    print("\n".join(p.line() for p in report))
    left = [p for p in report if not p.done]
    if left:
        raise NotDone("not done: " + "; ".join(f"{p.name} (chapter {p.chapter})" for p in left)
                      + ". Run each one's %%exercise cell, then the check after it until it prints correct")
    return report
