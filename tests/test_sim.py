"""The simulator: same scheduling decisions as the real engine, pipelines per stage, virtual time,
memory-limited baseline, cost models, sweeps and their refusals of bad parameters."""
import dataclasses
import math

import pandas as pd
import pytest
import torch

from helpers import random_prompts
from orca_lab import LLM, PRESETS, EngineConfig
from orca_lab.engine.batch import Batch
from orca_lab.engine.request import Request
from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.sim import params as P
from orca_lab.sim.cost import AnalyticalCost, Efficiency
from orca_lab.sim.executor import IterationCost, SimExecutor
from orca_lab.sim.fitted import FittedCost
from orca_lab.sim.memory import SCHEMES, kv_study, reservation_table
from orca_lab.sim.sweep import CSV_COLUMNS, Curve, Sweep, TraceSpec, batch_time, capacity
from orca_lab.sim.backends import SimBackend
from orca_lab.sim.headline import describe, headline, throughput_at
from orca_lab.workload import TraceItem


class FixedCost:
    """Every stage of every iteration takes ``t`` seconds: timings that are easy to reason about."""
    def __init__(self, n_stages=1, t=1.0, dispatch=0.0, collect=0.0):
        self.n_stages, self.t, self.dispatch, self.collect = n_stages, t, dispatch, collect

    def iteration(self, batch):
        return IterationCost((self.t,) * self.n_stages, self.dispatch, self.collect)


def ragged_trace(vocab, n=12, seed=0):
    prompts = random_prompts(n, vocab, 1, 60, seed)
    return [TraceItem(0.0, tuple(p), 1 + (5 * i + seed) % 11) for i, p in enumerate(prompts)]


def batches(result):
    """Per-iteration composition: rids and new tokens of each, in submission order."""
    first = sorted((it for it in result.iterations if it.stage == 0), key=lambda it: it.iteration)
    return [(it.rids, it.q_lens, it.kv_reserved) for it in first]


# -- the same decisions as the real engine --------------------------------------------------------
@pytest.mark.parametrize("system,n_workers,n_slots", [("orca", 1, 200), ("orca", 3, 4096),
                                                      ("ft", 1, 2 * 1024), ("ft", 2, 3 * 1024)])
def test_simulator_and_real_engine_make_the_same_batches(tiny_llm, system, n_workers, n_slots):
    """Offline trace: the same scheduler, K/V manager and loop give the same batch in every iteration,
    whatever the executor's timings. Small n_slots make the K/V reservation bind."""
    cfg = EngineConfig(max_bs=3, n_slots=n_slots, pipeline_parallel=n_workers)
    mbs = 2 if system == "ft" and n_workers > 1 else None
    trace = ragged_trace(tiny_llm.cfg.vocab_size, n=8, seed=n_workers)
    real = LLM(gpt=tiny_llm.model, engine=cfg).serve(trace, system=system, mbs=mbs)
    curve = Curve(system, 3, (mbs or 3) if system == "ft" else None)
    sim = SimBackend(tiny_llm.cfg, cost=AnalyticalCost(tiny_llm.cfg, pipeline_parallel=n_workers), n_slots=n_slots)
    simulated = sim.serve(curve, trace)
    assert batches(simulated) == batches(real)
    assert len(batches(real)) > len(trace)                   # several iterations per request
    assert [r.n_generated for r in simulated.requests] == [r.n_generated for r in real.requests]


def test_pipeline_keeps_n_workers_batches_in_flight_and_stages_in_order(tiny_llm):
    sim = SimBackend(tiny_llm.cfg, cost=FixedCost(n_stages=3), n_slots=4096)
    result = sim.serve(Curve("orca", 2), ragged_trace(tiny_llm.cfg.vocab_size, n=9))
    its = result.iterations_df()
    assert its["in_flight"].max() == 3
    for _, stage in its.groupby("stage"):                     # a stage runs one batch at a time
        stage = stage.sort_values("start")
        assert (stage["start"].to_numpy()[1:] >= stage["end"].to_numpy()[:-1] - 1e-12).all()
    by_it = its.pivot(index="iteration", columns="stage", values=["start", "end"])
    for s in (1, 2):                                          # stage s after stage s-1 of the same batch
        assert (by_it[("start", s)] >= by_it[("end", s - 1)] - 1e-12).all()
    # three batches on three stages at once: a full pipeline advances one stage time per iteration
    steady = by_it[("start", 0)].diff().dropna()
    assert steady.iloc[:20].tolist() == [1.0] * 20


def test_baseline_micro_batches_fill_the_pipeline_and_bubbles_come_out(tiny_llm):
    trace = [TraceItem(0.0, tuple(range(1, 9)), 4) for _ in range(4)]
    run = lambda mbs: SimBackend(tiny_llm.cfg, cost=FixedCost(n_stages=2), n_slots=8192).serve(Curve("ft", 4, mbs), trace)
    whole, micro = run(4), run(2)
    assert max(it.in_flight for it in whole.iterations) == 1 and max(it.in_flight for it in micro.iterations) == 2
    # one batch of 4: 4 iterations cross both stages one after the other, so each stage idles half the
    # time (the bubble); two micro-batches of 2 take turns: 8 stage steps in 9 s, one bubble at each end
    busy = lambda r: sum(it.end - it.start for it in r.iterations if it.stage == 0) / r.duration
    assert (whole.duration, busy(whole)) == (8.0, 0.5) and (micro.duration, busy(micro)) == (9.0, 8 / 9)
    assert len({it.rids for it in micro.iterations}) == 2


