"""Solutions of notebook 10_serving, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: reserved
reserved = {"orca": 10 + 400, "ft": 1024}
