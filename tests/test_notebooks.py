"""The course notebooks: each runs under nbval, is stored clean, and refuses a bad parameter.

How they run: one ``python -m pytest --nbval-lax notebooks/*.ipynb`` subprocess, exactly what a reader
runs by hand. nbval executes every cell, each notebook in a fresh kernel, and compares the outputs
stored in cells marked ``# NBVAL_CHECK_OUTPUT`` (deterministic numbers only, never timings) with the
new ones. A subprocess keeps the ``.ipynb`` collection out of this session (``testpaths =
["tests"]``); its JUnit report gives each notebook its own pass/fail line here, with nbval's message.
``--nbval-current-env`` runs the kernels on this interpreter.
"""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]
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
                   "11_after_orca", "12_prefix_caching"]


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
    assert any("## Exercise" in "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


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
        papermill.execute_notebook(str(ROOT / "notebooks" / "08_pipelined_schedules.ipynb"), str(out),
                                   parameters={"n_workers": 0}, kernel_name="python3", progress_bar=False)
    assert "n_workers=0 is out of range: allowed [1, 8]" in str(err.value)
    ran = [c for c in code_cells(load(out)) if c.get("execution_count")]
    assert len(ran) == 3        # parameters, papermill's injected parameters, the check that stopped


@pytest.fixture(scope="module")
def nbval_report(tmp_path_factory):
    """One nbval run over every notebook (one pytest start-up, a fresh kernel per notebook); its
    JUnit report gives each notebook its own test below."""
    report = tmp_path_factory.mktemp("nbval") / "report.xml"
    # TMPDIR: a kernel is stopped without running its exit hooks, so notebook 07's forkserver socket
    # directory would stay in /tmp; here it stays in pytest's own temporary tree.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TMPDIR": str(report.parent)}
    cmd = [sys.executable, "-m", "pytest", "-q", "--nbval-lax", "--nbval-current-env", "--nbval-cell-timeout=300",
           "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}", *map(str, NOTEBOOKS)]
    proc = subprocess.run(cmd, cwd=report.parent, env=env, capture_output=True, text=True, timeout=900)
    if not report.exists():
        pytest.fail(f"nbval did not run: {proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return ElementTree.parse(report).getroot()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_under_nbval(nbval_report, path):
    cells = [case for case in nbval_report.iter("testcase")
             if path.name in case.get("classname", "") + case.get("file", "")]
    assert cells, f"nbval collected no cell of {path.name}"
    failed = [(case.get("name"), problem.get("message", ""), problem.text or "")
              for case in cells for problem in case if problem.tag in ("failure", "error")]
    assert not failed, "\n\n".join(f"{name}: {msg}\n{text[-3000:]}" for name, msg, text in failed)
