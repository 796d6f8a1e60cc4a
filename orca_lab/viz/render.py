"""``show(fig)``: a plotly figure that shows everywhere a notebook is read.

``fig.show()`` emits only plotly's own MIME type, which JupyterLab draws and a static render
(nbconvert HTML, a repository's notebook viewer) leaves blank. ``show`` puts the interactive figure
and a static picture in one MIME bundle. A static renderer takes the PNG; in JupyterLab, plotly's
renderer shows the PNG too and swaps in the interactive figure as soon as the pointer enters it (as
it does for a notebook saved from JupyterLab). The PNG comes from ``export`` (kaleido and a Chromium); where no Chromium is
installed, a self-contained HTML version stands in for it.
"""
from __future__ import annotations

import base64
import tempfile
import warnings
from pathlib import Path

PLOTLY_MIME = "application/vnd.plotly.v1+json"


class Shown:
    """What a notebook cell displays: the figure, interactive and static."""

    def __init__(self, fig, static: bool = True):
        self.fig, self.static = fig, static

    def _repr_mimebundle_(self, include=None, exclude=None):
        import plotly.io as pio
        from orca_lab.viz.export import figure_div
        bundle = pio.renderers["plotly_mimetype"].to_mimebundle(self.fig.to_dict())
        bundle["text/plain"] = f"<plotly figure: {self.fig.layout.title.text or 'untitled'}>"
        if self.static:
            png = png_bytes(self.fig)
            if png is not None:
                bundle["image/png"] = base64.b64encode(png).decode()
            else:
                bundle["text/html"] = figure_div(self.fig)
        return bundle


def show(fig, static: bool = True) -> Shown:
    """Return ``fig`` wrapped for display as the last expression of a cell (or ``display(show(fig))``):
    interactive where plotly's renderer runs, a PNG (or HTML without a Chromium) everywhere else."""
    return Shown(fig, static)


def png_bytes(fig) -> bytes | None:
    """The figure as a PNG through ``export``, or None where no Chromium can draw it."""
    from orca_lab.viz.export import export
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "figure.png"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # export says once what is missing; HTML stands in here
                export(fig, path)
        except RuntimeError:
            return None
        return path.read_bytes() if path.exists() else None
