"""Figure builders and the schedule animation, read from RunResults; no browser needed.

The pipelined runs use the simulator's executor with one time unit per stage (the paper's Figure 8),
so every start, end and frame below is exact.
"""
from types import SimpleNamespace

import pytest

from orca_lab import LLM, EngineConfig
from orca_lab.engine.engine import RunResult
from orca_lab.sim.executor import IterationCost
from orca_lab.sim.sweep import Curve
from orca_lab.sim.backends import SimBackend
from orca_lab.viz import (ScheduleFrames, animate, busy_fraction, export, kv_occupancy, kv_occupancy_figure,
                          timeline_figure, tokens_figure)
from orca_lab.viz.animation import STATES
from orca_lab.workload import TraceItem

A, B, C, D, E, F = range(6)


def unit_pipeline(n_stages):
    return SimBackend("tiny", cost=SimpleNamespace(
        n_stages=n_stages, iteration=lambda batch: IterationCost((1.0,) * n_stages)), n_slots=4096)


@pytest.fixture(scope="module")
def figure8():
    """Six requests, three workers: ORCA with max_bs 2, and ft(4, 2) with its micro-batches."""
    trace = [TraceItem(0.0, (1, 2), 3) for _ in range(6)]
    sim = unit_pipeline(3)
    return sim.serve(Curve("orca", 2), trace), sim.serve(Curve("ft", 4, 2), trace)


def test_orca_fills_the_pipeline_with_ab_cd_ef(figure8):
    orca, _ = figure8
    frames = ScheduleFrames(orca)
    assert len(frames) == 9 + 1 and frames.labels[A] == "A"       # + the end, every batch back
    assert [f.batch for f in frames[:4]] == [(A, B), (C, D), (E, F), (A, B)]
    assert frames[2].in_flight == ((A, B), (C, D), (E, F))
    assert frames[2].workers == ((E, F), (C, D), (A, B))     # every worker busy
    assert frames[3].returned == ((A, B),) and frames[3].workers == ((A, B), (E, F), (C, D))
    assert frames.describe(2) == ("iteration 2: Select -> EF; n_rsrv 30; in flight AB CD EF; "
                                  "workers EF | CD | AB")
    assert frames[8].in_flight == ((A, B), (C, D), (E, F)) and not frames[8].finished
    assert frames[-1].iteration is None and frames[-1].finished == (A, B, C, D, E, F)
    assert frames[-1].pool == () and frames[-1].n_rsrv == 0 and frames[-1].time == 11
    assert busy_fraction(orca) == pytest.approx([9 / 11] * 3)


def test_ft_micro_batches_leave_bubbles(figure8):
    _, ft = figure8
    frames = ScheduleFrames(ft)
    assert frames[1].workers == ((C, D), (A, B), None)
    assert frames[2].workers == ((A, B), None, (C, D))        # one worker in three idles
    assert {e.rid: e.state for e in frames[0].pool}[E] == "waiting"   # E waits for the whole batch
    assert max(busy_fraction(ft)) < 0.5


def test_ft_holds_the_finished_requests_of_its_batch():
    trace = [TraceItem(0.0, (1, 2), g) for g in (3, 1, 2, 3)]
    ft = unit_pipeline(3).serve(Curve("ft", 4, 2), trace)
    held = {rid for it in ft.iterations for rid, p in zip(it.rids, it.phases) if p == "held"}
    assert held == {B, C}
    frames = ScheduleFrames(ft)
    assert frames[-1].finished == (A, B, C, D)
    assert all(f.finished in ((), (A, B, C, D)) for f in frames), "the batch returns all at once"