def test_virtual_clock_honours_wait_timeout_and_idles_until_arrivals(tiny_llm):
    ex = SimExecutor(FixedCost(t=1.0, dispatch=0.25, collect=0.25))
    req = Request(0, [1, 2, 3], SamplingParams(max_gen_tokens=2))
    ex.submit(Batch.selective([req]))
    assert ex.wait(0.5) is None and ex.clock.now() == 0.5          # the timeout came first
    done = ex.wait(None)
    assert ex.clock.now() == 1.5 and done.stages[0].start == 0.25 and done.stages[0].end == 1.25
    # a request arriving late: the engine sleeps on the virtual clock until it arrives
    sim = SimBackend(tiny_llm.cfg, cost=FixedCost(t=0.1), n_slots=4096)
    result = sim.serve(Curve("orca", 4), [TraceItem(0.0, (1, 2), 3), TraceItem(50.0, (3, 4), 2)])
    late = result.requests[1]
    assert late.t_scheduled == 50.0 and late.t_finish == pytest.approx(50.2)
    assert result.requests[0].t_finish == pytest.approx(0.3)


def test_eos_after_stops_a_request_early(tiny_llm):
    params = SamplingParams(max_gen_tokens=10, ignore_eos=False, eos_token_id=0)
    item = type("Item", (), {"arrival": 0.0, "prompt": (5, 6), "sampling_params": lambda self: params})()
    engine = SimBackend(tiny_llm.cfg, cost=FixedCost(), n_slots=4096).new_engine(Curve("orca", 2), eos_after=lambda r: 3)
    result = engine.run([item])
    assert result.requests[0].output == (1, 1, 0)            # EOS is the 3rd token; others avoid it


# -- the baseline's memory, from the memory arithmetic --------------------------------------------
def test_baseline_batch_is_limited_by_its_max_seq_len_reservation():
    sim = SimBackend("gpt3-13b")
    assert 7 * 2048 <= sim.n_slots < 8 * 2048                  # 13B on one A100-40GB
    result = sim.serve(Curve("ft", 8, 8), [TraceItem(0.0, (1,) * 40, 4) for _ in range(16)])
    assert max(len(it.rids) for it in result.iterations) == 7
    oom = {(m, bs): batch_time(SimBackend(m), "ft", bs, 32)["oom"] for m, bs in
           [("gpt3-13b", 4), ("gpt3-13b", 8), ("gpt3-101b", 8), ("gpt3-101b", 16)]}
    assert oom == {("gpt3-13b", 4): False, ("gpt3-13b", 8): True, ("gpt3-101b", 8): False, ("gpt3-101b", 16): True}
    assert not batch_time(sim, "orca", 32, 128)["oom"]          # ORCA reserves input + max_gen_tokens only


# -- the analytical cost model ---------------------------------------------------------------------
def _batch(starts, q_lens, padded=False):
    reqs = [Request(i, [1] * max(s + q, 1), SamplingParams(max_gen_tokens=4)) for i, (s, q) in enumerate(zip(starts, q_lens))]
    return Batch(reqs, list(starts), list(q_lens), padded=padded, phases=["decode"] * len(reqs))


def test_analytical_cost_follows_the_roofline_and_the_paper_s_differences():
    cost = AnalyticalCost("gpt3-175b")                          # 8-way tensor, 2 pipeline stages
    assert (cost.tp, cost.n_stages) == (8, 2)
    decode = cost.iteration(_batch([100], [1]))
    bound = cost.weight_bytes_per_gpu() / (cost.dev.hbm_bw * cost.eff.hbm)   # a GPU's shard, one stage
    assert bound < decode.stages[0] < 1.3 * bound               # decode reads every weight: memory bound
    prefill = cost.iteration(_batch([0], [512]))
    assert sum(prefill.stages) > 2 * sum(decode.stages)         # 512 tokens: compute bound
    # ORCA pays a control round trip per iteration; FT a sync per stage, inside the stages
    padded = cost.iteration(_batch([100], [1], padded=True))
    assert (decode.dispatch, decode.collect) == (cost.eff.orca_control_s,) * 2 and padded.dispatch == 0
    assert padded.stages[0] - decode.stages[0] == pytest.approx(cost.eff.ft_sync_s)
    # per-request attention never beats one batched kernel over the same requests
    mixed = [(0, 300), (200, 1), (400, 1)]
    per_req = cost.attention_time(_batch(*zip(*mixed)))
    d = cost.cfg.d_model / cost.tp
    from orca_lab.sim.cost import _attention_work
    f, b = map(sum, zip(*(_attention_work(s, q, d, d) for s, q in mixed)))
    assert per_req >= cost.roofline(f, b, cost.eff.attention) - 1e-12
    faster = AnalyticalCost("gpt3-175b", "h100").iteration(_batch([100], [1]))
    assert sum(faster.stages) < sum(decode.stages)


