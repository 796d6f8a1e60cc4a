"""Solutions of notebook 02_request_level_batching, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: ft_iterations
def ft_iterations(prompt_lens, gens):
    return max(p + g for p, g in zip(prompt_lens, gens)) - min(prompt_lens)


# %% exercise: ft_finish_iterations
def ft_finish_iterations(prompt_lens, gens, max_bs):
    finish, t = [], 0
    for i in range(0, len(gens), max_bs):      # batches of max_bs, in arrival order
        t += ft_iterations(prompt_lens[i:i + max_bs], gens[i:i + max_bs])
        finish += [t] * len(gens[i:i + max_bs])  # the whole batch returns when it ends
    return finish
