"""Study summaries (per-method tables with bootstrap CIs, ratios to the full cache, provenance) and
report rendering (papermill + nbconvert to one offline HTML file, plus a folder index).

Summaries are pure functions of the records DataFrame, so the report notebook stays a few lines
per cell and the numbers are tested here. Rendering is the side-effect edge: it executes
``notebooks/report.ipynb`` against a records folder and exports HTML with code hidden and
plotly.js embedded (see :mod:`kvlab.viz`), with every CDN script of nbconvert's template removed,
so the file draws with no network.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvlab.plots import ci_text, is_baseline_label

GB = 1e9
DEFAULT_CTX = 16384
REPO_ROOT = Path(__file__).resolve().parents[1]
REPORT_NOTEBOOK = REPO_ROOT / "notebooks" / "report.ipynb"

# The study table: derived column -> header. Derived columns are added by `with_derived`.
STUDY_METRICS = {
    "peak_mem_gb": "peak memory (GB)",
    "cache_gb": "KV cache (GB)",
    "j_per_token": "J/token",
    "itl_median_ms": "time between tokens (ms, median)",
    "tokens_per_s": "tokens/s",
}

SYNTHETIC_NOTE = "synthetic: seeded random weights; speed, memory and energy are faithful, quality is meaningless"


class ReportError(ValueError):
    """A records folder or notebook the report cannot use; the message names the fix."""


# ---------------------------------------------------------------------------------------------
# selecting and deriving


def perf_records(records: pd.DataFrame) -> pd.DataFrame:
    """Successful performance records with the derived columns the report plots."""
    df = records
    if "kind" in df.columns:
        df = df[df["kind"] == "perf"]
    if "status" in df.columns:
        df = df[df["status"] == "ok"]
    return with_derived(df)


def quality_records(records: pd.DataFrame) -> pd.DataFrame:
    df = records[records["kind"] == "quality"] if "kind" in records.columns else records.iloc[0:0]
    if "status" in df.columns:
        df = df[df["status"] == "ok"]
    return with_derived(df)


def failed_records(records: pd.DataFrame) -> pd.DataFrame:
    """Failed runs (OOM, unsupported method): the report lists them instead of hiding them."""
    if "status" not in records.columns:
        return records.iloc[0:0]
    cols = [c for c in ("method", "label", "ctx", "batch", "repeat", "error") if c in records.columns]
    return records.loc[records["status"] != "ok", cols]


def with_derived(df: pd.DataFrame) -> pd.DataFrame:
    """Add GB columns and a ``label`` (the method name where missing, prefixed by the model when
    several models are present) without touching the input."""
    df = df.copy()
    if "label" not in df.columns:
        df["label"] = df["method"] if "method" in df.columns else "?"
    elif "method" in df.columns:
        df["label"] = df["label"].fillna(df["method"])
    if "model" in df.columns and df["model"].nunique() > 1:  # a sweep over models: keep them apart
        prefix = df["model"].astype(str) + " · "
        labels = df["label"].astype(str)
        df["label"] = [lab if lab.startswith(p) else p + lab for p, lab in zip(prefix, labels, strict=True)]
    for src, dst in (("peak_mem_bytes", "peak_mem_gb"), ("cache_bytes", "cache_gb")):
        if src in df.columns:
            df[dst] = pd.to_numeric(df[src], errors="coerce") / GB
    return df


def pick_ctx(records: pd.DataFrame, ctx: int = DEFAULT_CTX) -> tuple[int | None, str]:
    """The context to tabulate: ``ctx`` if measured, else the nearest measured one (and a note)."""
    if records.empty or "ctx" not in records.columns:
        return None, "no records"
    available = sorted(int(c) for c in records["ctx"].dropna().unique())
    if ctx in available:
        return ctx, f"ctx {ctx}"
    nearest = min(available, key=lambda c: (abs(math.log(c / ctx)), -c))
    return nearest, f"ctx {nearest} ({ctx} was not measured; measured: {', '.join(map(str, available))})"


# ---------------------------------------------------------------------------------------------
# statistics


def bootstrap_ci(values: Sequence[float], n_boot: int = 2000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float, float]:
    """Mean and percentile-bootstrap CI of the mean; NaN bounds with fewer than two values."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    if x.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if x.size < 2:
        return mean, math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return mean, float(lo), float(hi)