def test_gpt_costs_are_the_multi_head_formulas():
    """GPT (one K/V head per query head, a 4d MLP with GeLU): the costs of multi-head attention."""
    cost = AnalyticalCost("gpt3-175b")
    d, tp, T = 12288, 8, 37
    gemms = (cost.gemm(T, d, 3 * d / tp) + cost.gemm(T, d / tp, d) + cost.gemm(T, d, 4 * d / tp)
             + cost.gemm(T, 4 * d / tp, d))
    elementwise = 2 * cost.memory_op(2 * T * d) + 2 * cost.memory_op(3 * T * d) + cost.memory_op(2 * T * 4 * d / tp)
    assert cost.layer_parts(T) == {"gemm": gemms, "elementwise": elementwise, "all_reduce": 2 * cost.all_reduce(T * d)}
    from orca_lab.sim.cost import _attention_work
    start, q = 300, 5
    pairs = q * start + q * (q + 1) / 2
    assert _attention_work(start, q, d / tp, cost.kv_width()) == (4 * pairs * d / tp, 2 * d / tp * (2 * (start + q) + 4 * q))


def test_grouped_queries_read_only_their_k_v_heads_and_swiglu_has_three_matrices():
    from orca_lab.sim.cost import _attention_work
    llama = PRESETS["llama3-70b"]
    assert AnalyticalCost(llama).tp == 8                        # 8 x 80 GB of a node: one K/V head per GPU
    costs = [AnalyticalCost(dataclasses.replace(llama, n_kv_heads=n), tensor_parallel=1) for n in (8, 4)]
    start, d = 1000, llama.d_model
    kv_bytes = [_attention_work(start, 1, d, c.kv_width())[1] - 2 * 2 * d for c in costs]   # less Q in, O out
    assert kv_bytes[0] == 2 * 2 * 8 * 128 * (start + 2) and kv_bytes[0] == 2 * kv_bytes[1]
    decode = [c.attention_time(_batch([start], [1])) for c in costs]
    assert decode[1] < decode[0]                                # decode attention is memory bound
    # QKV: 64 query heads and 2 x 8 K/V heads of 128; SwiGLU: gate and up (stacked), then down
    T, ff = 16, llama.intermediate_size
    c = costs[0]
    gemms = c.gemm(T, d, (64 + 2 * 8) * 128) + c.gemm(T, d, d) + c.gemm(T, d, 2 * ff) + c.gemm(T, ff, d)
    assert c.layer_parts(T)["gemm"] == gemms
    assert AnalyticalCost(llama, tensor_parallel=16).kv_width() == 128   # past 8 GPUs a K/V head is replicated


