"""What every chapter's graders share (``chNN_*.py``): a ``Mismatch`` naming the case, both answers
labelled and a hint; the learner's answer read in the shape compared; a driver of the learner's code
bounded per case; the declaration of a piece of the learner's engine (``Piece``). The bound itself
and the refusal of the package's code live in ``bounded``.

A grader runs the learner's function and the package's own on seeded random cases (and the fixed
cases an off-by-one needs), side by side; on the first case where they differ it raises
``Mismatch`` (an ``AssertionError``) that names the case, labels both answers (expected: the
package's; got: the learner's) and gives a hint chosen from the symptom. Every call of the learner's
code is bounded (``bounded.run_bounded``: a wall-time guard for code that never returns, and the
graders' own loops stop after as many steps as the package's answer took, plus one), and refused if
it is, wraps or calls the package's own answer, or the grader's (``bounded.refuse_package_code``).
An exception of the learner's (``NotImplementedError`` from an exercise not written yet included)
goes through as theirs, with a note naming the case.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from orca_lab.course.bounded import Exited, TooSlow, plain, run_bounded
from orca_lab.engine.request import Request
from orca_lab.engine.sampling_params import SamplingParams

N_CASES = 40           # random cases of a grader
CASE_S = 10.0          # wall time a case driven through ``run_case`` may take (a few ms when right)


class Mismatch(AssertionError):
    """The learner's answer differs from the package's on one case."""


class Stuck(TooSlow):
    """The learner's code did not return within a case's time or iteration bound."""


def mismatch(what: str, case, expected, got, hint: str = "") -> Mismatch:
    return Mismatch(f"{what} differs on {case}:\n  expected (the package's): {_shown(expected, case)}\n  got (yours):"
                    f"              {_shown(got, case)}" + (f"\n  hint: {hint}" if hint else ""))


MAX_SHOWN = 2000        # characters of a value a message shows: a 3-million-item answer was 25 MiB of text


def _shown(value, case) -> str:
    """``value`` as text, its own ``__str__`` run under the case's bound (``as_text``), cut to
    ``MAX_SHOWN`` characters."""
    text = value if isinstance(value, str) else as_text(str, value, case)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN - 300]} ... {text[-200:]} ({len(text):,} characters)"


def differ(what: str, case, expected, got, hint: str = ""):
    raise mismatch(what, case, expected, got, hint)


def correct(n: int, against: str):
    print(f"correct: {n} random cases agree with {against}")


def read(what: str, case, got, reader, shape: str):
    """``reader(got)``: the learner's answer in the form compared; one of another shape is a mismatch
    that says which shape was expected (never a TypeError from inside the grader). Read under the
    bound: the learner's objects run code of their own when read (``__int__``, ``__iter__``)."""
    try:
        return run_case(reader, got, label=str(case))
    except (Stuck, Exited):
        raise
    except Exception:  # noqa: BLE001  (any failure to read it is the same symptom: the wrong shape)
        differ(what, case, shape, f"{shown_answer(got, case)} ({type(got).__name__})", f"return {shape}")


def shown_answer(got, case) -> str:
    """The learner's answer as its ``repr`` says (bounded: its own code), or its type alone."""
    return as_text(repr, got, case)


def as_text(how, value, case) -> str:
    """``how(value)`` (``str`` or ``repr``) under the case's bound: a learner's object runs its own code
    there, which may raise or never return; then its type says enough."""
    try:
        return run_case(how, value, label=str(case))
    except Exception:  # noqa: BLE001
        return f"a {type(value).__name__}"


def same_kind(what: str, case, expected: torch.Tensor, got: torch.Tensor):
    """``got`` of ``expected``'s dtype and device, or a mismatch naming which one differs (never a torch
    error from inside the grader's comparison, nor a float64 passing for float32). Shapes are each
    grader's to compare: a wrong one says something of its own (which dimension was split)."""
    for name in ("dtype", "device"):
        if getattr(got, name) != getattr(expected, name):
            differ(f"{what}'s {name}", case, getattr(expected, name), getattr(got, name), f"keep the inputs' {name}")


def check_by_hand(case: str, answers: dict):
    """A by-hand exercise's answers, ``{name: (yours, the package's, hint)}``: the first that differs
    is a ``Mismatch`` naming it, with the learner's value and the hint in words; never the expected
    value, which is the exercise's answer. The learner's is read as plain values first (``plain``):
    an object of theirs never compares itself with the answer (it could say equal, or keep it)."""
    for name, (yours, expected, hint) in answers.items():
        mine = plain_answer(name, case, yours)
        if mine != expected:
            raise Mismatch(f"{name} differs on {case}:\n  got (yours): {mine}\n  hint: {hint}")


def plain_answer(what: str, case, got):
    """``plain(got)``, or a ``Mismatch`` naming ``what`` and the type the learner gave."""
    try:
        return plain(got)
    except TypeError as e:
        raise Mismatch(f"{what} on {case}: yours is {e}") from None


def request(rid: int, prompt_len: int, gen: int, arrival: float = 0.0) -> Request:
    return Request(rid, [rid % 256] * prompt_len, SamplingParams(max_gen_tokens=gen), arrival=float(arrival))


def run_case(fn, *args, label: str, seconds: float | None = None, references=()):
    """``fn(*args)`` (the grader's driver of the learner's code) under ``run_bounded``, bounded by
    ``seconds`` (``CASE_S`` when None, read at the call) and refusing calls into ``references``;
    past the bound, ``Stuck`` naming ``label``."""
    try:
        return run_bounded(fn, *args, timeout_s=CASE_S if seconds is None else seconds, case=label, what="code",
                           references=references)
    except TooSlow as e:
        raise Stuck(str(e)) from None


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of the learner's engine as its chapter declares it (the chapter module's ``PIECES``);
    ``plug.PIECES`` gathers every chapter's, by ``name``, and ``plug.assemble`` plugs them."""
    name: str                      # the exercise's name for it: a key of ``mine.load()``
    chapter: str                   # the chapters that write it ("03, 08": the last grades it)
    where: str                     # where it goes, in words
    check: Callable                # its grader: check(*pieces named by ``graded``, seed=seed)
    use: Callable                  # its plug point: use(engine, *pieces named by ``plugged``, **place's keywords)
    graded: tuple = ()             # the pieces its grader takes, in order (empty: itself alone)
    plugged: tuple = ()            # the pieces its plug point takes, in order (empty: itself alone)
    place: Callable | None = None  # place(engine, pieces, **options) -> use's keywords, or None where the
    #                                engine has no place for it; None: assemble never plugs it (run_loop runs it)

    def grade(self, pieces: dict, seed: int = 0):
        """Its grader on the learner's ``pieces`` (``mine.load()``); a failure notes the piece and chapter."""
        try:
            return self.check(*(pieces[n] for n in self.graded or (self.name,)), seed=seed)
        except BaseException as e:
            e.add_note(f"(the piece {self.name} of chapter {self.chapter})")
            raise

    def __iter__(self):          # read as the pair (chapter, where), as notebook 13 does
        return iter((self.chapter, self.where))

    def __getitem__(self, i: int):
        return (self.chapter, self.where)[i]


def place_on(*systems: str, when: Callable | None = None) -> Callable:
    """A ``Piece.place``: an engine of one of ``systems`` (and ``when(engine)``, if given) has a
    place for the piece, and its plug point takes no keyword."""
    def place(engine, pieces, **options):
        fits = engine.scheduler.name in systems and (when is None or when(engine))
        return {} if fits else None
    return place
