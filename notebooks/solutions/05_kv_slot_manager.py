"""Solutions of notebook 05_kv_slot_manager, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: slot_manager
class SlotManager:
    def __init__(self, n_slots):
        self.n_slots, self.n_reserved = n_slots, 0
        self.free = list(range(n_slots))          # free slot ids, sorted

    def can_reserve(self, n):
        return self.n_reserved + n <= self.n_slots

    def reserve(self, req, n):
        # the first window of n free ids that are consecutive: the start of the lowest run long enough
        run = (i for i in range(len(self.free) - n + 1) if self.free[i + n - 1] - self.free[i] == n - 1)
        i = next(run, 0)                          # none: the lowest free slots, chained
        req.slots, self.free[i:i + n] = self.free[i:i + n], []
        self.n_reserved += n

    def release(self, req):
        self.free = sorted(self.free + req.slots)
        self.n_reserved -= len(req.slots)
        req.slots = None


# %% exercise: at_once
orca_at_once = 1000 // 50
ft_at_once = (4 * 1024) // 1024
