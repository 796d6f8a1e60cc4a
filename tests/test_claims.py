"""Claims that hold: notebook 09's measured statements (its asserts) hold at seeds other than the
default, not only at the one nbval runs, at the notebook's own settings: the rate follows the
capacity measured in the same run, not a constant.

They hold on a loaded machine too: the notebook asserts counts (iterations, useful tokens per
iteration, wasted rows), never wall-clock speeds. Its section 2 once asserted that ORCA served more
requests/s and had the lower latency; with another job loading the machine that failed at seed 3.
A busy neighbour only moves the load the trace sees (a slower run is a more loaded one), and on the
simulator the asserted counts hold over a wide range of loads (the second test)."""
from pathlib import Path

import pytest

pm = pytest.importorskip("papermill")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "09_end_to_end.ipynb"
SEEDS = (1, 2, 3)


def _run(seed, out):
    from orca_lab.course import solve
    solved = out / NOTEBOOK.name            # the learner's exercise solved (orca_lab.course.solve)
    solve.dump(solve.solved(NOTEBOOK), solved)
    try:
        pm.execute_notebook(str(solved), str(out / f"09_seed{seed}.ipynb"), parameters={"seed": seed},
                            kernel_name="python3", progress_bar=False, cwd=str(NOTEBOOK.parent))
        return None
    except pm.PapermillExecutionError as e:
        return f"seed {seed}: {e.ename}: {e.evalue}"


def test_notebook_09_claims_hold_at_three_other_seeds(tmp_path):
    errors = [e for e in (_run(s, tmp_path) for s in SEEDS) if e]   # one at a time: 2 cores
    assert not errors, "\n".join(errors)


def test_the_counts_notebook_09_asserts_hold_at_any_load():
    """What a busy neighbour can do to the notebook's runs is change the load their trace sees; on the
    simulator (the same engine loop and schedulers) its asserts hold from a quarter of the baseline's
    capacity to 20 times it; the baseline's wasted rows from its capacity on (the notebook runs at
    2.5 times it)."""
    from orca_lab.compare import trace_at
    from orca_lab.metrics import compare_table, summarize
    from orca_lab.sim.run import Curve, SimBackend
    sim = SimBackend("tiny", n_slots=8 * 1024)
    for seed in SEEDS:
        offline = trace_at(None, 24, seed, 0.1, sim.cfg.vocab_size)
        capacity = summarize(sim.serve(Curve("ft", 8, 8), offline))["throughput_rps"]
        for load in (0.25, 1.0, 2.5, 20.0):
            trace = trace_at(load * capacity, 24, seed, 0.1, sim.cfg.vocab_size)
            t = compare_table([sim.serve(Curve("orca", 8), trace), sim.serve(Curve("ft", 8, 8), trace)])
            o, f = t.loc["orca"], t.loc["ft"]
            assert o.n_iterations < f.n_iterations and o.tokens_per_iteration > f.tokens_per_iteration, (seed, load)
            assert o.wasted_rows_per_iteration == 0, (seed, load)
            if load >= 1:      # lighter, a batch may hold a single request: nothing to waste
                assert f.wasted_rows_per_iteration > 0, (seed, load)