@pytest.mark.parametrize("which", [0, 1])
def test_frames_agree_with_algorithm_1(figure8, which):
    run = figure8[which]
    max_tokens = {r.rid: r.prompt_len + r.n_generated for r in run.requests}
    frames = ScheduleFrames(run)
    for f in frames:
        states = {e.rid: e.state for e in f.pool}
        assert set(states.values()) <= set(STATES)
        assert all(states[rid] == "running" for rid in f.batch)
        assert {rid for b in f.in_flight for rid in b} == {rid for rid, s in states.items() if s == "running"}
        assert not set(f.finished) & set(states)
        if run.system == "orca":
            # n_rsrv = max_tokens of every request scheduled at least once and not finished
            assert f.n_rsrv == sum(max_tokens[e.rid] for e in f.pool if e.state != "waiting")
            # FCFS: in arrival order, iterations run (returned or in flight) never increase
            runs = [e.n_done + (e.state == "running") for e in f.pool]
            assert runs == sorted(runs, reverse=True)


def test_frames_step_like_a_list(figure8):
    frames = ScheduleFrames(figure8[0])
    assert frames[-1] == frames[len(frames) - 1] and frames[1:3] == [frames[1], frames[2]]
    with pytest.raises(IndexError, match="frame 10 is out of range"):
        frames[10]
    html = frames.to_html(4)
    assert 'data-frame="4"' in html and "n_rsrv = 30" in html and html.count("orca-req") > 6


def test_animation_steps_without_a_browser(figure8):
    anim = animate(figure8[0], interval_ms=100)
    assert anim.play.max == anim.slider.max == 9 and anim.play.interval == 100
    anim.slider.value = 5                       # what Play does through the browser
    assert 'data-frame="5"' in anim.view.value
    anim.show(2)
    assert anim.slider.value == 2 and 'data-frame="2"' in anim.view.value
    assert "application/vnd.jupyter.widget-view+json" in anim._repr_mimebundle_()


def test_nothing_to_animate_is_refused():
    with pytest.raises(ValueError, match="no iteration"):
        animate(RunResult("orca", [], [], {}))


def test_timeline_has_a_slice_per_request_and_stage(figure8):
    orca, ft = figure8
    for run in (orca, ft):
        fig = timeline_figure(run, time_unit="units")
        slices = sum(len(tr.x) for tr in fig.data if tr.showlegend is False)
        assert slices == sum(len(it.rids) for it in run.iterations)
        assert list(fig.layout.yaxis.ticktext) == ["worker 1", "worker 2", "worker 3"]
    held = next(tr for tr in timeline_figure(ft).data if tr.name == "held" and tr.showlegend is False)
    assert len(held.x) == sum(p == "held" for it in ft.iterations for p in it.phases)
    first = timeline_figure(orca, first=2)
    assert sum(len(tr.x) for tr in first.data if tr.showlegend is False) == 2 * 2 * 3
    with pytest.raises(ValueError, match="time_unit='hours'"):
        timeline_figure(orca, time_unit="hours")


def test_kv_occupancy_and_tokens(figure8):
    orca, ft = figure8
    rows = kv_occupancy(orca)
    assert all(r["used"] + r["reserved"] + r["free"] == 4096 for r in rows)
    assert [r["used"] + r["reserved"] for r in rows[:3]] == [10, 20, 30]     # 2 requests x 5 tokens each
    assert kv_occupancy(ft)[0]["reserved"] == 4 * 1024 - 0                   # max_seq_len per request
    fig = kv_occupancy_figure([orca, ft], x="iteration")
    assert len(fig.data) == 6 and fig.layout.annotations[1].text == "ft"
    tok = tokens_figure(orca)
    per_iteration = [sum(tr.y[i] for tr in tok.data) for i in range(9)]
    assert per_iteration == [it.n_tokens for it in orca.iterations if it.stage == 0]
    with pytest.raises(ValueError, match="n_slots"):
        kv_occupancy(RunResult("orca", [], [], {}))
    with pytest.raises(ValueError, match="x='wall'"):
        kv_occupancy_figure(orca, x="wall")


