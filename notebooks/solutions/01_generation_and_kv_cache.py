"""Solutions of notebook 01_generation_and_kv_cache, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: cached_attention
def cached_attention(q_new, k_cache, v_cache, k_new, v_new):
    """Returns (output [n_new, d], k_cache grown, v_cache grown)."""
    k_cache, v_cache = torch.cat([k_cache, k_new]), torch.cat([v_cache, v_new])
    return attention(q_new, k_cache, v_cache), k_cache, v_cache    # the last n_new rows, causal


# %% exercise: rows
rows_without_cache = sum(prompt_len + i for i in range(n_gen))   # the sequence grows by one each step
rows_with_cache = prompt_len + (n_gen - 1)                       # the prompt once, then one per step
