"""``export(fig, path)``: HTML always works; PNG/SVG/PDF go through kaleido and a Chromium.

The HTML fits the window it opens in (``fit_window``): a 1,600-pixel figure in a 1,366-pixel window
would hide its last panel and its legend. The static formats keep the size the figure was built with.

Most GPU cluster nodes have no Chromium and no root to install one. There a reproduction still ends
with its tables and an HTML figure: the static formats are skipped with one warning per process that
names them and says how to get them.
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

FORMATS = ("html", "png", "svg", "pdf")
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
HOW_TO_GET = ("kaleido needs a Chromium: `apt-get install chromium` (Debian/Ubuntu, as root), or set "
              "BROWSER_PATH to a Chrome or Chromium binary")
_server_started = False
_warned = False


class ExportSkipped(UserWarning):
    """Static formats were not written (no usable Chromium); the HTML was."""


def export(fig, path, formats=None) -> list[Path]:
    """Write ``fig`` to ``path`` (its suffix picks the format), or to ``path`` + each of ``formats``.
    Returns the files written.

    Static formats need a Chromium: kaleido finds ``/usr/bin/chromium`` (``apt-get install chromium``)
    or ``$BROWSER_PATH``. Without one (or when it fails to start), the static formats are skipped with
    an ``ExportSkipped`` warning, once per process, and the HTML is written even if not asked for.
    """
    path = Path(path)
    targets = [path.with_suffix("." + f) for f in formats] if formats else [path]
    for t in targets:
        fmt = t.suffix.lstrip(".").lower()
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r} of {t} is not allowed: choose one of {FORMATS}")
    static = [t for t in targets if t.suffix.lower() != ".html"]
    html = [t for t in targets if t not in static]
    for t in targets:
        t.parent.mkdir(parents=True, exist_ok=True)
    problem = _static_export(fig, static) if static else None
    if problem:
        html = html or [path.with_suffix(".html")]
        _warn_once(static, html[0], problem)
    if html:
        page = html_page(fig)
        for t in html:
            t.write_text(page, encoding="utf-8")
    return html + ([] if problem else static)


def fit_window(fig):
    """A copy of ``fig`` drawn at the size of the page that shows it: no fixed width or height (the
    builders' sizes are for the static formats), and the legend in a row under the panels, where it
    takes no width from them and stays in view when the figure does."""
    import plotly.graph_objects as go
    return go.Figure(fig).update_layout(
        width=None, height=None, autosize=True,
        legend=dict(orientation="h", xref="container", x=0.5, xanchor="center",
                    yref="container", y=0, yanchor="bottom"))


def figure_div(fig, include_plotlyjs="cdn") -> str:
    """``fig`` as a div as wide as its container and as tall as the figure was meant to be but no taller
    than the window, redrawn when the window is resized."""
    tall = fig.layout.height or 450   # plotly's default height
    return fit_window(fig).to_html(full_html=False, include_plotlyjs=include_plotlyjs, config={"responsive": True},
                                   default_width="100%", default_height=f"min({tall}px, 100vh)")


def html_page(fig) -> str:
    """A self-contained page (plotly.js inline: reports open offline) holding ``figure_div(fig)``."""
    import html
    title = html.escape(fig.layout.title.text or "orca_lab figure")
    return (f'<!DOCTYPE html>\n<html>\n<head><meta charset="utf-8"><title>{title}</title>\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f'<style>html, body {{ margin: 0; }}</style></head>\n<body>\n{figure_div(fig, True)}\n</body>\n</html>\n')


def browser() -> str | None:
    """The Chromium kaleido will use, or None."""
    found = os.environ.get("BROWSER_PATH") or next(filter(None, map(shutil.which, BROWSERS)), None)
    return found if found and os.access(found, os.X_OK) else None


def _static_export(fig, targets) -> str | None:
    """Write ``targets`` through kaleido; None, or why they could not be written."""
    global _server_started
    if browser() is None:
        return "no Chromium found"
    try:
        if not _server_started:   # one Chromium for all images: ~0.25 s an image instead of ~3 s
            import kaleido
            kaleido.start_sync_server(silence_warnings=True)
            _server_started = True
        with warnings.catch_warnings():   # plotly passes options the shared server does not need
            warnings.filterwarnings("ignore", message="The kopts argument is ignored")
            for t in targets:
                fig.write_image(t)
    except Exception as e:   # a Chromium that does not start (sandbox, libraries): degrade, say why
        return f"Chromium failed: {type(e).__name__}: {str(e).strip()[:300]}"
    return None


def _warn_once(skipped, html: Path, problem: str):
    global _warned
    if _warned:
        return
    _warned = True
    kinds = sorted({t.suffix.lstrip(".").upper() for t in skipped})
    warnings.warn(f"{'/'.join(kinds)} export skipped ({problem}): {', '.join(t.name for t in skipped)} not "
                  f"written; the HTML is, at {html}. To get them: {HOW_TO_GET}.", ExportSkipped, stacklevel=3)
