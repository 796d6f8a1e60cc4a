"""Checks of the reproduction notebooks' papermill parameters: a bad one stops the notebook at its
first cell with a message that names the parameter, its value and what is allowed."""
from __future__ import annotations

import math
import re

from orca_lab.config import DTYPES, MAX_THREADS, PRESETS, check_choice, check_range
from orca_lab.config import check_out_dir as check_out_dir_of
from orca_lab.engine.fields import FIELDS
from orca_lab.sim.calibration import efficiency
from orca_lab.sim.cost import DEVICES, PAPER_PARALLELISM, Efficiency
from orca_lab.sim.sweep import Curve
from orca_lab.workload import MAX_TRACE_REQUESTS

MODES = ("simulate", "measure")
FIGURE_FORMATS = ("html", "png", "svg", "pdf")


def check_mode(mode: str, preset: str, device) -> str:
    """``mode`` and ``preset`` checked, and ``device`` resolved for the mode (``resolve_device``)."""
    check_choice("mode", mode, MODES)
    check_choice("preset", preset, tuple(PRESETS))
    return resolve_device(mode, device)


def resolve_device(mode: str, device, name: str = "device") -> str:
    """What ``device`` means in every reproduction notebook: "auto" by default, resolved per mode.
    simulate: a modelled GPU (``DEVICES``; "auto": the paper's a100-40gb); measure: where the real
    engine runs, "cpu", "cuda" or "cuda:N" ("auto": cuda if present, else cpu). A value that does
    not fit the mode is refused, naming the mode and its values, before the notebook does any work.
    ``name``: the parameter the value came from (``compare_with`` names a simulated GPU too)."""
    check_choice("mode", mode, MODES)
    other = dict(simulate="'cpu', 'cuda', 'cuda:N' are for mode='measure'",
                 measure=f"the simulated GPUs {', '.join(map(repr, DEVICES))} are for mode='simulate'")[mode]
    if mode == "simulate":
        if device not in ("auto", *DEVICES):
            raise ValueError(f"{name}={device!r} is not allowed in simulate mode: choose one of "
                             f"{', '.join(map(repr, ('auto', *DEVICES)))} ({other})")
        return "a100-40gb" if device == "auto" else device
    n = _n_gpus()
    if device == "auto":
        return "cuda" if n else "cpu"
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", device) if isinstance(device, str) else None
    if m is None:
        raise ValueError(f"{name}={device!r} is not allowed in measure mode: choose one of 'auto', 'cpu', "
                         f"'cuda', 'cuda:N' ({other})")
    if device != "cpu" and (not n or m.group(1) and int(m.group(1)) >= n):
        gpus = f"{n} CUDA GPU(s), cuda:0..cuda:{n - 1}" if n else "no CUDA GPU"
        raise ValueError(f"{name}={device!r} is not allowed in measure mode: this machine has {gpus}; "
                         "use 'cpu' or 'auto'")
    return device


def _n_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def scaled_parallelism(preset: str, n_gpus: int) -> tuple[int, int]:
    """The paper's Table 1 (tensor parallel, pipeline stages) for ``preset``, halved (stages first)
    until it fits ``n_gpus``; 1 x 1 on a CPU or for a model the table does not list."""
    tp, pp = PAPER_PARALLELISM.get(preset, (1, 1)) if n_gpus else (1, 1)
    while tp * pp > max(n_gpus, 1):
        if pp > 1:
            pp //= 2
        else:
            tp //= 2
    return tp, pp


def check_measure(preset: str, device: str, dtype: str, tensor_parallel, pipeline_parallel) -> dict:
    """``RealBackend``'s settings from measure-mode parameters (``device`` from ``check_mode``):
    dtype "auto" is bfloat16 on a GPU, float32 on a CPU; degrees left None follow the paper's Table 1
    scaled to the GPUs present (``scaled_parallelism``)."""
    on_gpu = device.startswith("cuda")
    dtype = check_choice("dtype", ("bfloat16" if on_gpu else "float32") if dtype == "auto" else dtype,
                         ("auto", *DTYPES))
    tp, pp = scaled_parallelism(preset, _n_gpus() if on_gpu else 0)
    tp = tp if tensor_parallel is None else check_range("tensor_parallel", tensor_parallel, 1, 1024)
    pp = pp if pipeline_parallel is None else check_range("pipeline_parallel", pipeline_parallel, 1, 1024)
    if on_gpu and tp * pp > _n_gpus():
        raise ValueError(f"tensor_parallel x pipeline_parallel = {tp} x {pp} = {tp * pp} GPUs, but this "
                         f"machine has {_n_gpus()}: lower them (or leave them None for the scaled Table 1)")
    return dict(preset=preset, device=device, dtype=dtype, tensor_parallel=tp, pipeline_parallel=pp)


