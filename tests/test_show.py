"""``orca_lab.viz.show``: one MIME bundle holds the interactive figure and a static picture, so a
notebook's figures show in JupyterLab and in static renders (nbconvert HTML, repository viewers)."""
import base64
import shutil
import sys

import plotly.graph_objects as go
import pytest

from orca_lab.viz import show
from orca_lab.viz.render import PLOTLY_MIME

HAS_BROWSER = any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome"))


def _fig():
    return go.Figure(go.Bar(x=[1, 2, 3], y=[3, 1, 2]), layout=dict(title="bars"))


def test_the_bundle_holds_the_interactive_figure_and_a_png():
    if not HAS_BROWSER:
        pytest.skip("PNG export needs Chromium: apt-get install chromium (scripts/test.sh does)")
    bundle = show(_fig())._repr_mimebundle_()
    assert bundle[PLOTLY_MIME]["data"][0]["type"] == "bar"     # JupyterLab draws this one
    assert base64.b64decode(bundle["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"   # a static render this one
    assert "text/html" not in bundle and bundle["text/plain"] == "<plotly figure: bars>"


def test_without_a_browser_html_stands_in_for_the_png(monkeypatch):
    def no_browser(fig, path, formats=None):
        raise RuntimeError("PNG/SVG/PDF export needs a Chromium")
    monkeypatch.setattr(sys.modules["orca_lab.viz.export"], "export", no_browser)
    bundle = show(_fig())._repr_mimebundle_()
    assert "image/png" not in bundle and "plotly" in bundle["text/html"] and PLOTLY_MIME in bundle


def test_static_off_gives_the_interactive_figure_only():
    bundle = show(_fig(), static=False)._repr_mimebundle_()
    assert set(bundle) == {PLOTLY_MIME, "text/plain"}
