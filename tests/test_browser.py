"""A real browser: JupyterLab in headless Chromium runs 08_pipelined_schedules and plays its animation;
the HTML figures (``orca-lab compare``'s page, a reproduction's export) fit a 1,366 x 768 window.

JupyterLab serves a temporary folder holding a solved copy of the notebook (``orca_lab.course.solve``;
autosave never writes outputs into the repository), on 127.0.0.1, a free port, a random token and no
news pop-up; its settings and workspaces live in that folder too. Playwright's Python package drives Debian's Chromium
(``/usr/bin/chromium``; a downloaded browser is never used). Screenshots go to ``tmp_path``, and also
to ``$ORCA_LAB_SCREENSHOTS`` (e.g. ``docs/img``) when set. Every process the test starts carries a
marker in its environment, so teardown finds the server and its kernels, and nothing else.
"""
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from orca_lab.course import solve

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "08_pipelined_schedules.ipynb"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
MARKER = "ORCA_LAB_BROWSER_TEST"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marked_pids(marker: str) -> list[int]:
    """Processes whose environment holds ``MARKER=marker``: this test's server and kernels."""
    needle = f"{MARKER}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:          # gone, or not ours to read
                pass
    return pids


def _get(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _need_chromium():
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (never `playwright install`)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found: install it with `apt-get install chromium` (scripts/test.sh does)")


def _screenshot_folders(tmp_path) -> list[Path]:
    return [tmp_path] + ([Path(os.environ["ORCA_LAB_SCREENSHOTS"])] if os.environ.get("ORCA_LAB_SCREENSHOTS") else [])


@pytest.fixture
def jupyterlab(tmp_path):
    """(base url, token) of a JupyterLab serving a copy of the notebook; stopped, with its kernels, after."""
    _need_chromium()
    root = tmp_path / "lab"
    # Settings: every cell in the DOM (the widget is there however far down it sits), the notebook's
    # kernel started without a "Select Kernel" dialog, and no news toast over the page.
    for plugin, values in {"notebook-extension/tracker": {"windowingMode": "none", "autoStartDefaultKernel": True},
                           "apputils-extension/notification": {"fetchNews": "false"}}.items():
        path = root / ".settings" / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    solve.dump(solve.solved(ROOT / "notebooks" / NOTEBOOK), root / NOTEBOOK)   # its exercises solved
    port, token, marker = _free_port(), secrets.token_hex(16), secrets.token_hex(8)
    env = {**os.environ, MARKER: marker, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           "--LabApp.news_url=None", f"--ServerApp.root_dir={root}",
           f"--LabApp.user_settings_dir={root / '.settings'}", f"--LabApp.workspaces_dir={root / '.ws'}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly"] + ["--allow-root"] * (os.geteuid() == 0)
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                _get(f"{base}/api/status?token={token}")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start: {(tmp_path / 'jupyterlab.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield base, token
    finally:
        try:   # a clean stop shuts the kernels down too
            req = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(req, timeout=5).close()
            server.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for pid in [server.pid] * (server.poll() is None) + _marked_pids(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        server.wait(timeout=10)
        log.close()
        deadline = time.monotonic() + 10
        while _marked_pids(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _marked_pids(marker), "a JupyterLab or kernel process outlived the test"


def test_notebook_08_runs_and_plays_in_jupyterlab(jupyterlab, tmp_path):
    from playwright import sync_api

    base, token = jupyterlab
    shots = _screenshot_folders(tmp_path)
    frame = ".orca-animation .orca-frame"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}")
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            page.wait_for_function("""() => /ipykernel\\) \\| Idle/.test(
                document.querySelector('#jp-main-statusbar').innerText)""", timeout=60_000)   # kernel ready
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

            page.wait_for_selector(frame, timeout=120_000)          # the widget rendered (a loaded host runs the cells slowly)
            assert page.get_attribute(frame, "data-frame") == "0"
            # all cells done, so the kernel is free to answer the slider
            page.wait_for_function("""() => [...document.querySelectorAll('.jp-InputPrompt')]
                .every(e => !e.textContent.includes('*'))""", timeout=120_000)
            # orca_lab.viz.show sends a PNG with the figure: plotly's JupyterLab renderer shows the PNG
            # and swaps in the interactive plot when the pointer enters it
            page.locator(".jp-RenderedPlotly img.plot-img").first.dispatch_event("mouseenter")
            page.locator(".js-plotly-plot").first.wait_for(timeout=30_000)

            play = page.locator(".orca-animation .widget-play button").first   # Play; Pause once playing
            play.click()
            page.wait_for_function(f"() => +document.querySelector('{frame}').dataset.frame >= 3",
                                   timeout=30_000)
            play.click()                                             # Pause, for a steady screenshot
            page.wait_for_timeout(500)
            assert int(page.get_attribute(frame, "data-frame")) >= 3
            assert "workers" in page.inner_text(frame)
            for folder in shots:
                folder.mkdir(parents=True, exist_ok=True)
                page.locator(".orca-animation").screenshot(path=folder / "animation.png")
                page.locator(".js-plotly-plot").first.screenshot(path=folder / "timeline_jupyterlab.png")
        except Exception:
            page.screenshot(path=tmp_path / "failure.png", full_page=True)   # what the page showed
            raise
        finally:
            browser.close()
    assert (tmp_path / "animation.png").stat().st_size > 5_000


# Where each part of a drawn plotly figure lies on the page: every subplot's plot area, the legend, and
# every title (the figure's, the panels', the axes').
BOXES = """gd => {
    const box = e => { const b = e.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; };
    return {panels: [...gd.querySelectorAll('.draglayer .nsewdrag')].map(box),
            legend: box(gd.querySelector('.legend')),
            entries: [...gd.querySelectorAll('.legend .traces .legendtext')].map(t => t.textContent),
            titles: [...gd.querySelectorAll('.infolayer > g, .annotation')]
                .filter(g => /title|annotation/.test(g.getAttribute('class')) && g.getBBox().width > 0).map(box),
            page: [document.documentElement.scrollWidth, document.documentElement.scrollHeight]};
}"""


def _compare_from_saved(path: Path):
    """The Comparison of a saved ``compare.json`` (its summary and the runs it kept)."""
    import pandas as pd

    from orca_lab.compare import SYSTEMS, Comparison
    from orca_lab.engine.engine import IterationRecord, RequestRecord, RunResult
    report = json.loads(path.read_text())
    runs = {(r["system"], r["rate"]): RunResult(r["system"], [RequestRecord(**q) for q in r["requests"]],
                                                [IterationRecord(**i) for i in r["iterations"]], r["config"],
                                                r["duration"]) for r in report["runs"]}
    table = pd.DataFrame(report["summary"]).assign(system=lambda t: pd.Categorical(t["system"], SYSTEMS))
    return Comparison(report["capacity_rps"], runs, table)


def test_compare_page_and_a_reproduction_fit_a_1366x768_window(tmp_path):
    """``orca-lab compare``'s page (from a small saved run) and Figure 10's reproduction export (from its
    saved simulate run), opened at 1,366 x 768: every panel, every title and the legend naming each line
    lie inside the window, the legend clear of the panels, and nothing to scroll sideways."""
    import pandas as pd

    from orca_lab.viz import export
    from orca_lab.viz.curves import latency_throughput_figure
    _need_chromium()
    from playwright import sync_api

    export(_compare_from_saved(ROOT / "tests" / "data" / "compare_small.json").figure(), tmp_path / "compare.html")
    results = ROOT / "docs" / "results"
    fig = latency_throughput_figure(pd.read_csv(results / "fig_e2e_sim.csv"), title="Figure 10 (simulate, a100-40gb)",
                                    headlines=json.loads((results / "fig_e2e_headline.json").read_text()))
    export(fig, tmp_path / "fig_e2e", formats=["html"])     # as reproduce/fig_e2e.ipynb exports it
    width, height = 1366, 768
    pages = {"compare": (4, {"orca", "ft"}), "fig_e2e": (3, {"orca(1)", "orca(32)", "ft(1,1)", "ft(8,8)"})}
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": width, "height": height})
        page.set_default_timeout(60_000)     # 4.8 MB of inline plotly.js: seconds on a busy host
        try:
            for name, (n_panels, lines) in pages.items():
                page.goto((tmp_path / f"{name}.html").as_uri())
                gd = page.wait_for_selector(".js-plotly-plot .legend .traces").evaluate_handle(
                    "e => e.closest('.js-plotly-plot')")
                seen = page.evaluate(BOXES, gd)
                for folder in _screenshot_folders(tmp_path):
                    folder.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=folder / f"{name}_{width}x{height}.png")
                assert len(seen["panels"]) == n_panels, name
                assert lines <= set(seen["entries"]), (name, seen["entries"])
                for what, (left, top, right, bottom) in ([("legend", seen["legend"])] + [("panel", b) for b in seen["panels"]]
                                                         + [("title", b) for b in seen["titles"]]):
                    assert 0 <= left and right <= width and 0 <= top and bottom <= height, (name, what, seen)
                for left, top, right, bottom in seen["panels"]:
                    lg = seen["legend"]
                    assert right <= lg[0] or lg[2] <= left or bottom <= lg[1] or lg[3] <= top, (name, "legend on a panel")
                assert seen["page"][0] <= width, (name, "the page scrolls sideways", seen["page"])
        except Exception:
            page.screenshot(path=tmp_path / "failure.png", full_page=True)
            raise
        finally:
            browser.close()
