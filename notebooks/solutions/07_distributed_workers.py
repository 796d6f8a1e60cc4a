"""Solutions of notebook 07_distributed_workers, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: stages
def stages(n_layers, n_stages):
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


# %% exercise: all_reduces
def all_reduces(n_layers):
    return 2 * n_layers          # attention output projection and second MLP linear, per layer
