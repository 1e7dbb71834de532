"""Report summaries (bootstrap CIs, ratios to the full cache, provenance) on fake records, and the
HTML export: code hidden, no CDN script, plotly.js embedded, an index of reports."""

import json
import math
import re

import nbformat
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
from synthetic_records import FAKE_GPU, fake_records, write_fake_sweep

from kvlab import report, viz


@pytest.fixture(scope="module")
def records():
    return fake_records()


@pytest.fixture(scope="module")
def perf(records):
    return report.perf_records(records)


# --- statistics ---------------------------------------------------------------------------


def test_bootstrap_ci_brackets_the_mean_and_is_reproducible():
    x = np.random.default_rng(1).normal(10, 2, size=40)
    mean, lo, hi = report.bootstrap_ci(x, seed=3)
    assert mean == pytest.approx(x.mean())
    assert lo < mean < hi
    # about mean +- 1.96 sd/sqrt(n)
    assert hi - lo == pytest.approx(2 * 1.96 * x.std(ddof=1) / math.sqrt(40), rel=0.25)
    assert report.bootstrap_ci(x, seed=3) == (mean, lo, hi)


def test_bootstrap_ci_edge_cases():
    assert all(math.isnan(v) for v in report.bootstrap_ci([]))
    mean, lo, hi = report.bootstrap_ci([4.0])
    assert mean == 4.0 and math.isnan(lo) and math.isnan(hi)
    assert report.bootstrap_ci([2.0, float("nan"), 4.0])[0] == 3.0
    assert report.bootstrap_ci([5.0, 5.0, 5.0])[1:] == (5.0, 5.0)


def test_ratio_ci_of_exact_groups():
    r, lo, hi = report.ratio_ci([1.35, 1.35], [1.0, 1.0])
    assert (r, lo, hi) == pytest.approx((1.35, 1.35, 1.35))
    r, lo, hi = report.ratio_ci([2.0, 2.2, 1.8], [1.0, 1.1, 0.9])
    assert r == pytest.approx(2.0) and lo < 2.0 < hi
    assert math.isnan(report.ratio_ci([1.0], [])[0])


def test_method_summary_columns_and_counts(perf):
    s = report.method_summary(perf, ["itl_median_ms", "j_per_token", "not_a_column"], by=["label", "ctx"],
                              n_boot=100)
    assert list(s.columns) == ["label", "ctx", "n", "itl_median_ms", "itl_median_ms_lo", "itl_median_ms_hi",
                               "j_per_token", "j_per_token_lo", "j_per_token_hi"]
    assert len(s) == 9 and set(s["n"]) == {3}
    assert (s["itl_median_ms_lo"] <= s["itl_median_ms"]).all()
    assert (s["itl_median_ms"] <= s["itl_median_ms_hi"]).all()


def test_relative_to_full_gives_the_headline(perf):
    rel = report.relative_to_baseline(perf, "j_per_token", "full", ctx=16384, n_boot=500)
    row = rel.set_index("label").loc["quanto int4"]
    assert row["ratio"] == pytest.approx(1.35)
    assert row["change_pct"] == pytest.approx(35.0)
    assert row["ratio_lo"] < 1.35 < row["ratio_hi"]
    lines = report.headline(rel)
    assert lines[0].startswith("quanto int4: +35% J/token vs full at ctx 16384 (95% CI ")
    assert "full" not in set(rel["label"])


def test_relative_needs_the_baseline_in_the_same_context(perf):
    rel = report.relative_to_baseline(perf[perf["method"] != "full"])
    assert rel.empty
    assert list(rel.columns) == ["label", "model", "ctx", "batch", "ratio", "ratio_lo", "ratio_hi", "change_pct"]


def test_several_models_are_kept_apart(perf):
    other = perf.assign(model="mistral-7b", j_per_token=perf["j_per_token"] * 2)
    both = report.perf_records(pd.concat([perf, other]))
    assert "mistral-7b · quanto int4" in set(both["label"])
    assert report.perf_records(both)["label"].equals(both["label"])  # idempotent
    rel = report.relative_to_baseline(both, ctx=16384, n_boot=100).set_index("label")
    # each model against its own full cache: 1.35 for both, not a cross-model mix
    assert rel.loc["mistral-7b · quanto int4", "ratio"] == pytest.approx(1.35)
    assert rel.loc["llama-3.1-8b · quanto int4", "ratio"] == pytest.approx(1.35)


