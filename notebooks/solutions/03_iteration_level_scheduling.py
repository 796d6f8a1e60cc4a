"""Solutions of notebook 03_iteration_level_scheduling, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: select
def select(pool, n_rsrv, max_bs, n_slots):
    """Algorithm 1's Select: returns (batch, n_rsrv)."""
    batch = []
    for req in sorted((r for r in pool if r.state is not RequestState.RUNNING), key=lambda r: r.arrival):
        if len(batch) == max_bs:
            break
        if req.state is RequestState.INITIATION:   # first time: reserve all its K/V now
            if n_rsrv + req.max_tokens > n_slots:
                break                               # break, not skip: a later request never overtakes
            n_rsrv += req.max_tokens
        batch.append(req)
    return batch, n_rsrv


# %% exercise: loop
def loop(scheduler, executor, n_workers):
    """Algorithm 1's loop, one batch in flight: returns once the scheduler has no work left."""
    while scheduler.has_work():
        batch = scheduler.select(executor.clock.now())
        executor.submit(batch)                 # one iteration of it; with one worker, wait for it at once
        done = executor.wait()
        scheduler.on_batch_return(done.batch, done.tokens, executor.clock.now())


# %% exercise: first_select
first_batch, first_n_rsrv = ["W"], 12              # X (30) does not fit: break, so Y and Z wait too
second_batch, second_n_rsrv = ["X", "Y"], 35       # W left: 0 + 30 + 5 = 35; Z (8) would need 43
