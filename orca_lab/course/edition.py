"""The site's two editions of a course notebook, made from the solved notebook once it has run.

- ``learner`` (the default site): the learner's notebook (``notebooks/NN_*.ipynb``), its exercises
  stubs, no solution anywhere. The stubs cannot run to a chapter's end, so the outputs come from the
  solved notebook's run, cell by cell (same cell ids: ``solve`` replaces exercise sources only), and
  a learner reading the page still sees every figure the chapter builds. What a solution alone
  prints is kept apart: an exercise cell shows no output, a grader's cell (its verdict, ``correct``)
  shows none either, and every output after the chapter's first exercise is labelled as the
  reference solution's, since it may read names the exercises define.
- ``instructor``: the solved notebook as it ran, every solution on the page.

Each exercise cell is announced by a box (``EXERCISE``) naming the exercise, its task (the stub's
``NotImplementedError`` message) and the grader that checks it; ``course.css`` styles the box and the
exercise cell itself (myst-nb gives it the class ``tag_exercise:<id>``).
"""
from __future__ import annotations

import copy
import re

import nbformat

from orca_lab.course import solve

EDITIONS = ("learner", "instructor")
GRADER = re.compile(r"\b((?:ch\d\d|harness)\.check_\w+)\(|\bprint\(f?[\"']correct")   # a chapter module's check_*
TASK = re.compile(r"raise NotImplementedError\((['\"])(.*?)\1\)")
REFERENCE = ('<p class="orca-reference">Output of the reference solution '
             '(<code>notebooks/solutions/</code>): your own code may print otherwise.</p>')
# a tilde fence: a backtick fence's info string (the box's title) may hold no backtick
EXERCISE = """~~~{{admonition}} Exercise `{ex}`
:class: orca-exercise

{task}

Write it in the next cell, in place of `# YOUR CODE HERE` and its `raise NotImplementedError`;
{grader}.
~~~"""


def is_grader(cell) -> bool:
    return cell.cell_type == "code" and bool(GRADER.search(cell.source))


def grader_of(nb, index: int) -> str:
    """How the exercise at ``index`` is checked: the grader the next grading cell calls."""
    for cell in nb.cells[index + 1:]:
        if is_grader(cell):
            found = GRADER.search(cell.source).group(1)
            return f"`{found}` checks it" if found else "the cell after it checks your answer"
    return "the cells after it use it"


def exercise_box(nb, index: int, ex: str) -> dict:
    stub = nb.cells[index].source
    task = TASK.search(stub)
    text = task.group(2) if task else stub.split("# YOUR CODE HERE", 1)[-1].strip() or ex
    box = nbformat.v4.new_markdown_cell(EXERCISE.format(ex=ex, task=text, grader=grader_of(nb, index)))
    box.id = f"{nb.cells[index].get('id', ex)}-box"[:64]     # the same each build
    return box


def learner(learner_nb, ran) -> dict:
    """The learner's notebook with the outputs of ``ran`` (its solved notebook, executed)."""
    nb = copy.deepcopy(learner_nb)
    by_id = {c.get("id"): c for c in ran.cells}
    exercise_cells = dict(solve.exercises(nb))
    first = min(exercise_cells, default=len(nb.cells))
    cells = []
    for i, cell in enumerate(nb.cells):
        if i in exercise_cells:
            cells.append(exercise_box(nb, i, exercise_cells[i]))
        if cell.cell_type == "code":
            source = by_id.get(cell.get("id"))
            if source is None:
                raise ValueError(f"cell {cell.get('id')!r} of the learner notebook is not in the executed one: "
                                 "execute the solved notebooks again (drop --executed)")
            cell.outputs, cell.execution_count = [], None
            if i not in exercise_cells and not is_grader(cell):
                cell.outputs = copy.deepcopy(source.get("outputs", []))
                if i > first and cell.outputs:
                    cell.outputs.insert(0, nbformat.v4.new_output("display_data", data={"text/html": REFERENCE}))
        cells.append(cell)
    nb.cells = cells
    nb.metadata = copy.deepcopy(ran.metadata)   # the widget state its outputs need (figures.prepare reads it)
    return nb


def make(edition: str, learner_nb, ran):
    """The page's notebook of ``edition``: the instructor's is the solved notebook as it ran."""
    check(edition)
    return learner(learner_nb, ran) if edition == "learner" else ran


def check(edition: str):
    if edition not in EDITIONS:
        raise ValueError(f"edition: {edition!r} is not one of {', '.join(EDITIONS)}")
