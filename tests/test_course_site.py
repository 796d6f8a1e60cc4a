"""The course site (``orca-lab course build``) builds offline and every chapter page shows its figures
in a real browser.

The build executes two small chapters (a course notebook whose figures go through ``viz.show``, and a
reproduction whose figure is plotly's own output) and builds the site with Sphinx; a second build takes
those executed notebooks as they are (the ``executed=DIR`` hook) and runs nothing. Debian's Chromium,
driven by Playwright as in ``test_browser.py``, opens each chapter of the chapter map from ``file://``:
every image loads, every plotly figure is drawn by the site's own plotly.js, no script fails, and no
request leaves the site (no CDN, no font service). Screenshots go to ``tmp_path`` and to
``$ORCA_LAB_SCREENSHOTS`` when set. ``ORCA_LAB_COURSE_SITE=build/course`` checks a full build instead.
"""
import base64
import os
import re
from pathlib import Path

import nbformat
import pytest

pytest.importorskip("myst_nb", reason='pip install -e ".[docs]"')
pytest.importorskip("sphinx_book_theme", reason='pip install -e ".[docs]"')

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
CHAPTERS = ["02_request_level_batching", "fig9_engine"]
LOCAL = ("file:", "data:", "blob:", "about:")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """(html folder, what each chapter's figures became) of a fresh build, or of ORCA_LAB_COURSE_SITE."""
    if os.environ.get("ORCA_LAB_COURSE_SITE"):
        return Path(os.environ["ORCA_LAB_COURSE_SITE"]).resolve() / "html", None
    from orca_lab.course.site import build
    out = tmp_path_factory.mktemp("course")
    first = build(out / "a", only=CHAPTERS, log=lambda *a: None)
    assert all(r["cells_with_errors"] == 0 for r in first["runs"]), first["runs"]
    again = build(out / "b", executed=out / "a" / "executed", only=CHAPTERS, log=lambda *a: None)
    assert again["runs"] is None and again["figures"] == first["figures"]
    return again["html"], again["figures"]


def test_the_site_has_the_chapter_map_and_every_chapter(site):
    html, figures = site
    index = (html / "index.html").read_text()
    assert "Chapter map" in index
    rows = re.findall(r'<td><p><a class="reference internal" href="([^"]+\.html)"', index)
    assert rows, "no chapter in the chapter map"
    for href in rows:
        assert (html / href).exists(), href
    if figures is not None:
        assert len(rows) == len(CHAPTERS)
        assert figures["notebooks/02_request_level_batching.ipynb"]["interactive"] >= 1
        assert figures["reproduce/fig9_engine.ipynb"]["interactive"] == 1
    assert re.search(r"<td><p>\d+ s</p></td>", index), "no run time in the chapter map"


def test_every_chapter_loads_with_its_figures_in_chromium(site, tmp_path):
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (never `playwright install`)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found: install it with `apt-get install chromium` (scripts/test.sh does)")
    from playwright import sync_api
    html, figures = site
    shots = [tmp_path] + ([Path(os.environ["ORCA_LAB_SCREENSHOTS"])] if os.environ.get("ORCA_LAB_SCREENSHOTS") else [])
    outside, errors, drawn = [], [], 0
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("request", lambda r: None if r.url.startswith(LOCAL) else outside.append(r.url))
        page.on("pageerror", lambda e: errors.append(str(e)))
        try:
            page.goto((html / "index.html").as_uri())
            hrefs = page.eval_on_selector_all("table a.reference.internal", "as => as.map(a => a.href)")
            assert hrefs
            for href in hrefs:
                page.goto(href, wait_until="load")
                page.wait_for_function("""() => [...document.querySelectorAll('.plotly-graph-div')]
                    .every(d => d.querySelector('.main-svg'))""", timeout=30_000)
                seen = page.evaluate("""() => ({
                    plots: [...document.querySelectorAll('.plotly-graph-div')].filter(d => d.querySelector('.main-svg')).length,
                    images: [...document.querySelectorAll('.cell_output img')].map(i => i.complete && i.naturalWidth > 0),
                    title: document.querySelector('h1').innerText})""")
                name = Path(href).stem
                assert all(seen["images"]), f"{name}: an image did not load"
                drawn += seen["plots"] + len(seen["images"])
                if figures is not None:
                    part = Path(href).parent.name
                    want = figures[f"{part}/{name}.ipynb"]
                    assert seen["plots"] == want["interactive"], (name, seen, want)
                    assert len(seen["images"]) >= want["png"], (name, seen, want)
                figure = page.locator(".plotly-graph-div, .cell_output img")
                if figure.count():
                    figure.first.scroll_into_view_if_needed()
                for folder in shots:
                    folder.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=folder / f"course_{name}.png")
        finally:
            browser.close()
    assert drawn, "no figure on any chapter"
    assert not outside, f"requests left the site: {sorted(set(outside))[:5]}"
    assert not errors, errors[:3]


def test_big_figures_become_their_png_and_widgets_a_note():
    """A plotly figure past MAX_INTERACTIVE_BYTES keeps the PNG that viz.show sent beside it; a widget's
    output becomes a note over the HTML its widgets held, and its state leaves the notebook (myst-nb
    would load a CDN's widget manager); a progress bar keeps its text."""
    from orca_lab.course import figures
    png = base64.b64encode(b"\x89PNG not really").decode()
    small = {"data": [{"y": [1, 2]}], "layout": {}}
    big = {"data": [{"y": list(range(figures.MAX_INTERACTIVE_BYTES // 3))}], "layout": {}}
    state = {"x": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_y"]}},
             "y": {"model_name": "HTMLModel", "state": {"value": "<b>frame 0</b>"}}}
    nb = nbformat.v4.new_notebook(metadata={"widgets": {"application/vnd.jupyter.widget-state+json": {"state": state}}})
    nb.cells = [nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output(
        "display_data", data={figures.PLOTLY: fig, "image/png": png, "text/plain": "fig"})]) for fig in (small, big)]
    nb.cells.append(nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output(
        "display_data", data={figures.WIDGET: {"model_id": "x"}, "text/plain": w}) for w in ("w", "run: 100%|###| 3/3")]))
    assert figures.prepare(nb) == {"interactive": 1, "png": 1, "widget": 1}
    (a,), (b,), (c, bar) = (cell.outputs for cell in nb.cells)
    assert bar.data == {"text/plain": "run: 100%|###| 3/3"}
    assert "Plotly.newPlot" in a.data["text/html"] and "cdn" not in a.data["text/html"] and "image/png" not in a.data
    assert b.data["image/png"] == png and figures.PLOTLY not in b.data and "text/html" not in b.data
    assert "JupyterLab" in c.data["text/html"] and "<b>frame 0</b>" in c.data["text/html"]
    assert "widgets" not in nb.metadata
