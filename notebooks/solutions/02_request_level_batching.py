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


# %% exercise: form_batch
def form_batch(waiting, kv, max_bs, max_seq_len):
    batch = []
    while waiting and len(batch) < max_bs and kv.can_reserve(max_seq_len):
        req = waiting.popleft()                  # arrival order: the head of the queue
        kv.reserve(req, max_seq_len)             # FT reserves the model's maximum length
        batch.append(req)
    return batch, min((len(r.prompt) for r in batch), default=0)