def ratio_ci(values: Sequence[float], baseline: Sequence[float], n_boot: int = 2000,
             level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of means (values / baseline) with a bootstrap CI resampling both groups independently."""
    x = np.asarray(values, dtype=float)
    b = np.asarray(baseline, dtype=float)
    x, b = x[~np.isnan(x)], b[~np.isnan(b)]
    if x.size == 0 or b.size == 0 or b.mean() == 0:
        return math.nan, math.nan, math.nan
    ratio = float(x.mean() / b.mean())
    if x.size < 2 and b.size < 2:
        return ratio, math.nan, math.nan
    rng = np.random.default_rng(seed)
    xm = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    bm = b[rng.integers(0, b.size, size=(n_boot, b.size))].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(xm / bm, [alpha, 1 - alpha])
    return ratio, float(lo), float(hi)


def method_summary(records: pd.DataFrame, metrics: Sequence[str], by: Sequence[str] = ("label",),
                   n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """One row per group: ``n`` runs and, per metric, the mean with ``_lo``/``_hi`` bootstrap bounds."""
    by = list(by)
    metrics = [m for m in metrics if m in records.columns]
    rows = []
    for keys, part in records.groupby(by, sort=False, dropna=False):
        keys = keys if isinstance(keys, tuple) else (keys,)
        row: dict[str, Any] = dict(zip(by, keys, strict=True))
        row["n"] = len(part)
        for m in metrics:
            row[m], row[f"{m}_lo"], row[f"{m}_hi"] = bootstrap_ci(
                pd.to_numeric(part[m], errors="coerce"), n_boot, level, seed)
        rows.append(row)
    cols = by + ["n"] + [f"{m}{s}" for m in metrics for s in ("", "_lo", "_hi")]
    return _ordered(pd.DataFrame(rows, columns=cols))


def _ordered(df: pd.DataFrame) -> pd.DataFrame:
    """Rows in reading order: the full cache first, then labels alphabetically, then ctx, batch."""
    keys = [c for c in ("model", "task") if c in df.columns]
    if "label" in df.columns:
        df = df.assign(_base=~df["label"].astype(str).map(is_baseline_label), _label=df["label"].astype(str))
        keys += ["_base", "_label"]
    elif "method" in df.columns:
        df = df.assign(_base=df["method"] != "full")
        keys += ["_base", "method"]
    keys += [c for c in ("keep", "ctx", "batch") if c in df.columns]
    if not keys or df.empty:
        return df.drop(columns=["_base", "_label"], errors="ignore")
    return (df.sort_values(keys, kind="stable").drop(columns=["_base", "_label"], errors="ignore")
            .reset_index(drop=True))


def relative_to_baseline(records: pd.DataFrame, metric: str = "j_per_token", baseline: str = "full",
                         ctx: int | None = None, within: Sequence[str] = ("model", "ctx", "batch"),
                         n_boot: int = 2000,
                         level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """Each label's mean ``metric`` over the baseline method's, within the same model, ctx and
    batch (only at ``ctx`` when given).

    ``change_pct`` is the headline number: +35 means 35% more J/token than the full cache.
    """
    within = [w for w in within if w in records.columns]
    cols = ["label", *within, "ratio", "ratio_lo", "ratio_hi", "change_pct"]
    if ctx is not None and "ctx" in records.columns:
        records = records[records["ctx"] == ctx]
    if records.empty or metric not in records.columns or "method" not in records.columns:
        return pd.DataFrame(columns=cols)
    rows = []
    groups = records.groupby(within, sort=True) if within else [((), records)]
    for keys, part in groups:
        keys = keys if isinstance(keys, tuple) else (keys,)
        base = pd.to_numeric(part.loc[part["method"] == baseline, metric], errors="coerce")
        if base.notna().sum() == 0:
            continue
        for label, g in part[part["method"] != baseline].groupby("label", sort=False):
            r, lo, hi = ratio_ci(pd.to_numeric(g[metric], errors="coerce"), base, n_boot, level, seed)
            rows.append({"label": label, **dict(zip(within, keys, strict=True)), "ratio": r,
                         "ratio_lo": lo, "ratio_hi": hi, "change_pct": (r - 1) * 100})
    return _ordered(pd.DataFrame(rows, columns=cols))


def headline(rel: pd.DataFrame, metric_title: str = "J/token", baseline: str = "full") -> list[str]:
    """One sentence per method: '+35% J/token vs full at ctx 16384 (95% CI +30% to +41%)'."""
    lines = []
    for r in rel.dropna(subset=["ratio"]).to_dict("records"):
        where = f" at ctx {int(r['ctx'])}" if "ctx" in r else ""
        ci = ""
        if not math.isnan(r["ratio_lo"]):
            ci = f" (95% CI {(r['ratio_lo'] - 1) * 100:+.0f}% to {(r['ratio_hi'] - 1) * 100:+.0f}%)"
        lines.append(f"{r['label']}: {r['change_pct']:+.0f}% {metric_title} vs {baseline}{where}{ci}")
    return lines


def format_ci(summary: pd.DataFrame, columns: dict[str, str], key: str = "label") -> pd.DataFrame:
    """The summary as display strings ``mean [lo, hi]`` under readable headers."""
    out = pd.DataFrame({"method": summary[key].astype(str), "runs": summary["n"]})
    for col, header in columns.items():
        if col in summary.columns:
            out[header] = [ci_text(r[col], r.get(f"{col}_lo"), r.get(f"{col}_hi"))
                           for r in summary.to_dict("records")]
    return out.reset_index(drop=True)


def study_summary(records: pd.DataFrame, ctx: int = DEFAULT_CTX, metrics: dict[str, str] | None = None,
                  **boot) -> tuple[pd.DataFrame, int | None, str]:
    """The study table at one context (nearest measured if absent, smallest batch measured there):
    the summary frame, the context used and a caption saying which."""
    perf = perf_records(records)
    chosen, caption = pick_ctx(perf, ctx)
    if chosen is None:
        return method_summary(perf, []), None, caption
    at = perf[perf["ctx"] == chosen]
    if "batch" in at.columns and at["batch"].nunique() > 1:
        b = int(at["batch"].min())
        at = at[at["batch"] == b]
        caption += f", batch {b}"
    return method_summary(at, list(metrics or STUDY_METRICS), **boot), chosen, caption


def quality_summary(quality: pd.DataFrame, metric: str = "score", **boot) -> pd.DataFrame:
    """Mean task score per (task, method, keep) with CIs; the full cache counts as keep 1.0."""
    if quality.empty or metric not in quality.columns:
        return pd.DataFrame(columns=["task", "method", "keep", "n", metric, f"{metric}_lo", f"{metric}_hi"])
    q = quality.copy()
    q["keep"] = pd.to_numeric(q["keep"], errors="coerce").fillna(1.0) if "keep" in q.columns else 1.0
    by = [c for c in ("task", "method", "keep") if c in q.columns]
    return method_summary(q, [metric], by=by, **boot)


def sweep_summary(records: pd.DataFrame, **boot) -> pd.DataFrame:
    """The end-of-sweep table: per method, context and batch, the headline metrics as text."""
    perf = perf_records(records)
    metrics = {"itl_median_ms": "ms/token (median)", "tokens_per_s": "tokens/s", "peak_mem_gb": "peak GB",
               "j_per_token": "J/token"}
    summary = method_summary(perf, list(metrics), by=[c for c in ("label", "ctx", "batch") if c in perf.columns],
                             **boot)
    table = format_ci(summary, metrics)
    for col in ("ctx", "batch"):
        if col in summary.columns:
            table.insert(1, col, summary[col].to_numpy())
    return table


def summary_markdown(study: Study) -> str:
    """The report's opening lines: what ran, where, and a loud note when weights were synthetic."""
    rec = study.records
    perf, quality = study.perf, study.quality
    lines = [f"**Sweep folder:** `{study.folder.name or study.folder.resolve().name}` · "
             f"{len(perf)} performance runs, {len(quality)} quality records, "
             f"{len(failed_records(rec))} failed"]
    for col, name in (("model", "model"), ("device", "device"), ("gpu_name", "GPU"),
                      ("energy_source", "energy source")):
        v = _unique(rec, col)
        if v:
            lines.append(f"**{name}:** {v}")
    weights = _unique(rec, "weights") or "unknown"
    lines.append(f"**weights: {weights}**")
    if study.synthetic:
        lines.append(f"> weights: synthetic ({SYNTHETIC_NOTE}).")
    return "\n\n".join(lines)


# ---------------------------------------------------------------------------------------------
# provenance


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                out.update(_flatten(x, f"{key}[{i}]."))
        else:
            out[key] = v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v)
    return out


