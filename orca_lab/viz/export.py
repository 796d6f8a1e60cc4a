"""``export(fig, path)``: HTML always works; PNG/SVG/PDF go through kaleido and Debian's Chromium."""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

FORMATS = ("html", "png", "svg", "pdf")
_server_started = False


def export(fig, path, formats=None) -> list[Path]:
    """Write ``fig`` to ``path`` (its suffix picks the format), or to ``path`` + each of ``formats``.

    Static formats need a Chromium: kaleido finds ``/usr/bin/chromium`` (``apt-get install chromium``)
    or ``$BROWSER_PATH``. Without one, the HTML is still written and a RuntimeError says what to install.
    """
    path = Path(path)
    targets = [path.with_suffix("." + f) for f in formats] if formats else [path]
    for t in targets:
        fmt = t.suffix.lstrip(".").lower()
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r} of {t} is not allowed: choose one of {FORMATS}")
    t_html = [t for t in targets if t.suffix == ".html"]
    t_static = [t for t in targets if t.suffix != ".html"]
    for t in targets:
        t.parent.mkdir(parents=True, exist_ok=True)
    for t in t_html:
        fig.write_html(t, include_plotlyjs=True)   # self-contained: reports open offline
    if t_static:
        _ensure_browser(path)
        with warnings.catch_warnings():   # plotly passes options the shared server does not need
            warnings.filterwarnings("ignore", message="The kopts argument is ignored")
            for t in t_static:
                fig.write_image(t)
    return targets


def _ensure_browser(path: Path):
    global _server_started
    if not (os.environ.get("BROWSER_PATH") or shutil.which("chromium") or shutil.which("chromium-browser")
            or shutil.which("google-chrome")):
        html = path.with_suffix(".html")
        raise RuntimeError(f"PNG/SVG/PDF export needs a Chromium for kaleido: run `apt-get install chromium` "
                           f"(or set BROWSER_PATH). The HTML version can be written with export(fig, '{html}').")
    if not _server_started:   # one Chromium for all images: ~0.25 s an image instead of ~3 s
        import kaleido
        kaleido.start_sync_server(silence_warnings=True)
        _server_started = True
