"""The course site (``orca-lab course build``) builds offline and every chapter page shows its figures
in a real browser.

The build executes two small chapters (a course notebook whose figures go through ``viz.show``, and a
reproduction whose figure is plotly's own output) and builds the site with Sphinx; a second build takes
those executed notebooks as they are (the ``executed=DIR`` hook) and runs nothing. Debian's Chromium,
driven by Playwright as in ``test_browser.py``, opens each chapter of the chapter map from ``file://``:
every image loads, every plotly figure is drawn by the site's own plotly.js, no script fails, and no
request leaves the site (no CDN, no font service). Screenshots go to ``tmp_path`` and to
``$ORCA_LAB_SCREENSHOTS`` when set. ``ORCA_LAB_COURSE_SITE=build/course`` checks a full build instead.

The editions: both are built over every chapter of the course from the solved notebooks unexecuted
(the exercises are in the sources; the executed build above checks the outputs). In the learner's,
no line of any solution (``notebooks/solutions/``, the lines no learner notebook has) is in any
file of the site but the docs' pages, nor in the text Chromium shows of its chapter, and each
exercise cell is framed as one under a box naming its grader; the instructor's shows every
solution. docs/design.md's reading path gives true line counts, and every section cited is the paper's.
"""
import base64
import html as htmllib
import json
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
ROOT = Path(__file__).resolve().parents[1]


def _chromium():
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (never `playwright install`)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found: install it with `apt-get install chromium` (scripts/test.sh does)")
    from playwright import sync_api
    return sync_api


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """(html folder, what each chapter's figures became) of a fresh build, or of ORCA_LAB_COURSE_SITE."""
    if os.environ.get("ORCA_LAB_COURSE_SITE"):
        return Path(os.environ["ORCA_LAB_COURSE_SITE"]).resolve() / "html", None
    from orca_lab.course import mine
    from orca_lab.course.site import build
    out = tmp_path_factory.mktemp("course")
    learner = out / "learners_own"          # a learner's package, one exercise written: the build leaves it
    learner.mkdir()
    (learner / "select.py").write_text("__verdict__ = 'not graded'\n")
    before, os.environ[mine.ENV] = os.environ.get(mine.ENV), str(learner)
    try:
        first = build(out / "a", only=CHAPTERS, log=lambda *a: None)
    finally:
        os.environ.pop(mine.ENV) if before is None else os.environ.update({mine.ENV: before})
    assert all(r["cells_with_errors"] == 0 for r in first["runs"]), first["runs"]
    assert [p.name for p in learner.iterdir()] == ["select.py"] and "not graded" in (learner / "select.py").read_text()
    assert "def ft_iterations" in (out / "a" / "my_orca" / "ft_iterations.py").read_text()     # the build's own
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
    sync_api = _chromium()
    html, figures = site
    shots = [tmp_path] + ([Path(os.environ["ORCA_LAB_SCREENSHOTS"])] if os.environ.get("ORCA_LAB_SCREENSHOTS") else [])
    outside, errors, drawn = [], [], 0
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(120_000)   # a page from file:// took 19 s to load with both cores busy
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


def test_the_learner_edition_of_chapter_02_shows_its_figure_its_stubs_and_no_verdict(site):
    """Chapter 02, executed: its figure is drawn, its exercises are stubs, and no grader's ``correct``
    is on a page whose exercises are not done."""
    html, figures = site
    if figures is None:
        pytest.skip("a full build: checked by the editions' tests")
    page = (html / "notebooks" / "02_request_level_batching.html").read_text()
    assert "plotly-graph-div" in page and "YOUR CODE HERE" in page and "orca-exercise" in page
    assert "correct" not in "".join(re.findall(r'<div class="cell_output[^"]*">(.*?)</div>\s*</div>', page, re.S))


