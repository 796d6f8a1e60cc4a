"""Solutions of notebook 11_after_orca, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: block_slots
def block_slots(table, n_tokens, block_size):
    return [table[t // block_size] * block_size + t % block_size for t in range(n_tokens)]


# %% exercise: victim
from orca_lab.engine.request import RequestState


def victim(running, req, chosen):
    for r in reversed(running):                       # latest arrival first
        if (r.arrival, r.rid) <= (req.arrival, req.rid):
            return None                               # never one that arrived before req
        if r.slots is not None and r.state is RequestState.INCREMENT and r.rid not in chosen:
            return r
    return None


# %% exercise: slots_held
orca_slots = 140
paged_slots = 64
