"""The course notebooks: each runs under nbval, is stored clean, and refuses a bad parameter.

The notebooks in ``notebooks/`` are the learner's: each exercise cell raises ``NotImplementedError``
until it is written. ``python -m orca_lab.course.solve`` merges the solutions (``notebooks/solutions``)
into solved copies, and those are what runs here.

How they run: one ``python -m pytest --nbval-lax`` subprocess over the solved notebooks, as a reader
runs it by hand, and over each learner notebook cut after its first exercise, which must stop there.
nbval executes every cell, each notebook in a fresh kernel, in chapter order (chapter 13 assembles
what the earlier ones' ``%%exercise`` cells saved), and compares the outputs stored in cells
marked ``# NBVAL_CHECK_OUTPUT`` (deterministic numbers only, never timings) with the new ones. A
subprocess keeps the ``.ipynb`` collection out of this session (``testpaths = ["tests"]``); its JUnit
report gives each notebook its own pass/fail line here, with nbval's message. ``--nbval-current-env``
runs the kernels on this interpreter; ``tests/nbval_executed.py`` keeps the outputs of the run, which
the figure test renders to HTML.
"""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from orca_lab.course import solve

from helpers import execute_notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = solve.course()
IDS = [p.stem for p in NOTEBOOKS]
EXERCISED = [p for p in NOTEBOOKS if solve.exercises(json.loads(p.read_text()))]
PLOTLY = "application/vnd.plotly.v1+json"
# a value each parameter's check must refuse, by the type of its default
BAD = {int: -10**6, float: -1.0, str: 5, list: [], bool: "yes"}


def load(path):
    return json.loads(path.read_text())


def code_cells(nb):
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def parameters(nb) -> dict:
    """The ``parameters``-tagged cell's assignments, evaluated: name -> default."""
    cell = next(c for c in code_cells(nb) if "parameters" in c["metadata"].get("tags", []))
    tree = ast.parse("".join(cell["source"]))
    return {t.targets[0].id: ast.literal_eval(t.value) for t in tree.body if isinstance(t, ast.Assign)}


