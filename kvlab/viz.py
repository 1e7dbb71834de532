"""Plotly output setup for notebooks that must also draw in exported, offline HTML.

Why a custom renderer: the stock ``notebook`` renderer embeds plotly.js (good: no network) but
also adds a MathJax ``<script src="https://cdnjs...">`` to every figure. kvlab's renderer is the
``notebook`` renderer without MathJax, so a report has no CDN reference at all. Combined with
``plotly_mimetype`` (what JupyterLab draws), one figure output carries both: JupyterLab shows the
mimetype, nbconvert's HTML takes the ``text/html`` part.
"""

from __future__ import annotations

import plotly.io as pio
from plotly.io._base_renderers import NotebookRenderer

OFFLINE_RENDERER = "kvlab_offline"
DEFAULT_RENDERER = f"plotly_mimetype+{OFFLINE_RENDERER}"
TEMPLATE = "plotly_white"


class OfflineNotebookRenderer(NotebookRenderer):
    """The ``notebook`` renderer (plotly.js embedded once, on activation) minus MathJax's CDN."""

    def to_mimebundle(self, fig_dict):
        html = pio.to_html(
            fig_dict,
            config=self.config,
            include_plotlyjs=False,
            include_mathjax=False,
            full_html=False,
            default_width="100%",
            default_height=480,
            validate=False,
        )
        return {"text/html": html}


def setup(renderer: str = DEFAULT_RENDERER, template: str = TEMPLATE, max_rows: int = 200) -> str:
    """Make ``fig.show()`` draw in JupyterLab and in nbconvert HTML with no network, and let
    tables up to ``max_rows`` rows print whole (a report must not hide rows behind "...").

    Call once near the top of a notebook. plotly.js (about 4.6 MB) is embedded in the output of
    the first figure shown. Returns the renderer name now in use.
    """
    import pandas as pd

    pio.renderers[OFFLINE_RENDERER] = OfflineNotebookRenderer()
    pio.templates.default = template
    pio.renderers.default = renderer
    pd.set_option("display.max_rows", max_rows)
    pd.set_option("display.max_columns", 50)
    return renderer
