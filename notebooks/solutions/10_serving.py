"""Solutions of notebook 10_serving, merged by `python -m orca_lab.course.solve`."""


# %% exercise: reserved
reserved = {"orca": 10 + 400, "ft": 1024}