def test_the_course_is_all_there():
    assert IDS == ["01_generation_and_kv_cache", "02_request_level_batching", "03_iteration_level_scheduling",
                   "04_selective_batching", "05_kv_slot_manager", "06_triton_kernels",
                   "07_distributed_workers", "08_pipelined_schedules", "09_end_to_end", "10_serving",
                   "11_after_orca", "12_prefix_caching", "13_capstone"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_is_stored_clean(path):
    """Kernel ``python3`` (papermill on a fresh machine), parameters first, outputs only where
    nbval checks them, no widget state (an executed widget stores megabytes), an exercise at the end."""
    nb = load(path)
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert "widgets" not in nb["metadata"]
    cells = code_cells(nb)
    assert "parameters" in cells[0]["metadata"].get("tags", []), "the first code cell holds the parameters"
    assert "check_range" in "".join(cells[1]["source"]), "the second code cell validates them"
    for c in cells:
        src = "".join(c["source"])
        if "NBVAL_CHECK_OUTPUT" in src:        # the reference output nbval compares with
            assert c["outputs"] and all(o["output_type"] == "stream" for o in c["outputs"]), src[:80]
        else:
            assert not c["outputs"] and c["execution_count"] is None, f"stored output in: {src[:80]}"
        assert len([ln for ln in src.splitlines() if ln.strip() and not ln.strip().startswith("#")]) <= 30, \
            f"a cell with more than 30 lines of logic belongs in the package: {src[:80]}"
    if path.stem != "13_capstone":          # the capstone's exercise is the learner's whole package
        assert any("## Exercise" in "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


def heading(nb) -> str:
    """The notebook's title: its first ``# `` line."""
    return next(ln[2:] for c in nb["cells"] if c["cell_type"] == "markdown"
                for ln in "".join(c["source"]).splitlines() if ln.startswith("# "))


def test_every_cell_has_its_own_id():
    """The site pairs a learner's cell with its executed twin by id (a cell added without one broke
    the learner edition's build)."""
    for path in solve.course():
        ids = [c.get("id") for c in json.loads(path.read_text())["cells"]]
        assert all(ids) and len(set(ids)) == len(ids), path.name


def test_every_chapter_ends_with_a_link_to_the_next():
    """01 -> 02 -> ... -> 13: each chapter's last cell ends with ``**Next:** [NN · title](file): ...``,
    the next chapter's number, title and file; the last chapter has none."""
    for here, there in zip(NOTEBOOKS, NOTEBOOKS[1:]):
        last = load(here)["cells"][-1]
        link = re.search(r"(?m)^\*\*Next:\*\* \[([^]]+)\]\(([^)]+)\)[^\n]*(\n[^\n]+)*\Z", "".join(last["source"]))
        assert last["cell_type"] == "markdown" and link, f"{here.name} does not end with a **Next:** link"
        assert link[2] == there.name and heading(load(there)).startswith(link[1]), (here.name, link[0])
    assert not [c for c in load(NOTEBOOKS[-1])["cells"] if "**Next:**" in "".join(c["source"])]


def test_every_chapter_has_exercises_the_learner_writes():
    """01-12 at least (a later chapter joins by tagging its exercise cells and solving them)."""
    assert {p.stem for p in EXERCISED} >= set(IDS[:12])


@pytest.mark.parametrize("path", EXERCISED, ids=[p.stem for p in EXERCISED])
def test_exercises_are_the_learners_and_solutions_apart(path):
    """Each exercise cell holds ``# YOUR CODE HERE`` and a ``NotImplementedError`` naming what to
    write; its solution lives in ``notebooks/solutions/<notebook>.py``, within the house's 30 lines."""
    nb = load(path)
    for i, ex in solve.exercises(nb):
        src = "".join(nb["cells"][i]["source"])
        assert "# YOUR CODE HERE" in src and 'raise NotImplementedError("' in src, (ex, src)
    answers = solve.solutions(solve.solution_file(path))
    solved = solve.solve(nb, answers, path.name)              # one solution per exercise, both ways
    for i, ex in solve.exercises(solved):
        src = "".join(solved["cells"][i]["source"])
        assert "NotImplementedError" not in src and "YOUR CODE HERE" not in src, ex
        assert len([ln for ln in src.splitlines() if ln.strip() and not ln.strip().startswith("#")]) <= 30, ex


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_parameter_is_checked(path):
    """Each parameter, given a bad value, is refused by the validation cell with its name in the
    message: the same two cells papermill runs first, run here without a kernel."""
    nb = load(path)
    cells = code_cells(nb)
    params_src, check_src = ("".join(c["source"]) for c in cells[:2])
    for name, default in parameters(nb).items():
        scope = {}
        exec(params_src, scope)
        exec(check_src, scope)                      # the defaults pass
        scope[name] = BAD[type(default)]
        with pytest.raises(ValueError, match=name):
            exec(check_src, scope)


def test_papermill_stops_at_the_first_cell_on_a_bad_parameter(tmp_path):
    papermill = pytest.importorskip("papermill")
    out = tmp_path / "out.ipynb"
    with pytest.raises(papermill.PapermillExecutionError) as err:
        execute_notebook(str(ROOT / "notebooks" / "08_pipelined_schedules.ipynb"), str(out),
                                   parameters={"n_workers": 0}, kernel_name="python3", progress_bar=False)
    assert "n_workers=0 is out of range: allowed [1, 8]" in str(err.value)
    ran = [c for c in code_cells(load(out)) if c.get("execution_count")]
    assert len(ran) == 3        # parameters, papermill's injected parameters, the check that stopped


# the first test to ask for it pays for the whole run: pytest-timeout counts fixture setup (the run's
# own bound is its subprocess's timeout below)
NBVAL_S = 1700


@pytest.fixture(scope="module")
def nbval_run(tmp_path_factory):
    """One nbval run (one pytest start-up, a fresh kernel per notebook) over the solved notebooks and
    the learner notebooks cut after their first exercise; its JUnit report gives each its own test
    below, and the executed notebooks (``tests/nbval_executed.py``) feed the figure test."""
    tmp = tmp_path_factory.mktemp("nbval")
    report, executed = tmp / "report.xml", tmp / "executed"
    solved = solve.build(tmp / "solved")
    heads = []
    for p in EXERCISED:                 # <stem>.learner.ipynb: its name never contains a solved one's
        heads.append(tmp / "learner" / f"{p.stem}.learner.ipynb")
        heads[-1].parent.mkdir(exist_ok=True)
        solve.dump(solve.until_first_exercise(load(p)), heads[-1])
    # TMPDIR: a kernel is stopped without running its exit hooks, so notebook 07's forkserver socket
    # directory would stay in /tmp; here it stays in pytest's own temporary tree. ORCA_LAB_MY_ORCA: the
    # learner's package the solved notebooks' %%exercise cells write, in chapter order, and chapter 13
    # assembles (the learner notebooks, cut at their first exercise, run after it).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TMPDIR": str(tmp),
           "ORCA_LAB_MY_ORCA": str(tmp / "my_orca"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "--nbval-lax", "--nbval-current-env", "--nbval-cell-timeout=300",
           "-p", "no:cacheprovider", "-p", "nbval_executed", f"--executed-dir={executed}", "-o", "addopts=",
           f"--junitxml={report}", *map(str, solved + heads)]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=NBVAL_S - 100)
    if not report.exists():
        pytest.fail(f"nbval did not run: {proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return ElementTree.parse(report).getroot(), executed


def cells_of(report, classname: str):
    """The nbval test cases of one notebook (JUnit's classname: ``<folder>.<file name>``), in order,
    as (cell, [(tag, message, text)])."""
    cases = [case for case in report.iter("testcase") if case.get("classname") == classname]
    return [(case.get("name"), [(p.tag, p.get("message", ""), p.text or "") for p in case
                                if p.tag in ("failure", "error")]) for case in cases]


@pytest.mark.timeout(NBVAL_S)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_under_nbval(nbval_run, path):
    """The solved notebook, every cell."""
    cells = cells_of(nbval_run[0], f"solved.{path.name}")
    assert cells, f"nbval collected no cell of {path.name}"
    failed = [(name, msg, text) for name, problems in cells for _, msg, text in problems]
    assert not failed, "\n\n".join(f"{name}: {msg}\n{text[-3000:]}" for name, msg, text in failed)


@pytest.mark.timeout(NBVAL_S)
@pytest.mark.parametrize("path", EXERCISED, ids=[p.stem for p in EXERCISED])
def test_learner_notebook_stops_at_its_first_exercise(nbval_run, path):
    """Every cell before the first exercise runs; the exercise (or the check of the function it
    asks for) raises the learner's ``NotImplementedError``. Solved, the same notebook passes (above)."""
    cells = cells_of(nbval_run[0], f"learner.{path.stem}.learner.ipynb")
    assert cells, f"nbval collected no cell of {path.stem}.learner.ipynb"
    *before, (last, problems) = cells
    failed = [(name, msg, text) for name, p in before for _, msg, text in p]
    assert not failed, "\n\n".join(f"{name}: {msg}\n{text[-3000:]}" for name, msg, text in failed)
    assert problems and "NotImplementedError" in problems[0][2], f"{last}: {problems}"


@pytest.mark.timeout(NBVAL_S)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_figure_has_its_picture_in_html(nbval_run, path):
    """The solved notebook as it ran, rendered to HTML by nbconvert (what a static view shows): every
    plotly figure went through ``viz.show`` (not ``fig.show()``, blank there), carries its PNG, and
    the page shows that PNG. Without a Chromium, ``viz.show`` gives HTML instead of the PNG: that
    part skips, saying so."""
    nbconvert = pytest.importorskip("nbconvert")
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(str(nbval_run[1] / path.name), as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if o.get("output_type") in ("display_data", "execute_result")]
    figures = [o["data"] for o in outputs if PLOTLY in o.get("data", {})]
    bare = [f.get("text/plain", "?")[:80] for f in figures if not f.get("text/plain", "").startswith("<plotly figure")]
    assert not bare, f"figures shown with fig.show(), not orca_lab.viz.show: {bare}"
    if any("image/png" not in f for f in figures):
        from orca_lab.viz.render import png_bytes
        import plotly.graph_objects as go
        if png_bytes(go.Figure()) is None:
            pytest.skip("no Chromium here: viz.show gave HTML in place of each PNG")
    assert all("image/png" in f for f in figures), "a figure without its PNG"
    html, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    pictures = html.count('src="data:image/png;base64,')
    assert pictures >= len(figures), f"{len(figures)} figures, {pictures} pictures in the HTML"


@pytest.mark.timeout(NBVAL_S)
def test_chapter_11_preempts_where_the_learners_victim_chooses(nbval_run):
    """Section 4's pool is too small for every context at once: the paged and chunked runs preempt, so
    ``use_victim`` (the next cell) really asks the learner's ``victim``, and says how often."""
    nb = load(nbval_run[1] / "11_after_orca.ipynb")
    said = {c.get("id"): "".join("".join(o.get("text", "")) for o in c.get("outputs", [])) for c in code_cells(nb)}
    counts = dict(re.findall(r"^(paged|chunked) +iterations +\d+ +preemptions (\d+)", said["1d2f35d1"], re.M))
    assert counts.keys() == {"paged", "chunked"} and all(int(n) > 0 for n in counts.values()), said["1d2f35d1"]
    chosen = re.search(r"your victims: (\d+) preemptions", said["ex-victim-plug"])
    assert chosen and int(chosen[1]) == sum(map(int, counts.values())), said["ex-victim-plug"]