@pytest.mark.parametrize("make,match", [
    (lambda: AnalyticalCost("gpt3-175b", tensor_parallel=1, pipeline_parallel=1).n_slots(), "does not fit"),
    (lambda: AnalyticalCost("gpt3-175b", device="tpu-v9"), "device='tpu-v9'"),
    (lambda: AnalyticalCost("gpt3-13b", pipeline_parallel=41), "pipeline_parallel=41"),
    (lambda: Efficiency(gemm=0.0), "gemm=0.0"),
    (lambda: Efficiency(hbm=1.5), "hbm=1.5"),
    (lambda: SimBackend("gpt3-999b"), "gpt3-999b"),
    (lambda: Curve.parse("orca(0)"), "max_bs=0"),
    (lambda: Curve.parse("ft(8,9)"), "mbs=9"),
    (lambda: Curve.parse("vllm(8)"), "orca\\(max_bs\\), ft\\(max_bs,mbs\\)"),
    (lambda: P.check_models(["gpt3-999b"]), "unknown model 'gpt3-999b'"),
    (lambda: P.check_models([]), "empty sweep"),
    (lambda: P.check_rates([0.5, -1.0], [1.0]), "rates: -1.0 is not allowed"),
    (lambda: P.check_rates(None, []), "loads=\\[\\] is an empty sweep"),
    (lambda: P.check_curves("orca(8)"), "must be a list"),
    (lambda: P.check_mode("guess", "tiny", "a100-40gb"), "mode='guess'"),
    (lambda: P.check_efficiency({"warp_speed": 2.0}), "unknown field\\(s\\) \\['warp_speed'\\]"),
    (lambda: P.check_mode("measure", "tiny", "h100"), "device='h100' is not allowed in measure mode"),
    (lambda: P.check_mode("simulate", "tiny", "cuda"), "device='cuda' is not allowed"),
    (lambda: P.check_measure("tiny", "cpu", "int8", None, None), "dtype='int8'"),
    (lambda: P.check_measure("tiny", "cpu", "auto", 0, None), "tensor_parallel=0"),
    (lambda: P.check_formats(["html", "jpg"]), "formats='jpg' is not allowed"),
    (lambda: P.check_formats([]), "formats=\\[\\] is an empty sweep"),
    (lambda: P.check_budget(60.0, "simulate"), "budget_s=60.0 is for mode='measure'"),
    (lambda: P.check_budget(0.5, "measure"), "budget_s=0.5"),
    # counts past what the trace, the pool of processes or the pages take: named at the first cell
    (lambda: P.check_counts(n_requests=20_000_000), "n_requests=20000000 is out of range: allowed \\[1, 10000000\\]"),
    (lambda: P.check_counts(n_procs=100_000), "n_procs=100000 is out of range: allowed \\[1, 256\\]"),
    (lambda: P.check_counts(seed=-1), "seed=-1 is out of range"),
    (lambda: P.check_out_dir("/proc/nope"), "out_dir='/proc/nope': cannot make that folder"),
    (lambda: P.check_out_dir(""), "out_dir='' must be a non-empty path"),
])
def test_bad_parameters_are_refused_with_a_clear_message(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# -- the fitted model --------------------------------------------------------------------------------
def test_fitted_model_recovers_the_coefficients_of_known_timings(tiny_llm):
    truth = FittedCost({"selective": [2e-3, 1e-5, 3e-8, 2e-7, 4e-4], "padded": [1e-3, 2e-5, 1e-8, 1e-7, 1e-4]})
    sim = SimBackend(tiny_llm.cfg, cost=truth, n_slots=8192)
    trace = ragged_trace(tiny_llm.cfg.vocab_size, n=30)
    runs = [sim.serve(Curve("orca", bs), trace) for bs in (1, 4, 16)] + [sim.serve(Curve("ft", bs, bs), trace) for bs in (2, 8)]
    fit = FittedCost.fit(runs, tiny_llm.cfg.n_layers)
    errors = fit.errors(runs)
    assert (errors["predicted_ms"] - errors["measured_ms"]).abs().max() < 1e-6
    again = sim.serve(Curve("orca", 8), trace)
    assert SimBackend(tiny_llm.cfg, cost=fit, n_slots=8192).serve(Curve("orca", 8), trace).duration == pytest.approx(again.duration)
    with pytest.raises(ValueError, match="saw no padded batches"):
        FittedCost.fit(runs[:1]).predict([0], [1], padded=True)


def test_a_fit_at_another_speed_scales_every_prediction_and_round_trips(tmp_path):
    fit = FittedCost({"selective": [2e-3, 1e-5, 3e-8, 2e-7, 4e-4]}, n_layers=4, n_stages=2)
    slow = fit.at_speed(1.25)
    assert slow.predict([3, 0], [1, 7], padded=False) == pytest.approx(1.25 * fit.predict([3, 0], [1, 7], padded=False))
    assert fit.speed == 1.0 and slow.stage_share == fit.stage_share
    slow.save(tmp_path / "fit.json")
    assert FittedCost.load(tmp_path / "fit.json").speed == 1.25


@pytest.mark.parametrize("system", ["orca", "ft"])
def test_the_speed_of_runs_is_read_against_the_fit_from_busy_iterations_only(tiny_llm, system):
    fit = FittedCost({"selective": [2e-3, 1e-5, 3e-8, 2e-7, 4e-4], "padded": [1e-3, 2e-5, 1e-8, 1e-7, 1e-4]})
    slow = SimBackend(tiny_llm.cfg, cost=fit.at_speed(1.25), n_slots=8192)
    curve = Curve(system, 4, 4 if system == "ft" else None)
    offline = ragged_trace(tiny_llm.cfg.vocab_size, n=10)
    online = [TraceItem(2.0 * i, it.prompt, it.max_gen_tokens) for i, it in enumerate(offline)]  # idle between
    assert fit.speed_of([slow.serve(curve, offline)]) == pytest.approx(1.25)
    run = slow.serve(curve, online)
    assert fit.speed_of([run], busy_only=True) == pytest.approx(1.25)
    assert fit.speed_of([run]) > 10          # the idle gaps counted as work
    with pytest.raises(ValueError, match="no iteration periods"):
        fit.speed_of([])


@pytest.mark.parametrize("system", ["orca", "ft"])
def test_a_speed_that_changes_within_a_run_is_read_back_window_by_window(tiny_llm, system):
    """A simulated machine 2x slower than the fit for the first 0.2 s, then as fast: the fit reads each window's
    speed back from the run's own busy iterations, and the simulator at that profile replays the
    run's timings exactly."""
    from orca_lab.sim.fitted import SpeedProfile
    fit = FittedCost({"selective": [2e-3, 1e-5, 3e-8, 2e-7, 4e-4], "padded": [1e-3, 2e-5, 1e-8, 1e-7, 1e-4]})
    truth = SpeedProfile(0.05, (2.0,) * 4, 1.0)
    machine = SimBackend(tiny_llm.cfg, cost=fit, n_slots=8192, speed=truth)
    curve = Curve(system, 4, 4 if system == "ft" else None)
    run = machine.serve(curve, ragged_trace(tiny_llm.cfg.vocab_size, n=40))
    assert run.duration > 0.3
    read = fit.speed_profile(run, window=0.05)
    # a window an iteration straddles mixes both speeds; every other one is read exactly
    assert read.speeds[:3] == pytest.approx((2.0,) * 3) and read.speeds[5:] == pytest.approx([1.0] * (len(read.speeds) - 5))
    replay = SimBackend(tiny_llm.cfg, cost=fit, n_slots=8192, speed=read).serve(curve, ragged_trace(tiny_llm.cfg.vocab_size, n=40))
    assert replay.duration == pytest.approx(run.duration, rel=0.02)
    assert SimBackend(tiny_llm.cfg, cost=fit, n_slots=8192).serve(curve, ragged_trace(tiny_llm.cfg.vocab_size, n=40)).duration \
        < 0.95 * run.duration


@pytest.mark.parametrize("system", ["orca", "ft"])
def test_a_slower_start_after_idle_is_read_back_and_replayed(tiny_llm, system):
    """A simulated machine whose first iteration after a sleep starts 0.5 ms after the arrival that
    woke it and runs 1.4x slower (a clocked-down core): the run's profile reads both back, and
    replays the run's timings with them."""
    from orca_lab.sim.fitted import SpeedProfile
    fit = FittedCost({"selective": [2e-3, 1e-5, 3e-8, 2e-7, 4e-4], "padded": [1e-3, 2e-5, 1e-8, 1e-7, 1e-4]})
    curve = Curve(system, 4, 4 if system == "ft" else None)
    trace = [TraceItem(0.5 * i, it.prompt, it.max_gen_tokens) for i, it in enumerate(ragged_trace(tiny_llm.cfg.vocab_size, n=10))]
    machine = lambda speed: SimBackend(tiny_llm.cfg, cost=fit, n_slots=8192, speed=speed).serve(curve, trace)
    run = machine(SpeedProfile(1.0, (), 1.0, after_idle=1.4, wake=5e-4))
    read = fit.speed_profile(run)
    assert read.after_idle == pytest.approx(1.4) and read.rest == pytest.approx(1.0)
    assert read.wake == pytest.approx(5e-4)
    ttft = lambda r: [q.t_first_token for q in r.requests]
    assert ttft(machine(read)) == pytest.approx(ttft(run))
    assert ttft(machine(None)) != pytest.approx(ttft(run))
    assert ttft(machine(SpeedProfile(1.0, (), 1.0, after_idle=1.4))) != pytest.approx(ttft(run))


def test_a_point_is_measured_again_while_the_machine_changes_speed(monkeypatch):
    from orca_lab.sim import fidelity
    outcomes = iter([("a", False), ("b", False), ("c", True), ("d", True)])
    assert fidelity.until_steady(lambda: next(outcomes)) == ("c", 3, True)
    monkeypatch.setattr(fidelity, "TRIES", 2)
    assert fidelity.until_steady(lambda: ("x", False)) == ("x", 2, False)
    assert fidelity.steady([1.0, 2.0], [1.05, 1.9]) and not fidelity.steady([1.0], [1.2])


def test_fitted_model_from_real_engine_timings_is_positive_and_close(tiny_llm):
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=4, n_slots=4096))
    runs = [llm.serve(ragged_trace(llm.cfg.vocab_size, n=10), system=s) for s in ("orca", "ft")]
    fit = FittedCost.fit(runs, llm.cfg.n_layers)
    assert all(c >= 0 for coef in fit.coef.values() for c in coef)
    err = fit.errors(runs)
    assert len(err) > 20 and (err["predicted_ms"] > 0).all()


