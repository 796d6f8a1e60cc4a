"""``orca-lab course build``: execute the chapters (or take them executed), stage them with the docs,
and build the site with Sphinx.

Two editions (``edition.py``), each into its own folder. The default, ``learner``, publishes the
learner's notebooks, exercises as stubs, no solution in any page, each output after a chapter's first
exercise labelled as the reference solution's; ``instructor`` publishes the solved notebooks::

    orca-lab course build                          # -> build/course/html
    orca-lab course build --edition instructor     # -> build/course-instructor/html

Both execute the solved notebooks (every chapter runs to its end and draws every figure):

    OUT/executed/   the executed notebooks (skipped with ``executed=DIR``)
    OUT/my_orca/    the package their exercise cells saved (the learner's own is never touched)
    OUT/src/        Sphinx's sources: index.md (chapter map), README, docs/, the notebooks
    OUT/html/       the site: open html/index.html

Hooks: ``notebooks=DIR`` executes the course notebooks found in DIR instead of the solved ones;
``executed=DIR`` takes notebooks already executed (``DIR/notebooks/*.ipynb``, ``DIR/reproduce/*.ipynb``,
for example the other edition's ``OUT/executed``) and runs nothing. The chapter map's run times are
this build's when it executed the chapters, else those recorded in ``RUNTIMES``; ``record=True``
writes this build's into ``RUNTIMES``.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from orca_lab.course import edition as editions
from orca_lab.course import solve
from orca_lab.course.chapters import ROOT, Chapter, chapters, select
from orca_lab.course.figures import prepare

RUNTIMES = ROOT / "docs" / "results" / "course_runtimes.json"
DOCS = ["README.md", "docs/course.md", "docs/paper.md", "docs/design.md", "docs/distributed.md", "reproduce/README.md",
        "docs/results/README.md"]
PARTS = {"notebooks": "The course", "reproduce": "The paper's figures, reproduced"}
OUT = {"learner": ROOT / "build" / "course", "instructor": ROOT / "build" / "course-instructor"}
TITLE = {"learner": "orca_lab course", "instructor": "orca_lab course, instructor edition (solutions)"}


def build(out: Path | None = None, executed: Path | None = None, notebooks: Path | None = None,
          only: list[str] | None = None, record: bool = False, edition: str = "learner", log=print) -> dict:
    """Build ``edition``'s site into ``out / "html"``; returns what each chapter's figures became and
    the runs."""
    editions.check(edition)
    out = Path(out or OUT[edition]).resolve()
    chs = select(chapters(), only)
    for p in solve.strays():            # a learner's copy beside the chapters: not the course's
        log(f"skipped {p.relative_to(ROOT)}: it has exercises and no {solve.solution_file(p).relative_to(ROOT)}, "
            "so it is none of the course's chapters")
    runs = None
    if executed is None:
        executed = out / "executed"
        if notebooks is None:           # the site shows the course solved: every figure drawn
            notebooks = out / "solved"
            solve.build(notebooks)
        package = out / "my_orca"      # the build's exercises, chapter by chapter, for its capstone
        shutil.rmtree(package, ignore_errors=True)
        runs = [_execute(c, notebooks, executed, out, package, log) for c in chs]
        if record:
            _record(runs)
    chs = [c for c in chs if (Path(executed) / c.path).exists() or log(f"skipped: no {Path(executed) / c.path}")]
    if not chs:
        raise ValueError(f"--executed {executed}: none of the chosen chapters' executed notebooks is there "
                         "(notebooks/NN_*.ipynb, reproduce/*.ipynb)")
    src = out / "src"
    shutil.rmtree(src, ignore_errors=True)
    figures = _stage(src, chs, Path(executed), runs, edition)
    html = out / "html"
    log(f"sphinx: {src} -> {html}")
    done = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-j", "1",
                           "-d", str(out / "doctrees"), str(src), str(html)],   # doctrees stay off the site
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"sphinx-build failed:\n{done.stderr[-4000:]}")
    log(f"wrote {html / 'index.html'}")
    return {"html": html, "figures": figures, "runs": runs, "warnings": done.stderr}


def _execute(c: Chapter, notebooks, executed: Path, out: Path, package: Path, log) -> dict:
    from orca_lab.course.execute import execute
    source = Path(notebooks) / Path(c.path).name if notebooks and c.part == "notebooks" else ROOT / c.path
    log(f"executing {c.path} ...")
    run = execute(c, source, executed / c.path, out / "exports" / c.stem, package)
    log(f"  {run['wall_s']:.1f} s wall, {run['cpu_s']:.1f} s CPU, {run['cells_with_errors']} cells with errors")
    return run


def _record(runs: list[dict]):
    """Merge this build's runs into ``RUNTIMES``, each with when and where it ran."""
    from orca_lab.environment import environment
    old = json.loads(RUNTIMES.read_text()) if RUNTIMES.exists() else {"chapters": []}
    env = {**environment(), "commit": _commit()}
    new = {r["notebook"]: {**r, "environment": env} for r in runs}
    rows = [new.pop(r["notebook"], r) for r in old["chapters"]] + list(new.values())
    order = {c.path: i for i, c in enumerate(chapters())}
    rows.sort(key=lambda r: order.get(r["notebook"], len(order)))
    RUNTIMES.write_text(json.dumps({"made_by": "orca-lab course build --record", "chapters": rows}, indent=1) + "\n")


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _stage(src: Path, chs: list[Chapter], executed: Path, runs, edition: str) -> dict:
    import plotly
    here = Path(__file__).parent
    (src / "_static").mkdir(parents=True)
    (src / "conf.py").write_text((here / "conf.py").read_text() + f"html_title = {TITLE[edition]!r}\n")
    shutil.copy(here / "course.css", src / "_static" / "course.css")
    shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", src / "_static" / "plotly.min.js")
    for doc in DOCS:
        (src / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / doc, src / doc)
    shutil.copytree(ROOT / "docs" / "img", src / "docs" / "img")
    figures = {}
    for c in chs:
        (src / c.path).parent.mkdir(parents=True, exist_ok=True)
        nb = nbformat.read(executed / c.path, as_version=4)
        if c.part == "notebooks":
            nb = editions.make(edition, nbformat.read(ROOT / c.path, as_version=4), nb)
        figures[c.path] = prepare(nb)
        nbformat.write(nb, src / c.path)
    (src / "index.md").write_text(index_page(chs, runs, edition))
    return figures


