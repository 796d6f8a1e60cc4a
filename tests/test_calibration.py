"""The calibrated cost model: published measurements with their sources, a least-squares fit that
reproduces the constants in the code, a model that agrees with the simulator it feeds, and the
sweep's trace that grows with the load."""
import dataclasses
import math

import pytest

from orca_lab.sim import calibration as C
from orca_lab.sim import params as P
from orca_lab.sim.cost import AnalyticalCost, Efficiency
from orca_lab.sim.sweep import Curve, Sweep, TraceSpec, batch_time
from orca_lab.sim.backends import SimBackend
from orca_lab.viz.curves import log_ticks


def _cost(eff, data):
    return sum(math.log(C.predict(m, eff) / m.value) ** 2 for m in data if not m.holdout)


def test_every_row_names_its_source_and_some_are_held_out():
    for m in C.DATA:
        assert m.value > 0 and m.unit and ("github.com" in m.source or "ORCA" in m.source), m
    held = [m for m in C.DATA if m.holdout]
    assert 10 <= len(held) < len(C.DATA) / 2
    assert not any("Figure 10" in m.what or "Figure 10" in m.source for m in C.DATA)


def test_the_fit_reproduces_the_calibrated_constants_and_its_errors():
    fitted = C.fit()
    for k in C.FREE:      # the constants in the code are this fit, rounded
        assert getattr(C.CALIBRATED, k) == pytest.approx(getattr(fitted, k), rel=0.05), k
    assert _cost(C.CALIBRATED, C.DATA) == pytest.approx(_cost(fitted, C.DATA), rel=0.02)
    assert _cost(C.CALIBRATED, C.DATA) < 0.25 * _cost(Efficiency(), C.DATA)   # far closer than the generic constants
    s = C.summary(C.table(C.CALIBRATED))
    assert s.loc[False, "median_abs_error_pct"] < 10 and s.loc[True, "median_abs_error_pct"] < 20


def test_a_fit_moves_toward_its_data():
    """Double every FT latency of the fitted rows: the model's FT gets slower to follow."""
    slow = [dataclasses.replace(m, value=2 * m.value) if m.kind == "ft_latency" else m for m in C.DATA]
    eff = C.fit(slow, start=C.CALIBRATED)
    m = next(r for r in C.DATA if r.kind == "ft_latency" and not r.holdout)
    assert C.predict(m, eff) > 1.5 * C.predict(m, C.CALIBRATED)


@pytest.mark.parametrize("system", ["orca", "ft"])
def test_run_time_is_what_the_simulator_measures_for_one_batch(system):
    backend = SimBackend("gpt3-175b")                       # two pipeline stages, calibrated
    sim = batch_time(backend, system, 4, 32, gen_len=6)["time_ms"] / 1e3
    assert C.run_time(backend.cost, 4, 32, 6, system == "ft", first_emits=True) == pytest.approx(sim, rel=1e-9)


def test_breakdown_adds_up_to_the_iteration():
    cost = AnalyticalCost("gpt3-175b", eff=C.CALIBRATED)
    for padded in (True, False):
        batch = C.StepBatch([300, 300], [1, 1], padded)
        it = cost.iteration(batch)
        assert sum(cost.breakdown(batch).values()) == pytest.approx(it.dispatch + sum(it.stages) + it.collect)
    parts = C.iteration_breakdown()
    assert parts.loc["total", "ft b=1"] > parts.loc["total", "orca b=1"] and parts.loc["ft_hop", "orca b=1"] == 0


def test_calibrated_is_the_default_and_analytical_stays_available():
    assert SimBackend("gpt3-13b").cost.eff == C.CALIBRATED
    assert SimBackend("gpt3-13b", cost="analytical").cost.eff == Efficiency()
    assert P.check_efficiency({"ft_hop_s": 0.0}).ft_hop_s == 0.0
    assert P.check_efficiency({}, "analytical") == Efficiency()
    with pytest.raises(ValueError, match="cost='guess'"):
        SimBackend("gpt3-13b", cost="guess")


def test_a_sweep_hands_on_its_points_as_each_ends():
    """What a measured run saves as it goes (``keep``), so a run cut by a time limit keeps its points."""
    seen = []
    Sweep([SimBackend("gpt3-13b")], [Curve("orca", 8)], TraceSpec(6, seed=1), rates=[1.0, 2.0], progress=False,
          keep=lambda rows: seen.append([r["rate"] for r in rows])).run()
    assert seen == [[1.0], [1.0, 2.0]]


def test_a_point_s_trace_covers_the_span_at_its_rate():
    sweep = Sweep([SimBackend("gpt3-101b")], [Curve("orca", 8)], TraceSpec(10, seed=1), span_s=20.0)
    assert sweep.spec_at(0.1).n_requests == 10 and sweep.spec_at(2.05).n_requests == 41
    assert Sweep([], [], TraceSpec(10), span_s=None).spec_at(100.0).n_requests == 10
    with pytest.raises(ValueError, match="span_s"):
        Sweep([], [], TraceSpec(10), span_s=-1.0).spec_at(1.0)


def test_log_axis_labels_only_powers_of_ten():
    assert log_ticks([20, 1500]) == [10, 100, 1000, 10000]
    assert log_ticks([30, 80]) == pytest.approx([10, 20, 50, 100, 200, 500])
    assert log_ticks([]) == []