def _unique(records: pd.DataFrame, col: str) -> str | None:
    if col not in records.columns:
        return None
    vals = [str(v) for v in dict.fromkeys(records[col].dropna())]
    return ", ".join(vals) if vals else None


# Manifest entries shown first (matched by key suffix anywhere in manifest.json; first match wins).
MANIFEST_HEADLINES = (
    ("gpu_name", "GPU (NVML)"), ("driver", "driver"), ("cuda_driver_version", "CUDA driver"),
    ("torch_cuda", "torch CUDA"), ("packages.torch", "torch"), ("packages.transformers", "transformers"),
    ("packages.optimum-quanto", "optimum-quanto"), ("packages.kvlab", "kvlab"), ("git_sha", "git commit"),
    ("git_dirty", "uncommitted changes"), ("python", "python"), ("platform", "platform"),
    ("energy_source", "energy source (manifest)"),
)


def _compact_key(key: str) -> bool:
    return key.startswith("params.") or ("." not in key and "[" not in key and key != "run_ids")


def provenance(manifest: dict, records: pd.DataFrame, full: bool = False) -> pd.DataFrame:
    """A ``value`` column indexed by ``item``: what ran where, weights first, then the manifest.

    The weights line always says ``synthetic`` when any record used synthetic weights, because a
    quality number from random weights must never pass for a real one. Without ``full`` the
    manifest part is its top-level facts and the sweep params (the headlines above cover the
    environment); ``full`` lists every entry.
    """
    rows: list[tuple[str, Any]] = []
    weights = _unique(records, "weights")
    if weights and "synthetic" in weights:
        weights = f"{weights} ({SYNTHETIC_NOTE})"
    rows.append(("weights", weights or "unknown (no weights column in records)"))
    for col, name in (("model", "model"), ("device", "device"), ("gpu_name", "GPU"), ("dtype", "dtype"),
                      ("attn_implementation", "attention"), ("sdpa_backend", "SDPA backend"),
                      ("energy_source", "energy source"), ("sweep", "sweep")):
        v = _unique(records, col)
        if v is not None:
            rows.append((name, v))
    if "status" in records.columns:
        rows.append(("runs", f"{int((records['status'] == 'ok').sum())} ok, "
                             f"{int((records['status'] != 'ok').sum())} failed"))
    flat = _flatten(manifest)
    if not flat:
        rows.append(("manifest", "manifest.json missing: driver and versions unknown"))
    for suffix, name in MANIFEST_HEADLINES:
        value = next((v for k, v in flat.items() if k == suffix or k.endswith("." + suffix)), None)
        if value is not None:
            rows.append((name, value))
    rows.extend((f"manifest: {k}", v) for k, v in flat.items() if full or _compact_key(k))
    return pd.DataFrame(rows, columns=["item", "value"]).set_index("item")


