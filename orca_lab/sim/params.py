"""Checks of the reproduction notebooks' papermill parameters: a bad one stops the notebook at its
first cell with a message that names the parameter, its value and what is allowed."""
from __future__ import annotations

import math

from orca_lab.config import PRESETS, check_choice, check_range
from orca_lab.sim.calibration import efficiency
from orca_lab.sim.cost import DEVICES, Efficiency
from orca_lab.sim.run import Curve

MODES = ("simulate", "measure")


def check_mode(mode: str, preset: str, device: str):
    check_choice("mode", mode, MODES)
    check_choice("preset", preset, tuple(PRESETS))
    check_choice("device", device, tuple(DEVICES))


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


def check_counts(**counts):
    """Positive integers: ``n_requests``, ``seed`` (>= 0), ``n_procs``..."""
    for name, v in counts.items():
        check_range(name, v, 0 if name == "seed" else 1, None)


def check_out_dir(out_dir) -> str:
    if not isinstance(out_dir, str) or not out_dir.strip():
        raise ValueError(f"out_dir={out_dir!r} must be a non-empty path")
    return out_dir


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
