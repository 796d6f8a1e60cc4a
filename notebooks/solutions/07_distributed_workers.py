"""Solutions of notebook 07_distributed_workers, merged by `python -m orca_lab.course.solve`."""
# Each section is a notebook cell: it reads names the cells before it define.
# ruff: noqa: F821, E402, E741


# %% exercise: split_linear
def split_linear(weight, bias, t, T, parallel):
    dim = 0 if parallel == "column" else 1
    size, extra = divmod(weight.shape[dim], T)
    lo = t * size + min(t, extra)
    hi = lo + size + (t < extra)
    if parallel == "row":
        return weight[:, lo:hi], None      # the layer adds its bias once, after the all-reduce
    return weight[lo:hi], None if bias is None else bias[lo:hi]


def all_reduce(partials):
    return torch.stack(partials).sum(0)


# %% exercise: stages
def stages(n_layers, n_stages):
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


# %% exercise: all_reduces
def all_reduces(n_layers):
    return 2 * n_layers          # attention output projection and second MLP linear, per layer
