"""The learner's pieces, as the chapters declare them, plugged all at once: the capstone's engine,
and ``orca-lab serve --plugins``'s.

Each chapter of the course is one module, ``chNN_<the notebook's name>.py``, holding its graders
(``check_*``), their hints, its plug points (``use_*``: the learner's function runs in place of the
package's piece, and the package does the rest) and ``PIECES``, a ``harness.Piece`` for each piece of
the learner's engine it writes. ``PIECES`` here gathers them all, by name, in the chapters' order;
``PIECES[name].grade(pieces)`` runs its chapter's grader on the learner's ``pieces`` (``mine.load()``).
A new chapter is a new module (and its notebook): nothing here changes.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
import re

from orca_lab import course
from orca_lab.course.guards import guarded, watched

CHAPTER = re.compile(r"ch\d\d_\w+")


def chapter_modules() -> list:
    """The course's chapter modules, in the chapters' order."""
    names = sorted(m.name for m in pkgutil.iter_modules(course.__path__) if CHAPTER.fullmatch(m.name))
    return [importlib.import_module(f"{course.__name__}.{name}") for name in names]


# the learner's pieces, by the name their exercise gives them: the chapter that writes and grades it,
# where it goes, its grader and its plug point
PIECES = {piece.name: piece for module in chapter_modules() for piece in getattr(module, "PIECES", ())}


def assemble(engine, pieces: dict, tensor_ranks: int = 1, bound_s: float | None = None, **options) -> list[str]:
    """Plug every piece of ``pieces`` (``mine.load()``) that ``engine`` (fresh) has a place for, in the
    chapters' order; the names plugged, in order. ``tensor_ranks`` (and ``options``) go to each piece's
    ``place``: above 1, the model runs on that many tensor-parallel ranks cut by the learner's split
    (refused, a ``ValueError``, without their ``split_linear`` and ``all_reduce``). Each piece runs
    bounded by ``bound_s`` a call and checked (``guards.py``): a fault stops the engine naming it. The
    engine's ``run`` goes on in a thread of its own (``guards.watched``), so a piece blocked where no
    stop lands still ends it, named."""
    pieces, plugged = guarded(pieces, bound_s), []
    engine.run = functools.partial(watched, engine.run)
    for piece in PIECES.values():
        names = piece.plugged or (piece.name,)
        if piece.place is None or names[0] in plugged:
            continue
        keywords = piece.place(engine, pieces, tensor_ranks=tensor_ranks, **options)
        if keywords is not None and all(n in pieces for n in names):
            piece.use(engine, *(pieces[n] for n in names), **keywords)
            plugged.extend(names)
    return plugged
