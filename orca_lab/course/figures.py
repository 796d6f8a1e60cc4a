"""A notebook's outputs made fit for a static page that needs no network.

- A plotly figure (``application/vnd.plotly.v1+json``, as ``fig.show()`` and ``orca_lab.viz.show``
  emit it) becomes HTML that draws it with the plotly.js the site serves itself (``_static``), when
  its JSON is at most ``MAX_INTERACTIVE_BYTES``; a bigger one (a timeline of thousands of shapes)
  becomes its PNG: the one ``viz.show`` sent beside it, or one drawn here by kaleido.
- Any other HTML that loads plotly.js from a CDN is dropped in favour of the PNG beside it.
- An ipywidgets output needs JupyterLab's kernel to play: it shows the HTML its widgets held when
  the notebook ran (the animation's first frame) under a note that says so, and the notebook's
  widget state is dropped (myst-nb would otherwise load the widget manager from a CDN). A progress
  bar (tqdm's widget) keeps its last text instead.
"""
from __future__ import annotations

import base64
import json
import re

PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
MAX_INTERACTIVE_BYTES = 3_000_000
PROGRESS = re.compile(r"\d+%\|")     # tqdm's text: "sweep: 100%|##########| 144/144 ..."
WIDGET_NOTE = ('<p class="orca-widget-note"><em>An interactive widget, shown as it stood when the notebook ran: '
               'run this notebook in JupyterLab (<code>jupyter lab notebooks/</code>) to play it.</em></p>')


def prepare(nb) -> dict:
    """Rewrite ``nb``'s outputs in place; count what each plotly output became."""
    counts = {"interactive": 0, "png": 0, "widget": 0}
    state = nb.metadata.pop("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data is None:
                continue
            if PLOTLY in data:
                counts[_plotly(data)] += 1
            elif WIDGET in data:
                model_id = data[WIDGET].get("model_id")
                text = _text(data.get("text/plain", ""))
                data.clear()
                if PROGRESS.search(text):
                    data["text/plain"] = text
                else:
                    data["text/html"] = WIDGET_NOTE + "".join(_html_values(state, model_id))
                    counts["widget"] += 1
            elif "cdn.plot.ly" in _text(data.get("text/html", "")) and "image/png" in data:
                del data["text/html"]
    return counts


def _html_values(state: dict, model_id, depth: int = 0) -> list[str]:
    """The values of the HTML widgets under ``model_id`` in the saved widget state, in order."""
    model = state.get(model_id or "", {})
    if depth > 20 or not model:
        return []
    if model.get("model_name") == "HTMLModel":
        return [model["state"].get("value", "")]
    children = model.get("state", {}).get("children", [])
    return [v for c in children for v in _html_values(state, str(c).removeprefix("IPY_MODEL_"), depth + 1)]


def _plotly(data: dict) -> str:
    fig = data.pop(PLOTLY)
    png = data.pop("image/png", None)
    data.pop("text/html", None)
    if len(json.dumps(fig)) <= MAX_INTERACTIVE_BYTES:
        data["text/html"] = figure_html(fig)
        return "interactive"
    data["image/png"] = png or base64.b64encode(_render_png(fig)).decode()
    return "png"


def figure_html(fig: dict) -> str:
    """A div and the script that draws ``fig`` into it with the page's own plotly.js."""
    import plotly.io as pio
    return pio.to_html(fig, include_plotlyjs=False, full_html=False, config={"responsive": True})


def _render_png(fig: dict) -> bytes:
    import plotly.graph_objects as go
    from orca_lab.viz.render import png_bytes
    png = png_bytes(go.Figure(fig))
    if png is None:
        raise RuntimeError("a plotly figure too big for a page needs a PNG, and no Chromium is installed "
                           "to draw it (apt-get install chromium)")
    return png


def _text(v) -> str:
    return "".join(v) if isinstance(v, list) else v

