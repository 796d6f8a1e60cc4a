"""Solutions of notebook 08_pipelined_schedules, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: loop
def loop(scheduler, executor, n_workers):
    n_scheduled = 0                                    # batches in flight
    while scheduler.has_work() or n_scheduled:
        batch = scheduler.select(executor.clock.now()) if n_scheduled < n_workers else None
        if batch is not None:
            executor.submit(batch)                     # never waits: the next stage runs it
            n_scheduled += 1
        if n_scheduled and (n_scheduled == n_workers or batch is None):
            done = executor.wait()                     # the oldest batch comes back
            n_scheduled -= 1
            scheduler.on_batch_return(done.batch, done.tokens, executor.clock.now())


# %% exercise: ft_busy
def ft_busy(k, P):
    return k / P          # each of the k micro-batches keeps a worker busy 1 unit in every P