# ---------------------------------------------------------------------------------------------
# loading


@dataclass
class Study:
    """A records folder as the report sees it."""

    folder: Path
    records: pd.DataFrame
    manifest: dict = field(default_factory=dict)

    @property
    def perf(self) -> pd.DataFrame:
        return perf_records(self.records)

    @property
    def quality(self) -> pd.DataFrame:
        return quality_records(self.records)

    @property
    def synthetic(self) -> bool:
        return "weights" in self.records.columns and (self.records["weights"] == "synthetic").any()


def load_study(folder: str | Path) -> Study:
    """Records (via kvlab.records.load_records) and manifest.json of one sweep folder."""
    from kvlab.records import load_records

    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"records folder {folder} does not exist: run `kvlab sweep PARAMS.yaml -o {folder}`")
    records = load_records(folder)
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    return Study(folder, records, manifest)


# ---------------------------------------------------------------------------------------------
# notebook glue


def project_root(start: str | Path | None = None) -> Path:
    """The kvlab checkout around ``start`` (default: cwd): the nearest folder up with a
    pyproject.toml and a notebooks/ folder; cwd when there is none (an installed kvlab)."""
    start = Path(start or Path.cwd()).resolve()
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "notebooks").is_dir():
            return folder
    return start


def project_path(path: str | Path) -> Path:
    """A notebook path parameter: absolute as given; relative to cwd if it exists there, else to
    the project root, so one value works from JupyterLab (cwd notebooks/), from papermill run at
    the root, and as ``"."`` when ``kvlab report`` runs the notebook inside the records folder."""
    path = Path(path)
    if path.is_absolute() or path.exists():
        return path
    return project_root() / path