# -- sweeps, the headline, K/V memory ---------------------------------------------------------------
def test_sweep_rows_capacity_and_parallel_runs_agree():
    backends = [SimBackend("gpt3-101b")]
    curves = [Curve("orca", 8), Curve("ft", 1, 1)]
    spec = TraceSpec(16, seed=3)
    serial = Sweep(backends, curves, spec, loads=[0.5, 1.5], capacity_requests=16, progress=False).run()
    assert set(CSV_COLUMNS) <= set(serial.columns) and len(serial) == 4
    assert serial["capacity_rps"].iloc[0] == pytest.approx(capacity(backends[0], curves[0], spec))
    assert (serial["load"].to_numpy() == pytest.approx([0.5, 1.5, 0.5, 1.5]))
    parallel = Sweep(backends, curves, spec, rates=[0.2, 0.4], n_procs=2, progress=False).run()
    again = Sweep(backends, curves, spec, rates=[0.2, 0.4], progress=False).run()
    cols = ["system", "max_bs", "rate", "throughput_rps", "norm_latency_median_ms"]
    pd.testing.assert_frame_equal(parallel[cols], again[cols])
    assert parallel["load"].isna().all()


def test_throughput_at_interpolates_on_log_latency_and_headline_picks_the_best_curves():
    pts = pd.DataFrame({"rate": [1, 2, 3], "throughput_rps": [1.0, 2.0, 2.5], "norm_latency_median_ms": [10, 100, 1000]})
    assert throughput_at(pts, 100) == (pytest.approx(2.0), True)
    assert throughput_at(pts, math.sqrt(10 * 100)) == (pytest.approx(1.5), True)
    assert throughput_at(pts, 5000) == (2.5, False) and math.isnan(throughput_at(pts, 5)[0])
    rows = [dict(model="m", system=s, max_bs=bs, mbs=mbs, **p) for s, bs, mbs, scale in
            [("orca", 8, None, 10), ("orca", 32, None, 20), ("ft", 1, 1, 1)] for p in
            [dict(rate=r, throughput_rps=r * scale, norm_latency_median_ms=50 * r) for r in (1, 2, 4)]]
    h = headline(pd.DataFrame(rows), "m", 100.0)
    assert (h["orca_curve"], h["ft_curve"]) == ("orca(32)", "ft(1,1)") and h["ratio"] == pytest.approx(20.0)
    with pytest.raises(ValueError, match="not in the sweep"):
        headline(pd.DataFrame(rows), "other")
    assert "never reached" not in describe(h) and "best ORCA orca(32) 40 req/s: 20.0x" in describe(h)
    assert describe({**h, "ft_reached": False}).endswith(
        "(FT never reached 100 ms/token in this sweep: its highest throughput counted)")
    assert "(FT and ORCA never reached 1000 ms/token in this sweep: each highest" in \
        describe(headline(pd.DataFrame(rows), "m", 1000.0))


