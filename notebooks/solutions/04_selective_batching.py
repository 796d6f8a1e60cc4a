"""Solutions of notebook 04_selective_batching, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: flatten
def flatten(requests):
    """{"input_ids": [...], "positions": [...], "slot_mapping": [...], "kv_slot_ids": [...],
    "cu_seqlens_q": [...], "cu_seqlens_k": [...], "last_idx": [...]}"""
    out = {name: [] for name in ("input_ids", "positions", "slot_mapping", "kv_slot_ids", "last_idx")}
    out["cu_seqlens_q"], out["cu_seqlens_k"] = [0], [0]
    for r in requests:
        new = r.pending_tokens()
        start, end = r.n_cached, r.n_cached + len(new)      # the new tokens' positions
        out["input_ids"] += new
        out["positions"] += range(start, end)
        out["slot_mapping"] += r.slots[start:end].tolist()  # where their K/V is written
        out["kv_slot_ids"] += r.slots[:end].tolist()        # the whole context attention reads
        out["cu_seqlens_q"].append(out["cu_seqlens_q"][-1] + len(new))
        out["cu_seqlens_k"].append(out["cu_seqlens_k"][-1] + end)
        out["last_idx"].append(out["cu_seqlens_q"][-1] - 1)
    return out


# %% exercise: cu_seqlens
ex_q, ex_cached = [4, 1, 1, 6], [0, 9, 3, 0]
ex_cu_q = [0, 4, 5, 6, 12]
ex_cu_k = [0, 4, 14, 18, 24]
ex_padded_rows = 4 * 6