def test_study_summary_uses_16k_or_says_which_context(records):
    summary, at, caption = report.study_summary(records, 16384, n_boot=100)
    assert at == 16384 and caption == "ctx 16384"
    assert list(summary["label"]) == ["full", "quanto int4", "streamingllm keep 0.5"]
    full = summary.set_index("label").loc["full"]
    assert full["peak_mem_gb"] == pytest.approx((16.1e9 + 131072 * 16384) / 1e9)
    summary, at, caption = report.study_summary(records[records["ctx"] != 16384], 16384, n_boot=100)
    assert at == 4096
    assert "16384 was not measured" in caption


def test_perf_records_drop_failures_and_quality(records):
    perf = report.perf_records(records)
    assert set(perf["kind"]) == {"perf"} and set(perf["status"]) == {"ok"}
    failed = report.failed_records(records)
    assert len(failed) == 1 and "out of memory" in failed["error"].iloc[0]


def test_sweep_summary_is_text_with_context_and_batch(perf):
    table = report.sweep_summary(perf, n_boot=100)
    assert list(table.columns[:4]) == ["method", "batch", "ctx", "runs"]
    assert len(table) == 9
    assert re.match(r"^\d+\.\d+ \[\d+\.\d+, \d+\.\d+\]$", table["J/token"].iloc[0])


# --- provenance ---------------------------------------------------------------------------


def test_provenance_says_synthetic_and_reads_the_manifest(records, tmp_path):
    study = report.load_study(write_fake_sweep(tmp_path / "sweep"))
    prov = report.provenance(study.manifest, study.records)["value"]
    assert prov["weights"].startswith("synthetic")
    assert "quality is meaningless" in prov["weights"]
    assert prov["GPU (NVML)"] == FAKE_GPU
    assert prov["driver"] == "000.00.00"
    assert prov["transformers"] == "5.17.0"
    assert "manifest: params.methods" in prov.index
    assert "manifest: env_start.git_sha" not in prov.index  # compact: covered by "git commit"
    assert prov["git commit"] == "0" * 40
    full = report.provenance(study.manifest, study.records, full=True)["value"]
    assert "manifest: env_start.git_sha" in full.index


def test_provenance_without_manifest_says_so(records):
    prov = report.provenance({}, records[records["weights"] == "real"])["value"]
    assert prov["weights"] == "real"
    assert "missing" in prov["manifest"]


def test_summary_markdown_flags_synthetic_weights(tmp_path):
    study = report.load_study(write_fake_sweep(tmp_path / "s"))
    text = report.summary_markdown(study)
    assert "**weights: synthetic, real**" in text
    assert "> weights: synthetic" in text
    assert "27 performance runs" in text and "1 failed" in text


def test_load_study_missing_folder_names_the_fix(tmp_path):
    with pytest.raises(report.ReportError, match="kvlab sweep"):
        report.load_study(tmp_path / "nope")


# --- paths and params for notebooks --------------------------------------------------------


def test_project_path_resolves_from_anywhere(tmp_path, monkeypatch):
    root = report.project_root()
    assert (root / "pyproject.toml").is_file()
    monkeypatch.chdir(root / "notebooks")
    assert report.project_path("params/x.yaml") == root / "params/x.yaml"
    monkeypatch.chdir(tmp_path)
    assert report.project_path(".") == report.Path(".")
    assert report.project_path("/abs/path") == report.Path("/abs/path")


def test_notebook_sweep_params_file_then_overrides(tmp_path):
    pytest.importorskip("kvlab.params")
    f = tmp_path / "base.yaml"
    f.write_text("models: [tiny-llama]\nweights: synthetic\nmethods: [full]\nctx: [128, 256]\nnew_tokens: 4\n")
    p = report.notebook_sweep_params(str(f), ctx=512, methods=None)
    assert p.ctx == [512] and p.methods == ["full"] and p.name == "base"
    with pytest.raises(report.ReportError, match="not found"):
        report.notebook_sweep_params(str(tmp_path / "missing.yaml"))