def test_kv_occupancy_matches_the_engine_and_orders_the_schemes():
    occ, util = kv_study(SimBackend("gpt3-13b"), Curve("orca", 16), [4.0], 60, progress=False)
    assert (occ["max_tokens"] == occ["kv_reserved_engine"]).all()      # ORCA's n_rsrv, recomputed
    u = util.set_index("scheme")["utilization"]
    assert list(u.index) == list(SCHEMES)
    assert u["max_seq_len"] < u["max_tokens"] < u["true_length"] < u["paged"] <= 1.0
    assert (occ["used"] <= occ["paged"]).all() and (occ["paged"] <= occ["used"] + 16 * occ["n_holders"]).all()


def test_reservation_table_puts_grouped_query_slots_beside_gpt3_s():
    df = reservation_table(max_bs=200, n_requests=200).set_index("model")
    gpt, llama = df.loc["gpt3-175b"], df.loc["llama3-70b"]
    assert gpt["kv_bytes_per_token"] == 2 * 96 * 96 * 128 * 2          # layers x K/V heads x head size, K and V
    assert llama["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2         # 8 K/V heads, not 64
    for model, row in df.iterrows():
        assert row["n_slots"] == AnalyticalCost(model, "a100-80gb", 8, 1).n_slots()
        assert row["requests_fit_max_tokens"] == row["n_slots"] // (512 + 128)
        assert row["waste_paged"] < row["waste_max_tokens"] and row["paged_rps"] >= row["orca_rps"]
    assert llama["requests_fit_max_tokens"] > 20 * gpt["requests_fit_max_tokens"]
    assert gpt["orca_batch"] < gpt["paged_batch"]                      # GPT-3's reservation binds the batch
    assert llama["orca_batch"] == llama["paged_batch"] == 200          # Llama's never does here


def test_fidelity_statistics_of_a_run_and_their_summary_as_the_field_reports_them():
    from orca_lab.metrics import per_request
    from orca_lab.sim.fidelity import STATS, field_summary, request_stats
    trace = TraceSpec(40, seed=2, scale=0.2).make(2.0, 50257)
    run = SimBackend("gpt3-13b").serve(Curve("orca", 8), trace)
    stats, df = request_stats(run), per_request(run)
    assert set(stats) == set(STATS)
    assert stats["norm_latency_p95"] == pytest.approx(df["norm_latency"].quantile(0.95) * 1e3)
    assert stats["ttft_mean"] == pytest.approx(df["ttft"].mean() * 1e3)
    assert stats["norm_latency_median"] <= stats["norm_latency_p95"] and stats["e2e_mean"] > stats["ttft_mean"] > 0
    errs = {f"{k}_error_pct": [1.0, -4.0, 30.0] for k in STATS}
    table = pd.DataFrame({"load": [0.3, 0.8, 0.9], "run_load": [0.3, 0.85, 1.2],
                          "latency_error_at_run_speed_pct": [2.0, -6.0, 50.0], **errs})
    s = field_summary(table).set_index("statistic")
    assert s.loc["latency_error_at_run_speed", "max_abs_pct"] == 6.0      # the point past saturation is left out
    assert s.loc["latency_error_at_run_speed", "points"] == 2
    assert s.loc["vidur: norm_latency_p95 error at load 0.8", "max_abs_pct"] == 4.0
# -- measure mode: the paper's Table 1, scaled to the GPUs present -----------------------------------
@pytest.mark.parametrize("preset,n_gpus,expected", [
    ("gpt3-13b", 1, (1, 1)), ("gpt3-101b", 8, (8, 1)), ("gpt3-175b", 16, (8, 2)), ("gpt3-341b", 32, (8, 4)),
    ("gpt3-175b", 8, (8, 1)), ("gpt3-341b", 8, (8, 1)), ("gpt3-101b", 2, (2, 1)), ("gpt3-341b", 0, (1, 1)),
    ("tiny", 8, (1, 1)),
])
def test_scaled_parallelism_follows_table_1_within_the_gpus(preset, n_gpus, expected):
    assert P.scaled_parallelism(preset, n_gpus) == expected


def test_measure_settings_resolve_auto():
    assert P.check_mode("simulate", "tiny", "auto") == "a100-40gb"
    device = P.check_mode("measure", "gpt3-175b", "auto")
    assert device == ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":     # on a CPU: fp32, one process, unless asked for workers (gloo)
        assert P.check_measure("gpt3-175b", "cpu", "auto", None, None) == dict(
            preset="gpt3-175b", device="cpu", dtype="float32", tensor_parallel=1, pipeline_parallel=1)
        assert P.check_measure("tiny", "cpu", "bfloat16", 2, 2)["tensor_parallel"] == 2
        with pytest.raises(ValueError, match="no CUDA GPU"):
            P.check_mode("measure", "tiny", "cuda")
    else:
        settings = P.check_measure("gpt3-13b", device, "auto", None, None)
        assert settings["dtype"] == "bfloat16" and settings["tensor_parallel"] == 1
        with pytest.raises(ValueError, match="GPUs, but this machine has"):
            P.check_measure("tiny", device, "auto", torch.cuda.device_count() + 1, None)


def test_real_backend_warms_up_each_shape_once_before_timing_it(monkeypatch):
    """A first sight of (curve, lengths) runs a short untimed copy first (Triton's JIT inside a timed
    span made a Figure 9 point 3.9 s instead of 0.52 s); a shape seen before is timed at once."""
    from orca_lab.sim.backends import RealBackend
    from orca_lab.workload import homogeneous_trace
    calls, real = [], LLM.serve

    def serve(self, trace, system="orca", mbs=None, progress=False):
        calls.append((system, [t.max_gen_tokens for t in trace]))
        return real(self, trace, system, mbs, progress)

    monkeypatch.setattr(LLM, "serve", serve)
    backend = RealBackend("tiny", n_slots=4096)
    trace = homogeneous_trace(3, 8, 5, None, 0, backend.cfg.vocab_size)
    for curve in (Curve("orca", 2), Curve("orca", 2), Curve("ft", 2, 2)):
        assert len(backend.serve(curve, trace).requests) == 3
    warm, timed = ("orca", [2, 2]), ("orca", [5, 5, 5])
    assert calls == [warm, timed, timed, ("ft", [2, 2]), ("ft", [5, 5, 5])]
    assert backend.describe() == dict(preset="tiny", device="cpu", dtype="float32", n_slots=4096,
                                      tensor_parallel=1, pipeline_parallel=1)


def test_the_baselines_warm_up_is_two_iterations_of_the_timed_runs_first_shapes():
    """ft(2,2) with prompts of 8 and 40 tokens: two tokens of the whole prompts fed 32 of them one per
    iteration (34 iterations, untimed but paid); cut to the shortest prompt, two iterations, the same
    shapes the timed run starts with. One LLM per max_bs: its K/V pool serves every run."""
    from orca_lab.sim.backends import RealBackend
    backend = RealBackend("tiny", n_slots=4096)
    trace = [TraceItem(0.0, tuple(range(1, n + 1)), 3) for n in (8, 40)]
    curve = Curve("ft", 2, 2)
    warm = backend.warm_up(backend.llm_for(2), curve, trace)
    assert len(warm.iterations) == 2 and [it.q_lens for it in warm.iterations] == [(8, 8), (1, 1)]
    assert backend.warm_up(backend.llm_for(2), curve, trace) is None
    pool = backend.llm_for(2)._pool().k
    run = backend.serve(curve, trace)
    assert len(run.iterations) == 40 + 3 - 8 and run.iterations[0].q_lens == (8, 8)
    assert backend.llm_for(2)._pool().k is pool and backend.llm_for(4) is not backend.llm_for(2)


def test_a_real_backend_takes_the_engines_slots_and_lends_one_pool_to_every_max_bs():
    """``n_slots`` None is ``EngineConfig``'s: 16384 on a CPU (on a GPU, what its free memory holds
    beside the weights, as the simulator: a fixed 16384 put FT out of slots at batch 16 on an H200
    with room for ~120k). Every max_bs's LLM writes the first LLM's pool: one each would have taken
    the GPU's memory as many times over."""
    from orca_lab.sim.backends import RealBackend
    from orca_lab.workload import homogeneous_trace
    backend = RealBackend("tiny", n_slots=None)
    assert backend.n_slots == backend.describe()["n_slots"] == 16384
    two, four = backend.llm_for(2), backend.llm_for(4)
    assert two is not four and two.kv_pool is four.kv_pool is backend.llm.kv_pool
    trace = homogeneous_trace(3, 8, 3, None, 0, backend.cfg.vocab_size)
    runs = [backend.serve(Curve("ft", 2, 2), trace), backend.serve(Curve("orca", 4), trace)]
    assert [[r.n_generated for r in run.requests] for run in runs] == [[3, 3, 3]] * 2
    assert runs[0].config["n_slots"] == runs[1].config["n_slots"] == 16384


def test_a_sweep_fitted_to_a_budget_shrinks_requests_then_the_costliest_loads_and_keeps_the_knee():
    """Synthetic costs: a run of n requests at load x takes n / min(x, 1) seconds (a light load's
    trace takes longest to arrive), a capacity run n. Requests shrink to the floor first, then the
    costliest load goes, one load below saturation and one past it stay, and the requests grow back."""
    from orca_lab.sim.budget import fit_to
    xs = [0.25, 0.5, 1.0, 2.0]
    predict = lambda n: {**{("c", None): float(n)}, **{("c", x): n / min(x, 1.0) for x in xs}}
    total = lambda n, kept: n + sum(n / min(x, 1.0) for x in kept)
    assert fit_to(40, xs, predict, 1e9, 16)[:2] == (40, xs)                 # it fits: nothing shrunk
    assert fit_to(40, xs, predict, 300, 16)[:2] == (33, xs)                  # 33 x 9 s: fewer requests
    n, kept, runs = fit_to(40, xs, predict, 120, 16)     # at 16 requests 0.25 goes; they grow back to 24
    assert (n, kept) == (24, [0.5, 1.0, 2.0]) and sum(runs.values()) == total(24, kept) == 120
    assert set(runs) == {("c", None), ("c", 0.5), ("c", 1.0), ("c", 2.0)}
    n, kept, _ = fit_to(40, xs, predict, 60, 16)         # then 1.0 (0.5 is the last below 1), then requests
    assert (n, kept) == (15, [0.5, 2.0]) and total(n, kept) <= 60
    assert fit_to(40, xs, predict, 1.0, 16)[0] == 4                          # the least: the caller refuses


def test_the_budget_plan_is_refused_when_even_the_least_sweep_does_not_fit_and_models_the_device():
    from orca_lab.sim.budget import HOST_EAGER_S_PER_LAYER, BudgetedSweep, device_model
    from orca_lab.config import model_config

    class Real:     # what a plan reads of a RealBackend
        cfg, name, n_slots = model_config("gpt2"), "gpt2", 16384

        def describe(self):
            return dict(preset="gpt2", device="cuda", tensor_parallel=1, pipeline_parallel=1)

    h100 = device_model("gpt2", "cuda", gpu_name="NVIDIA H100 80GB HBM3")
    assert "h100 model" in h100[1] and "a100-40gb" in device_model("gpt2", "cuda", gpu_name="NVIDIA L4")[1]
    assert device_model("tiny", "cpu")[0].coef["padded"][0] > 0 and "gpt2's" in device_model("gpt3-13b", "cpu")[1]
    reqs = [Request(i, [1] * 40, SamplingParams(max_gen_tokens=4)) for i in range(8)]
    for r in reqs:
        r.n_cached = 40
    padded, decode, chunk = Batch.padded_step(reqs, 40, 1), Batch(reqs, [40] * 8, [1] * 8), Batch(reqs, [38] * 8, [2] * 8)
    cost = h100[0]
    # one-token steps replay graphs, the baseline's padded ones too (DecodeGraphs.takes); longer ones do not
    assert sum(cost.iteration(chunk).stages) >= 12 * HOST_EAGER_S_PER_LAYER > sum(cost.iteration(padded).stages)
    assert cost.iteration(padded).stages == cost.iteration(decode).stages
    curves = [Curve("orca", 8), Curve("ft", 8, 8)]
    with pytest.raises(ValueError, match=r"budget_s=40 is too small .* allowed budget_s >= \d+"):
        BudgetedSweep(Real(), curves, TraceSpec(24, 0, 0.5), None, [0.5, 2.0], 40, model=h100, progress=False)
    plan = BudgetedSweep(Real(), curves, TraceSpec(24, 0, 0.5), None, [0.25, 0.5, 1.0, 2.0], 60,
                         model=h100, progress=False).plan     # 90 s fits as asked (both graphed), 60 s does not
    # (a GPU's first curve pays 25 s of Triton's JIT and tuning: FIRST_WARM_S)
    assert plan.fits and plan.n_requests < 24 and plan.xs == [0.5, 2.0]
    assert plan.shrunk()[0] == f"n_requests 24 -> {plan.n_requests}" and "dropped [0.25, 1]" in plan.shrunk()[1]
    assert {c for c, _ in plan.runs} == {"orca(8)", "ft(8,8)"} and {x for _, x in plan.runs} == {None, 0.5, 2.0}


def test_orca_lab_compare_warms_the_baseline_up_on_its_first_iterations_shapes_only(tiny_llm, monkeypatch):
    """compare's warm-up (the longest prompt in its batch) fed ft 32 one-token iterations of 8- to
    40-token prompts; cut to the shortest, two; ORCA's batch keeps its whole prompts."""
    from orca_lab.compare import warm_up
    seen, real = [], LLM.serve

    def serve(self, trace, system="orca", mbs=None, progress=False):
        result = real(self, trace, system, mbs, progress)
        seen.append((system, [len(t.prompt) for t in trace], len(result.iterations)))
        return result

    monkeypatch.setattr(LLM, "serve", serve)
    warm_up(tiny_llm, [TraceItem(0.0, tuple(range(1, n + 1)), 5) for n in (8, 40, 20)])
    assert seen == [("orca", [8, 40, 20], 2), ("ft", [8, 8, 8], 2)]
