"""The rendered report opened in a real headless Chromium with the network cut off: every plotly
figure must have drawn (SVG present), proving the HTML is self-contained."""

import pytest
from browser import drawn_plots, dump_dom, require_chromium
from synthetic_records import write_fake_sweep

from kvlab import report

# one xdist worker renders the two reports once for all three tests (split across workers, each rendered them)
pytestmark = [pytest.mark.slow(reason="renders a report (a Jupyter kernel) and draws it in headless Chromium"),
              pytest.mark.xdist_group("report-browser")]


@pytest.fixture(scope="session")
def rendered(tmp_path_factory):
    require_chromium()
    tmp = tmp_path_factory.mktemp("browser")
    folders = {"gpu-like": write_fake_sweep(tmp / "gpu-like"),
               "cpu-like": write_fake_sweep(tmp / "cpu-like", energy=False, quality=False)}
    return tmp, {name: report.render_report(folder) for name, folder in folders.items()}


# The gpu-like sweep has energy, so its report also draws the where-compression-pays heatmap; the
# cpu-like one has neither energy nor quality, and those sections are one sentence each.
@pytest.mark.parametrize(("name", "figures"), [("gpu-like", 8), ("cpu-like", 4)])
def test_every_figure_draws_offline(rendered, name, figures):
    tmp, htmls = rendered
    dom = dump_dom(htmls[name], tmp / f"profile-{name}")
    counts = drawn_plots(dom)
    assert counts["graph_divs"] == figures
    assert counts["drawn"] == counts["graph_divs"], counts  # plotly.js ran for every figure
    assert counts["main_svg"] >= counts["graph_divs"]
    assert "weights: synthetic" in dom


def test_index_page_links_both_reports(rendered):
    tmp, _ = rendered
    dom = dump_dom(tmp / "index.html", tmp / "profile-index")
    assert 'href="gpu-like/report.html"' in dom and 'href="cpu-like/report.html"' in dom