EDITION_NOTE = {
    "learner": "This is the learner's edition: each exercise is a stub for you to write, announced by a box "
               "naming its task and its grader, and no solution is on any page. The outputs after a chapter's "
               "first exercise are those of the reference solution, and say so.",
    "instructor": "This is the instructor's edition: every exercise is shown solved (`notebooks/solutions/`). "
                  "The learner's edition, without the solutions, is `orca-lab course build`.",
}


def index_page(chs: list[Chapter], runs, edition: str = "learner") -> str:
    """The home page: what the course is, which edition, the chapter map with each chapter's run time,
    the tables of contents."""
    measured = {r["notebook"]: r for r in (runs or _recorded())}
    source = ("measured by the build that made this site" if runs else
              f"as recorded in `docs/results/{RUNTIMES.name}` (`orca-lab course build --record`)")
    lines = ["# orca_lab: the course", "",
             "ORCA (Yu et al., OSDI'22) rebuilt to be read, run and measured. Each chapter of the course is "
             "one notebook, one mechanism, built on small tensors and then found in the package; the "
             "reproductions run the paper's figures on the simulator (and on this machine where they measure). "
             "Run any of them yourself with `jupyter lab notebooks/`.", "", EDITION_NOTE[edition], "",
             "## Chapter map", "",
             f"Run time: one execution of the notebook, kernel start included ({source}); CPU: the "
             "kernel's and that of every process under it (workers, servers, process pools); load: the "
             "machine's 1-minute load average when the chapter started.", "",
             "| # | chapter | run time | CPU | when, where |", "|---|---|---|---|---|"]
    for i, c in enumerate(chs, 1):
        r = measured.get(c.path)
        when = _where(r) if r else ""
        t = (f"{r['wall_s']:.0f} s", f"{r['cpu_s']:.0f} s") if r else ("not measured", "")
        lines.append(f"| {i} | [{c.title()}]({c.path}) | {t[0]} | {t[1]} | {when} |")
    lines.append("")
    for part, caption in PARTS.items():
        lines += ["```{toctree}", f":caption: {caption}", ":maxdepth: 1", ""]
        lines += [c.path.removesuffix(".ipynb") for c in chs if c.part == part] + ["```", ""]
    lines += ["```{toctree}", ":caption: Docs", ":maxdepth: 1", ""]
    lines += [d.removesuffix(".md") for d in DOCS] + ["```", ""]
    return "\n".join(lines)


def _recorded() -> list[dict]:
    return json.loads(RUNTIMES.read_text())["chapters"] if RUNTIMES.exists() else []


def _where(r: dict) -> str:
    env = r.get("environment") or {}
    dev = env.get("cuda") or (f"{env['cpu_count']}-core CPU" if env else "this build's machine")
    return f"{r['started'][:16].replace('T', ' ')}, {dev}, load {r['load_average_1min_before']:.1f}"
