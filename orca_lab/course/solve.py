"""Build the solved notebooks: the learner's notebooks with each exercise's solution merged in.

The notebooks in ``notebooks/`` hold the learner's version: an exercise is a code cell tagged
``exercise:<id>`` holding ``# YOUR CODE HERE`` and a ``raise NotImplementedError``, followed by the
cell that checks it; one that writes a piece of the learner's engine opens with ``%%exercise <id>``
(``mine.py``), a line the merge keeps. The solutions live apart, in ``notebooks/solutions/<notebook>.py``, one section
per exercise, each opened by a line ``# %% exercise: <id>``. Every notebook of the course is written
to the build folder, solved where it has exercises (a notebook without any is copied as it is)::

    python -m orca_lab.course.solve                  # -> build/solved/*.ipynb
    python -m orca_lab.course.solve --out DIR 03_iteration_level_scheduling
"""
from __future__ import annotations

import argparse
import copy
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
SOLUTIONS = NOTEBOOKS / "solutions"
TAG = "exercise:"
SECTION = re.compile(r"^# %% exercise: (\S+)[ \t]*$", re.M)
STUB = ("# YOUR CODE HERE", "raise NotImplementedError(")


def course(folder: Path = NOTEBOOKS) -> list[Path]:
    """The course's notebooks, in chapter order: each ``NN_name.ipynb`` solved in ``solutions/``, or
    with no exercise. Another one (a learner's copy, ``02_mine.ipynb``) is none of the course's."""
    return [p for p in _numbered(folder) if _of_the_course(p)]


def strays(folder: Path = NOTEBOOKS) -> list[Path]:
    """The notebooks named like chapters that are none of the course's (``course``)."""
    return [p for p in _numbered(folder) if not _of_the_course(p)]


def _numbered(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("[0-9][0-9]_*.ipynb"))


def _of_the_course(notebook: Path) -> bool:
    return solution_file(notebook).exists() or not exercises(load(notebook))


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def dump(nb: dict, path: Path):
    Path(path).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def exercise_id(cell: dict) -> str | None:
    tags = [t for t in cell.get("metadata", {}).get("tags", []) if t.startswith(TAG)]
    return tags[0][len(TAG):] if tags else None


def exercises(nb: dict) -> list[tuple[int, str]]:
    """``(cell index, exercise id)`` of each exercise cell, in order."""
    return [(i, ex) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and (ex := exercise_id(c))]


def solutions(path: Path) -> dict[str, str]:
    """Exercise id -> the solution's source, from a solutions file's sections."""
    parts = SECTION.split(Path(path).read_text())
    if parts[0].strip() and not parts[0].lstrip().startswith('"""'):
        raise ValueError(f"{path}: text before the first '# %% exercise: <id>' line")
    found = {}
    for ex, body in zip(parts[1::2], parts[2::2]):
        if ex in found:
            raise ValueError(f"{path}: exercise {ex!r} is solved twice")
        found[ex] = body.strip("\n") + "\n"
    return found


def solution_file(notebook: Path) -> Path:
    """``solutions/<stem>.py`` beside the notebook (``SOLUTIONS`` for the course's own)."""
    return Path(notebook).parent / SOLUTIONS.name / f"{Path(notebook).stem}.py"


def solve(nb: dict, answers: dict[str, str], name: str = "notebook") -> dict:
    """``nb`` with each exercise cell's source replaced by its solution; every exercise needs one,
    and every solution an exercise."""
    out = copy.deepcopy(nb)
    ids = [ex for _, ex in exercises(out)]
    missing, extra = set(ids) - set(answers), set(answers) - set(ids)
    if missing or extra:
        raise ValueError(f"{name}: exercises without a solution {sorted(missing)}, "
                         f"solutions without an exercise {sorted(extra)}")
    for i, ex in exercises(out):
        magic = "".join(out["cells"][i]["source"]).splitlines(keepends=True)[:1]
        magic = magic if magic and magic[0].startswith("%%exercise") else []    # kept: it saves the answer
        out["cells"][i]["source"] = magic + answers[ex].splitlines(keepends=True)
        out["cells"][i]["source"][-1] = out["cells"][i]["source"][-1].rstrip("\n")
    return out


def solved(notebook: Path) -> dict:
    nb = load(notebook)
    if not exercises(nb):
        return nb
    path = solution_file(notebook)
    if not path.exists():
        raise ValueError(f"{Path(notebook).name} has exercises {[ex for _, ex in exercises(nb)]} and no "
                         f"solutions file: write {path}, one '# %% exercise: <id>' section each")
    return solve(nb, solutions(path), Path(notebook).name)


def until_first_exercise(nb: dict) -> dict:
    """The learner's notebook up to its first exercise: run, it must stop there with a
    ``NotImplementedError``. An exercise that raises at its top level (an answer to fill in) stops
    in its own cell; one that defines a function stops in the next code cell, which checks it."""
    first = exercises(nb)[0][0]
    cells = nb["cells"]
    last = first
    if not any(line.startswith("raise NotImplementedError") for line in "".join(cells[first]["source"]).splitlines()):
        last = next(i for i in range(first + 1, len(cells)) if cells[i]["cell_type"] == "code")
    return {**nb, "cells": cells[:last + 1]}


def build(out: Path, names=None, folder: Path = NOTEBOOKS) -> list[Path]:
    """Write the solved notebooks of the course in ``folder`` (all, or those whose stem is in
    ``names``) to ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [p for p in course(folder) if not names or p.stem in names]
    for p in paths:
        dump(solved(p), out / p.name)
    return [out / p.name for p in paths]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="notebook stems (default: all)")
    ap.add_argument("--out", default=str(ROOT / "build" / "solved"), help="folder to write to")
    args = ap.parse_args(argv)
    for p in build(Path(args.out), args.names):
        print(p)


if __name__ == "__main__":
    main()
