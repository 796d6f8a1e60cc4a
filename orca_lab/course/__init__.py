"""The course: one module per chapter (``chNN_<notebook>.py``: its graders, hints and plug points,
over ``harness`` and ``bounded``), the learner's pieces plugged all at once (``plug``), the kernel a
learner's step goes into (``online_softmax``), the merge of the solutions kept apart from the learner notebooks
(``solve``); and the course site: the notebooks, executed, and the docs, built into HTML with Sphinx, myst-nb and
sphinx-book-theme, offline (``orca-lab course build``).

- ``chapters``: which notebooks make the course and the reproductions, at what parameters.
- ``execute``: runs them (errors kept as outputs, so a learner's unfinished exercise does not stop the
  build), timing each: the chapter map's run times.
- ``figures``: each plotly output becomes the interactive figure, drawn by the plotly.js copied into
  the site, or its PNG where the figure is too big for a page.
- ``site``: stages the sources and runs Sphinx (``conf.py`` is its configuration).

Why not Jupyter Book 2 (mystmd): its HTML build fetches its theme from ``api.mystmd.org``, so it fails
offline. Sphinx with myst-nb and sphinx-book-theme (Jupyter Book 1's stack) builds with no network.
"""