def test_learner_outputs_come_from_the_reference_run_labelled_after_the_first_exercise():
    """Before the first exercise an output is the chapter's own; the exercise cell and its grader's
    cell show none; an output after it is labelled as the reference solution's; a box before the
    exercise names its task (the stub's message) and its grader."""
    from orca_lab.course import edition
    v4 = nbformat.v4

    def notebook(answer):
        cells = [v4.new_code_cell("x0 = 1", id="a"), v4.new_code_cell(answer, id="ex", metadata={"tags": ["exercise:f"]}),
                 v4.new_code_cell("ch01.check_f(f)", id="g"), v4.new_code_cell("show(f)", id="b")]
        return v4.new_notebook(cells=cells)

    stub = '# YOUR CODE HERE\nraise NotImplementedError("f: the answer")'
    ran = notebook("def f(): return 42")
    for cell, text in zip(ran.cells, ("before", "", "correct", "42")):
        cell.outputs = [v4.new_output("stream", name="stdout", text=text)]
    nb = edition.make("learner", notebook(stub), ran)
    box, (a, ex, g, b) = nb.cells[1], [c for c in nb.cells if c.cell_type == "code"]
    assert a.outputs == ran.cells[0].outputs and ex.outputs == g.outputs == [] and ex.source == stub
    assert edition.REFERENCE in b.outputs[0].data["text/html"] and b.outputs[1:] == ran.cells[3].outputs
    assert box.cell_type == "markdown" and "f: the answer" in box.source and "`ch01.check_f`" in box.source
    assert edition.make("instructor", notebook(stub), ran) is ran
    with pytest.raises(ValueError, match="edition: 'student' is not one of learner, instructor"):
        edition.make("student", ran, ran)


def _solution_lines(notebook: Path) -> dict[str, list[str]]:
    """Exercise id -> the lines of its solution that no learner's notebook has, in code or prose
    (at least 12 characters: a bare ``break`` or ``return out`` tells nothing)."""
    from orca_lab.course import solve
    learner = "\n".join("".join(c["source"]) for p in solve.course() for c in solve.load(p)["cells"])
    return {ex: [ln.strip() for ln in body.splitlines() if len(ln.strip()) >= 12 and ln.strip() not in learner]
            for ex, body in solve.solutions(solve.solution_file(notebook)).items()}


def _text_of(path: Path) -> str:
    """What a file of the site says: a notebook's sources and outputs, a page's text without its tags."""
    raw = path.read_text(errors="replace")
    if path.suffix == ".ipynb":
        return "\n".join("".join(c["source"]) + json.dumps(c.get("outputs", [])) for c in json.loads(raw)["cells"])
    return htmllib.unescape(re.sub(r"<[^>]+>", "", raw))


@pytest.fixture(scope="module")
def editions(tmp_path_factory):
    """{edition: html folder}, every course chapter, from the solved notebooks as ``executed``."""
    from orca_lab.course import solve
    from orca_lab.course.site import build
    out = tmp_path_factory.mktemp("editions")
    solve.build(out / "solved" / "notebooks")
    stems = [p.stem for p in solve.course()]
    return {e: build(out / e, executed=out / "solved", only=stems, edition=e, log=lambda *a: None)["html"]
            for e in ("learner", "instructor")}


def test_no_solution_is_anywhere_in_the_learner_edition_and_all_are_in_the_instructors(editions):
    """Every file of the site but the docs' pages: docs/paper.md gives the paper's Algorithm 1, which
    chapter 03's ``select`` implements, in pseudocode that shares lines with it."""
    from orca_lab.course import solve
    from orca_lab.course.site import DOCS
    docs = {str(Path(d).with_suffix("")) for d in DOCS}
    files = {e: {p: _text_of(p) for p in html.rglob("*") if p.is_file() and p.suffix in (".html", ".ipynb", ".js", ".txt")
                 and str(p.relative_to(html).with_suffix("")).removeprefix("_sources/").removesuffix(".md") not in docs}
             for e, html in editions.items()}
    chapters = [p for p in solve.course() if solve.exercises(solve.load(p))]
    assert len(chapters) >= 12
    for nb in chapters:
        lines = _solution_lines(nb)
        assert all(lines.values()), f"{nb.name}: a solution with no line of its own: {lines}"
        assert "YOUR CODE HERE" in files["learner"][editions["learner"] / "notebooks" / f"{nb.stem}.html"]
        for ex, sol in lines.items():
            leaked = [(p.name, ln) for p, text in files["learner"].items() for ln in sol if ln in text]
            assert not leaked, f"{nb.name}: the learner site shows the solution of {ex}: {leaked[:3]}"
        page = files["instructor"][editions["instructor"] / "notebooks" / f"{nb.stem}.html"]
        assert all(ln in page for sol in lines.values() for ln in sol), f"{nb.name}: a solution missing"


