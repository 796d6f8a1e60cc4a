"""Claims that hold: notebook 09's measured statements (its asserts) hold at seeds other than the
default, not only at the one nbval runs, at the notebook's own settings: the rate follows the
capacity measured in the same run, not a constant. (Run two at a time with 16 requests instead of
24, the claims failed at two seeds of three on the 2-core CI machine.)"""
from pathlib import Path

import pytest

pm = pytest.importorskip("papermill")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "09_end_to_end.ipynb"
SEEDS = (1, 2, 3)


def _run(seed, out):
    try:
        pm.execute_notebook(str(NOTEBOOK), str(out / f"09_seed{seed}.ipynb"), parameters={"seed": seed},
                            kernel_name="python3", progress_bar=False, cwd=str(NOTEBOOK.parent))
        return None
    except pm.PapermillExecutionError as e:
        return f"seed {seed}: {e.ename}: {e.evalue}"


def test_notebook_09_claims_hold_at_three_other_seeds(tmp_path):
    errors = [e for e in (_run(s, tmp_path) for s in SEEDS) if e]   # one at a time: the claims are timings
    assert not errors, "\n".join(errors)
