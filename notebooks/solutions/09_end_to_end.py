"""Solutions of notebook 09_end_to_end, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: median_norm_latency
import statistics


def norm_latency_median_ms(records):
    return statistics.median((r.t_finish - r.arrival) / r.n_generated * 1e3 for r in records)