def check_formats(formats) -> list[str]:
    """Figure formats to export; PNG/SVG/PDF need a Chromium and are skipped, with a warning, without."""
    formats = check_list("formats", formats, f"figure formats ({', '.join(FIGURE_FORMATS)})")
    for f in formats:
        check_choice("formats", f, FIGURE_FORMATS)
    return formats


def check_list(name: str, values, what: str) -> list:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name}={values!r} must be a list of {what}")
    values = list(values)
    if not values:
        raise ValueError(f"{name}=[] is an empty sweep: give at least one of {what}")
    return values


def check_models(models, name: str = "models") -> list[str]:
    """``name``: the notebook parameter the list came from, for the message."""
    models = check_list(name, models, f"model names ({', '.join(PRESETS)})")
    for m in models:
        if m not in PRESETS:
            raise ValueError(f"{name}: unknown model {m!r}: choose among {', '.join(map(repr, PRESETS))}")
    return models


def check_curves(curves) -> list[Curve]:
    return [Curve.parse(c) for c in check_list("curves", curves, "curves such as 'orca(8)' or 'ft(8,8)'")]


def check_positive(name: str, values, what: str) -> list[float]:
    """A non-empty list of finite numbers > 0 (rates in req/s, loads as fractions of capacity)."""
    values = check_list(name, values, what)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name}: {v!r} is not allowed: each must be a finite number > 0 ({what})")
    return [float(v) for v in values]


def check_rates(rates, loads) -> tuple[list[float] | None, list[float]]:
    """``rates`` (req/s) or, when None, ``loads`` (fractions of each curve's capacity)."""
    loads = check_positive("loads", loads, "fractions of a curve's capacity")
    if rates is not None:
        rates = check_positive("rates", rates, "arrival rates in req/s")
    return rates, loads


# A notebook's counts, each refused at its first cell with its own name: past these the trace, the
# process pool or the K/V pool would refuse it later, under another name, after work has run.
COUNTS = {"n_requests": (1, MAX_TRACE_REQUESTS), "reservation_requests": (1, MAX_TRACE_REQUESTS),
          "seed": FIELDS["seed"].limits(), "n_procs": (1, 256), "torch_threads": (1, MAX_THREADS),
          "block_size": (1, 1 << 16), "repeats": (1, 1000), "max_tries": (1, 1000)}


def check_counts(**counts):
    """Integers in their ranges (``COUNTS``): ``n_requests``, ``seed`` (>= 0), ``n_procs``..."""
    for name, v in counts.items():
        check_range(name, v, *COUNTS.get(name, (1, None)))


def check_budget(budget_s, mode: str) -> float | None:
    """``budget_s``: None (the sweep as given) or, in measure mode, the notebook's seconds (>= 1)."""
    if budget_s is None:
        return None
    if mode != "measure":
        raise ValueError(f"budget_s={budget_s!r} is for mode='measure' (a simulation sizes itself): "
                         "leave it None here")
    return check_range("budget_s", budget_s, 1.0, 1e6, kind=float)


def check_out_dir(out_dir) -> str:
    return check_out_dir_of("out_dir", out_dir)


def check_efficiency(overrides, cost: str = "calibrated") -> Efficiency:
    """The parameters of the ``cost`` model ("calibrated" or "analytical") with some of them
    changed, e.g. ``{"ft_hop_s": 0.0}``."""
    if not isinstance(overrides, dict):
        raise ValueError(f"efficiency={overrides!r} must be a dict of Efficiency fields, e.g. {{'hbm': 0.8}}")
    known = set(Efficiency.__dataclass_fields__)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"efficiency: unknown field(s) {unknown}: choose among {sorted(known)}")
    return efficiency(cost, **overrides)
