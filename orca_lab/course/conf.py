"""Sphinx configuration of the course site, copied into the staged sources by ``orca_lab.course.site``.
Nothing here reaches the network: notebooks are executed before Sphinx runs (``nb_execution_mode``
off), plotly.js is served from ``_static``, and the theme's links to launch services are off."""
project = "orca_lab: ORCA, rebuilt to be read, run and measured"
author = "orca_lab"
extensions = ["myst_nb"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
nb_execution_mode = "off"          # orca-lab course build executes and times the notebooks itself
nb_output_stderr = "remove"        # progress bars and warnings of the runs, not the course's text
myst_heading_anchors = 3
suppress_warnings = ["myst.xref_missing", "myst.header", "mystnb.unknown_mime_type", "misc.highlighting_failure"]
html_theme = "sphinx_book_theme"
html_title = "orca_lab course"
html_static_path = ["_static"]
html_js_files = ["plotly.min.js"]   # the plotly package's own copy: figures draw without a CDN
html_css_files = ["course.css"]
html_theme_options = {"show_toc_level": 2, "use_download_button": True, "home_page_in_toc": True}
html_last_updated_fmt = None