def notebook_sweep_params(params_file: str | Path | None = None, namespace: dict | None = None, **values):
    """Sweep params for the sweep notebook: the YAML file as the base, then every sweep key that is
    not None in ``namespace`` (the notebook's ``globals()``: its parameters, including what
    papermill ``-p``/``-f`` injected) and in ``values``.

    Validated by kvlab.params (a scalar ``ctx`` becomes a one-element list there).
    """
    import yaml

    from kvlab.params import SweepParams, parse_params

    data: dict[str, Any] = {}
    if params_file:
        path = project_path(params_file)
        if not path.is_file():
            raise ReportError(f"params file {path} not found: pass params_file='params/smoke.yaml' or None")
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        data.setdefault("name", path.stem)
    merged = {k: v for k, v in (namespace or {}).items() if k in SweepParams.model_fields}
    merged.update(values)
    data.update({k: v for k, v in merged.items() if v is not None})
    return parse_params(data)


# ---------------------------------------------------------------------------------------------
# rendering


# nbconvert's lab template, minus every script it would fetch from a CDN (require.js, MathJax,
# mermaid, the widget manager: widgets do not render in static HTML anyway). Report markdown
# uses no LaTeX; plotly.js is embedded by kvlab.viz.
OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
"""


def execute_notebook(notebook: str | Path, output: str | Path, parameters: dict | None = None,
                     cwd: str | Path | None = None, kernel_name: str = "python3",
                     timeout: int | None = 1800, log_output: bool = False):
    """Run a notebook with papermill; returns the executed notebook node.

    Absolute paths papermill records in the notebook metadata are cut to file names, so a
    published notebook leaks nothing about the machine.
    """
    import nbformat
    import papermill as pm

    notebook, output = Path(notebook), Path(output)
    if not notebook.is_file():
        raise ReportError(f"notebook {notebook} not found: run from a kvlab checkout or pass --notebook")
    output.parent.mkdir(parents=True, exist_ok=True)
    pm.execute_notebook(str(notebook), str(output), parameters=parameters or {}, cwd=str(cwd) if cwd else None,
                        kernel_name=kernel_name, execution_timeout=timeout, log_output=log_output,
                        progress_bar=False)
    nb = nbformat.read(output, as_version=4)
    meta = nb.metadata.get("papermill", {})
    for key in ("input_path", "output_path"):
        if meta.get(key):
            meta[key] = Path(meta[key]).name
    nbformat.write(nb, output)
    return nb


def export_html(nb, html_path: str | Path, title: str | None = None) -> Path:
    """Notebook node -> one self-contained HTML file: code hidden, prompts hidden, no CDN scripts."""
    from nbconvert import HTMLExporter

    html_path = Path(html_path)
    if title:
        nb.metadata["title"] = title
    exporter = HTMLExporter(template_name="lab", exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True)
    exporter.raw_template = OFFLINE_TEMPLATE
    body, _ = exporter.from_notebook_node(nb)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(body, encoding="utf-8")
    return html_path


def render_notebook(notebook: str | Path, html_path: str | Path, parameters: dict | None = None,
                    cwd: str | Path | None = None, title: str | None = None, **execute_kwargs) -> Path:
    """Execute a notebook and export it; the executed ``.ipynb`` is kept next to the HTML."""
    html_path = Path(html_path)
    executed = html_path.with_suffix(".ipynb")
    nb = execute_notebook(notebook, executed, parameters, cwd=cwd, **execute_kwargs)
    return export_html(nb, html_path, title=title)


def render_report(records_dir: str | Path, out: str | Path | None = None, notebook: str | Path | None = None,
                  index: bool = True, parameters: dict | None = None, **execute_kwargs) -> Path:
    """``kvlab report``: the report notebook over one records folder -> HTML (+ the folder index).

    The notebook runs with the records folder as its working directory and ``records_dir="."``,
    so no absolute path enters the published notebook. Default output: ``DIR/report.html``; the
    index goes in the folder above the report's folder (where sweep folders sit side by side).
    """
    records_dir = Path(records_dir).resolve()
    if not records_dir.is_dir():
        raise ReportError(f"records folder {records_dir} does not exist: run `kvlab sweep PARAMS.yaml -o DIR` first")
    out = Path(out) if out else records_dir / "report.html"
    if out.suffix != ".html":
        raise ReportError(f"output {out} must end in .html")
    params = {"records_dir": ".", **(parameters or {})}
    html_path = render_notebook(notebook or REPORT_NOTEBOOK, out, params, cwd=records_dir,
                                title=f"kvlab report: {records_dir.name}", **execute_kwargs)
    if index:
        write_index(index_folder(html_path))
    return html_path


def index_folder(html_path: str | Path) -> Path:
    """Where ``kvlab report`` writes index.html: above ``DIR/report.html``, else next to the file."""
    html_path = Path(html_path).resolve()
    return html_path.parent.parent if html_path.name == "report.html" else html_path.parent


def find_reports(folder: str | Path) -> list[Path]:
    """HTML reports in a folder: ``*.html`` and ``*/report.html`` (never index.html)."""
    folder = Path(folder)
    found = [p for p in folder.glob("*.html") if p.name != "index.html"]
    found += list(folder.glob("*/*.html"))
    return sorted({p for p in found if p.name != "index.html"})


def _html_title(path: Path) -> str:
    with path.open(encoding="utf-8", errors="replace") as f:
        head = f.read(4096)
    start, end = head.find("<title>"), head.find("</title>")
    return html.unescape(head[start + 7:end]).strip() if 0 <= start < end else path.stem


def write_index(folder: str | Path) -> Path:
    """``index.html`` listing the reports in a folder, newest first, with relative links."""
    folder = Path(folder)
    reports = sorted(find_reports(folder), key=lambda p: p.stat().st_mtime, reverse=True)
    items = []
    for p in reports:
        rel = p.relative_to(folder).as_posix()
        when = datetime.fromtimestamp(p.stat().st_mtime, UTC).strftime("%Y-%m-%d %H:%M UTC")
        items.append(f'<li><a href="{html.escape(rel)}">{html.escape(_html_title(p))}</a> '
                     f'<span class="meta">{html.escape(rel)} · {when} · {p.stat().st_size / 1e6:.1f} MB</span></li>')
    body = "\n".join(items) or "<li>no reports yet: run <code>kvlab report DIR</code></li>"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>kvlab reports</title>
<style>body{{font-family:system-ui,sans-serif;max-width:50em;margin:2em auto}}
li{{margin:.4em 0}} .meta{{color:#777;font-size:.85em;margin-left:.6em}}</style></head>
<body><h1>kvlab reports</h1><ul>
{body}
</ul></body></html>
"""
    path = folder / "index.html"
    path.write_text(page, encoding="utf-8")
    return path
