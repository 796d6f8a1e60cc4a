"""Solutions of notebook 11_after_orca, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: block_slots
def block_slots(table, n_tokens, block_size):
    return [table[t // block_size] * block_size + t % block_size for t in range(n_tokens)]


# %% exercise: block_allocator
class BlockAllocator:
    def __init__(self, n_blocks):
        self.free_blocks = list(range(n_blocks))        # free block ids, sorted

    def take(self, n):
        f = self.free_blocks
        # the lowest window of n free ids that are consecutive; none: the n lowest free blocks
        i = next((i for i in range(len(f) - n + 1) if f[i + n - 1] - f[i] == n - 1), 0)
        taken, f[i:i + n] = f[i:i + n], []
        return taken

    def free(self, blocks):
        self.free_blocks = sorted(self.free_blocks + list(blocks))


# %% exercise: victim
from orca_lab.engine.request import RequestState


def victim(running, req, chosen):
    for r in reversed(running):                       # latest arrival first
        if (r.arrival, r.rid) <= (req.arrival, req.rid):
            return None                               # never one that arrived before req
        if r.slots is not None and r.state is RequestState.INCREMENT and r.rid not in chosen:
            return r
    return None


# %% exercise: fill_budget
def fill_budget(decodes, prompts, budget, max_bs, run):
    left, n_run = budget, 0
    for pairs in (decodes, prompts):                  # decodes first, then prompts in arrival order
        for req, n_tokens in pairs:
            n = min(n_tokens, left)                   # a prompt longer than what is left: a chunk
            if run(req, n):                           # False: it cannot run now, and takes nothing
                left, n_run = left - n, n_run + 1
                if left == 0 or n_run == max_bs:
                    return


# %% exercise: slots_held
orca_slots = 260
paged_slots = 96