# --- HTML ---------------------------------------------------------------------------------


def figure_notebook():
    """A notebook node whose outputs are what kvlab.viz's renderer emits (no kernel needed)."""
    renderer = viz.OfflineNotebookRenderer()
    fig = go.Figure(go.Bar(x=["a", "b"], y=[1, 2]))
    bundle = renderer.to_mimebundle(fig.to_dict())
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    cell = nbformat.v4.new_code_cell("SECRET_SOURCE_LINE = 1\nfig.show()")
    cell.outputs = [nbformat.v4.new_output("display_data", data=bundle)]
    nb.cells = [nbformat.v4.new_markdown_cell("# Title"), cell]
    return nb


def test_renderer_output_has_no_cdn():
    bundle = viz.OfflineNotebookRenderer().to_mimebundle(go.Figure().to_dict())
    assert "https://" not in bundle["text/html"]
    assert "Plotly.newPlot" in bundle["text/html"]


def test_setup_sets_the_default_renderer():
    import plotly.io as pio

    old = pio.renderers.default
    try:
        assert viz.setup() == "plotly_mimetype+kvlab_offline"
        assert pio.renderers.default == "plotly_mimetype+kvlab_offline"
    finally:
        pio.renderers.default = old


def test_export_html_hides_code_and_loads_nothing_from_the_network(tmp_path):
    path = report.export_html(figure_notebook(), tmp_path / "r.html", title="kvlab report: test")
    text = path.read_text()
    assert "SECRET_SOURCE_LINE" not in text  # code hidden
    assert "Plotly.newPlot" in text
    assert "<title>kvlab report: test</title>" in text
    assert not re.search(r"<script[^>]+src=", text), "a script is fetched from somewhere"
    assert not re.search(r"<link[^>]+href=\"https?:", text)


def test_index_lists_reports_newest_first(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    report.export_html(figure_notebook(), tmp_path / "a" / "report.html", title="Report A")
    report.export_html(figure_notebook(), tmp_path / "b" / "report.html", title="Report <B>")
    (tmp_path / "loose.html").write_text("<html><title>Loose</title></html>")
    index = report.write_index(tmp_path).read_text()
    assert 'href="a/report.html"' in index and 'href="b/report.html"' in index and 'href="loose.html"' in index
    assert "Report &lt;B&gt;" in index
    assert "index.html" not in re.findall(r'href="([^"]+)"', index)


def test_index_of_an_empty_folder(tmp_path):
    assert "no reports yet" in report.write_index(tmp_path).read_text()


def test_render_report_rejects_bad_input(tmp_path):
    with pytest.raises(report.ReportError, match="kvlab sweep"):
        report.render_report(tmp_path / "nope")
    with pytest.raises(report.ReportError, match=".html"):
        report.render_report(tmp_path, out=tmp_path / "x.pdf")


@pytest.mark.slow
def test_kvlab_report_renders_a_fake_sweep(tmp_path):
    """The CLI end to end on fake records: executed notebook, HTML with every figure, index."""
    from kvlab.cli import main

    folder = write_fake_sweep(tmp_path / "fake-sweep")
    assert main(["report", str(folder), "--ctx", "16384"]) == 0
    html = (folder / "report.html").read_text()
    assert len(html) > 3_000_000  # plotly.js embedded
    assert html.count('class="plotly-graph-div"') == 7  # every figure of the report notebook
    assert "weights: synthetic" in html and FAKE_GPU in html
    assert "+35% J/token vs full at ctx 16384" in html
    assert not re.search(r"<script[^>]+src=", html)
    executed = json.loads((folder / "report.ipynb").read_text())
    assert executed["metadata"]["papermill"]["input_path"] == "report.ipynb"  # no absolute paths
    assert str(tmp_path) not in json.dumps(executed["metadata"])
    index = (tmp_path / "index.html").read_text()
    assert 'href="fake-sweep/report.html"' in index


def test_with_derived_adds_gb_and_label():
    df = report.with_derived(pd.DataFrame({"method": ["full", "x"], "label": [None, "x 4"],
                                           "peak_mem_bytes": [2e9, 1e9]}))
    assert list(df["label"]) == ["full", "x 4"]
    assert list(df["peak_mem_gb"]) == [2.0, 1.0]
