"""Solutions of notebook 09_end_to_end, merged by `python -m orca_lab.course.solve`."""


# %% exercise: median_norm_latency
import statistics


def median_norm_latency_ms(records):
    return statistics.median((r.t_finish - r.arrival) / r.n_generated * 1e3 for r in records)