def test_frames_of_the_in_process_engine(tiny_llm, tmp_path):
    """The local executor runs the stages one after another: one busy worker at any time."""
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=2, n_slots=512, pipeline_parallel=2, executor="local"))
    run = llm.serve([TraceItem(0.0, (1, 2, 3), 2), TraceItem(0.0, (4, 5), 3), TraceItem(0.0, (6,), 1)])
    frames = ScheduleFrames(run)
    assert len(frames) == len({it.iteration for it in run.iterations}) + 1
    assert all(sum(w is not None for w in f.workers) == 1 for f in frames[:-1])
    assert frames[0].in_flight == ((0, 1),) and frames[1].in_flight == ((0, 1), (2,))
    out = export(timeline_figure(run, time_unit="ms"), tmp_path / "timeline.html")
    assert out[0].stat().st_size > 10_000


# -- export without a Chromium: the HTML and one warning, never an error ---------------------------
@pytest.fixture
def export_module(monkeypatch):
    import importlib
    ex = importlib.import_module("orca_lab.viz.export")   # the package attribute is the function
    monkeypatch.setattr(ex, "_warned", False)
    return ex


def small_figure():
    import plotly.graph_objects as go
    return go.Figure(go.Scatter(x=[1, 2, 3], y=[3, 1, 2]))


def test_export_without_chromium_writes_the_html_and_warns_once(export_module, monkeypatch, tmp_path):
    import warnings
    monkeypatch.setattr(export_module, "browser", lambda: None)
    with pytest.warns(export_module.ExportSkipped,
                      match=r"PDF/PNG/SVG export skipped \(no Chromium found\): a.png, a.svg, a.pdf not written; "
                            r"the HTML is, at .*a.html.*apt-get install chromium.*BROWSER_PATH"):
        out = export(small_figure(), tmp_path / "a", formats=["html", "png", "svg", "pdf"])
    assert out == [tmp_path / "a.html"] and out[0].stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.html"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # once per process: no second warning
        assert export(small_figure(), tmp_path / "b.png") == [tmp_path / "b.html"]   # HTML though not asked
    assert (tmp_path / "b.html").is_file() and not (tmp_path / "b.png").exists()


def test_export_degrades_when_chromium_fails_to_start(export_module, monkeypatch, tmp_path):
    monkeypatch.setattr(export_module, "browser", lambda: "/usr/bin/chromium")
    monkeypatch.setattr(export_module, "_server_started", True)
    fig = small_figure()

    def broken(*a, **kw):
        raise RuntimeError("Chromium exited: no usable sandbox")

    monkeypatch.setattr(fig, "write_image", broken)
    with pytest.warns(export_module.ExportSkipped, match=r"PNG export skipped \(Chromium failed: RuntimeError: "
                                                         r"Chromium exited: no usable sandbox\)"):
        assert export(fig, tmp_path / "c", formats=["png"]) == [tmp_path / "c.html"]


def test_export_refuses_an_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="format 'jpg'"):
        export(small_figure(), tmp_path / "d", formats=["html", "jpg"])
    assert not list(tmp_path.iterdir())


def test_the_html_fits_the_window_and_the_figure_keeps_its_size_for_the_static_formats(tmp_path):
    """The page's figure has no fixed size, follows the window and keeps its legend under the panels;
    the figure passed in (which kaleido draws for PNG/SVG/PDF) keeps its width, height and legend."""
    from orca_lab.viz.export import fit_window
    fig = small_figure().update_layout(title="wide <and> tall", width=1600, height=420)
    fitted = fit_window(fig).layout
    assert (fitted.width, fitted.height, fitted.autosize) == (None, None, True)
    assert (fitted.legend.orientation, fitted.legend.yref, fitted.legend.y) == ("h", "container", 0)
    (page,) = export(fig, tmp_path / "w.html")
    html = page.read_text()
    assert '{"responsive": true}' in html and 'style="height:min(420px, 100vh); width:100%;"' in html
    assert "<title>wide &lt;and&gt; tall</title>" in html and '"width":1600' not in html
    assert (fig.layout.width, fig.layout.height, fig.layout.legend.orientation) == (1600, 420, None)