def test_every_learner_chapter_in_chromium_shows_its_exercises_and_no_solution(editions, tmp_path):
    """Chromium, on each chapter page of the learner's edition: the text it shows holds no solution
    line; every exercise cell is framed (its border is drawn) under a box naming its task's grader; the
    instructor's page of the same chapter shows its solutions."""
    from orca_lab.course import solve
    sync_api = _chromium()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(120_000)   # a page from file:// took 19 s to load with both cores busy
        try:
            for nb in solve.course():
                exercises = [ex for _, ex in solve.exercises(solve.load(nb))]
                if not exercises:
                    continue
                lines = [ln for sol in _solution_lines(nb).values() for ln in sol]
                seen = {}
                for e, html in editions.items():
                    page.goto((html / "notebooks" / f"{nb.stem}.html").as_uri(), wait_until="load")
                    seen[e] = page.evaluate("""() => ({
                        text: document.querySelector('main').innerText,
                        cells: [...document.querySelectorAll('div.cell[class*="tag_exercise:"]')].map(c => ({
                            exercise: [...c.classList].find(k => k.startsWith('tag_exercise:')).slice(13),
                            border: getComputedStyle(c).borderLeftWidth,
                            box: c.previousElementSibling && c.previousElementSibling.classList.contains('orca-exercise')
                                 ? c.previousElementSibling.innerText : null}))})""")
                learner = seen["learner"]
                assert not [ln for ln in lines if ln in learner["text"]], f"{nb.name}: a solution on the learner page"
                assert [c["exercise"] for c in learner["cells"]] == exercises, (nb.name, learner["cells"])
                for c in learner["cells"]:
                    assert c["border"] == "4px", (nb.name, c)
                    assert c["box"] and f"Exercise {c['exercise']}" in c["box"] and "check" in c["box"], (nb.name, c)
                assert all(ln in seen["instructor"]["text"] for ln in lines), f"{nb.name}: a solution missing"
                if nb.stem.startswith("03_"):
                    page.goto((editions["learner"] / "notebooks" / f"{nb.stem}.html").as_uri(), wait_until="load")
                    page.locator("div.admonition.orca-exercise").first.scroll_into_view_if_needed()
                    for folder in [tmp_path] + ([Path(os.environ["ORCA_LAB_SCREENSHOTS"])]
                                                if os.environ.get("ORCA_LAB_SCREENSHOTS") else []):
                        folder.mkdir(parents=True, exist_ok=True)
                        page.screenshot(path=folder / f"course_learner_{nb.stem}.png")
        finally:
            browser.close()


def test_the_reading_path_gives_each_file_its_line_count():
    """docs/design.md's reading path: every file exists, its line count is true, and so is the total."""
    text = (ROOT / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `([^`]+)` \| (\d+) \|", text.split("## Reading path", 1)[1], re.M)
    assert [int(i) for i, _, _ in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 10
    counts = {f: len((ROOT / f).read_text().splitlines()) for _, f, _ in rows}
    assert {f: int(n) for _, f, n in rows} == counts, f"write these counts in docs/design.md: {counts}"
    assert f"{sum(counts.values())} lines in all." in text


PAPER_SECTIONS = {"§1", "§2", "§3", "§4", "§4.1", "§4.2", "§5", "§6", "§6.1", "§6.2", "§7", "§8"}   # the OSDI'22 paper's


def test_every_section_the_course_cites_is_one_of_the_papers():
    """The paper has no §4.3 nor §4.4: its design section is 4.1 (the distributed architecture, the
    workers) and 4.2 (the scheduling algorithm, Algorithm 1); selective batching is in §3."""
    from orca_lab.course import solve
    texts = {p.name: "".join("".join(c["source"]) for c in solve.load(p)["cells"]) for p in solve.course()}
    texts.update({p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")})
    cited = {(name, s) for name, text in texts.items() for s in re.findall(r"§\d+(?:\.\d+)?", text)}
    assert {s for _, s in cited} >= {"§3", "§4.1", "§4.2"}
    assert not {c for c in cited if c[1] not in PAPER_SECTIONS}


def test_every_section_the_package_cites_is_one_of_the_papers():
    """The same for the package's docstrings, benchmarks, reproductions and README: a learner reads them too."""
    files = [p for d in ("orca_lab", "benchmarks", "reproduce", "scripts") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".ipynb", ".md", ".sh")] + [ROOT / "README.md"]
    cited = {(str(p.relative_to(ROOT)), s) for p in files for s in re.findall(r"§\d+(?:\.\d+)?", p.read_text())}
    assert {s for _, s in cited} >= {"§3", "§4.1", "§4.2", "§6"}
    assert not {c for c in cited if c[1] not in PAPER_SECTIONS}
