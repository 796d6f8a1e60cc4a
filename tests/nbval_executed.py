"""A pytest plugin for the nbval run of tests/test_notebooks.py: ``--executed-dir DIR`` writes each
notebook nbval ran to DIR with the outputs its cells gave (nbval keeps them in memory only), so the
tests that read a run's outputs (its figures rendered to HTML) reuse that run instead of running the
notebooks again."""
from pathlib import Path

import nbformat


def pytest_addoption(parser):
    parser.addoption("--executed-dir", default=None, help="write the executed notebooks here")


def pytest_sessionfinish(session):
    out = session.config.getoption("executed_dir")
    if not out:
        return
    notebooks = {}
    for item in session.items:
        if not hasattr(item, "test_outputs") or not hasattr(item.parent, "nb"):
            continue                       # not an nbval cell
        notebooks[item.parent.fspath.basename] = item.parent.nb
        if item.test_outputs is not None:  # the cell ran (a cell after a kernel's death did not)
            item.cell.outputs = item.test_outputs
            item.cell.execution_count = item.cell_num + 1
    Path(out).mkdir(parents=True, exist_ok=True)
    for name, nb in notebooks.items():
        nbformat.write(nb, str(Path(out) / name))
