"""The report's answers as pure functions of the records: the study table, per context, per batch,
where compression pays, the int4 energy sentences, the 10 Hz gap and the quality summary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from kvlab.intervals import mean_interval
from kvlab.reporting.fidelity import add_quality
from kvlab.reporting.frames import (
    DEFAULT_CTX,
    all_perf_records,
    contended_mask,
    cpu_only,
    ok_mask,
    perf_records,
    pick_ctx,
    smallest_batch,
)
from kvlab.reporting.stats import format_ci, method_summary, ratio_ci, reading_order
from kvlab.reporting.text import ci_text, fmt_ctx

STUDY_METRICS = {
    "peak_mem_gb": "peak memory (GB)",
    "cache_gb": "KV cache (GB)",
    "j_per_token": "J/token",
    "itl_median_ms": "time between tokens (ms, median)",
    "tokens_per_s": "tokens/s",
}


# What makes two runs comparable: a method is compared with the baseline method run on the same card
# (``card``: the GPU's UUID, :mod:`kvlab.reporting.cards`; no ratio crosses cards), model, engine and
# weights (int8 weights x quanto's cache against int8 weights x the full cache; the weights' own cost
# is the stack section's), at the same context and batch.
CELL = ("card", "model", "engine", "weights_quant", "ctx", "batch")


def relative_to_baseline(records: pd.DataFrame, metric: str = "j_per_token", baseline: str = "full",
                         ctx: int | None = None, within: Sequence[str] = CELL,
                         n_boot: int = 2000,
                         level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """Each label's mean ``metric`` over the baseline method's, within the same model, engine,
    weights, ctx and batch (:data:`CELL`; only at ``ctx`` when given).

    ``change_pct`` is the headline number: +35 means 35% more J/token than the full cache.
    """
    within = [w for w in within if w in records.columns]
    cols = ["label", *within, "n", "n_base", "ratio", "ratio_lo", "ratio_hi", "change_pct"]
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
            values = pd.to_numeric(g[metric], errors="coerce")
            r, lo, hi = ratio_ci(values, base, n_boot, level, seed)
            rows.append({"label": label, **dict(zip(within, keys, strict=True)), "n": int(values.notna().sum()),
                         "n_base": int(base.notna().sum()), "ratio": r,
                         "ratio_lo": lo, "ratio_hi": hi, "change_pct": (r - 1) * 100})
    return reading_order(pd.DataFrame(rows, columns=cols))


def headline(rel: pd.DataFrame, metric_title: str = "J/token", baseline: str = "full") -> list[str]:
    """One sentence per method: '+35% J/token vs full at ctx 16384 (95% CI +30% to +41%)'; the batch
    is named too when ``rel`` holds several (a folder of sweeps), so no two lines read the same."""
    lines = []
    several_batches = "batch" in rel.columns and rel["batch"].nunique() > 1
    several_cards = "card" in rel.columns and rel["card"].nunique() > 1
    for r in rel.dropna(subset=["ratio"]).to_dict("records"):
        where = f" at ctx {int(r['ctx'])}" if "ctx" in r else ""
        if several_batches:
            where += f", batch {int(r['batch'])}"
        if several_cards:
            where += f", on {r['card']}"
        ci = ""
        if not math.isnan(r["ratio_lo"]):
            ci = f" (95% Welch-log CI {(r['ratio_lo'] - 1) * 100:+.0f}% to {(r['ratio_hi'] - 1) * 100:+.0f}%)"
        elif "n" in r and "n_base" in r:
            ci = f" (n={int(r['n'])}/{int(r['n_base'])}, no interval)"
        lines.append(f"{r['label']}: {r['change_pct']:+.0f}% {metric_title} vs {baseline}{where}{ci}")
    return lines



def study_summary(records: pd.DataFrame, ctx: int | None = None, metrics: dict[str, str] | None = None,
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
    by = [c for c in ("task", "method", "label", "keep") if c in q.columns]  # label: int4 apart from int2
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


# ---------------------------------------------------------------------------------------------
# a folder of sweeps: contexts, batches, where compression pays, the int4 answer


CONTEXT_METRICS = {
    "peak_mem_gb": "peak memory (GB)",
    "j_per_token": "J/token",
    "itl_median_ms": "time between tokens (ms, median)",
}
BATCH_METRICS = {
    "tokens_per_s": "decode tokens/s (whole batch)",
    "j_per_token": "J/token",
    "decode_j_per_token": "decode J/token",
    "itl_median_ms": "time between tokens (ms, median)",
    "peak_mem_gb": "peak memory (GB)",
}
PAYS_METRICS = {
    "j_per_token": "J/token",
    "cpu_ms_per_token": "CPU ms/token",
    "decode_cpu_ms_per_token": "decode CPU ms/token",
    "itl_median_ms": "time between tokens",
    "tokens_per_s": "tokens/s",
}
# The cost a verdict reads: energy on a GPU; on a CPU-only machine the process's CPU time (no energy
# counter there, and wall time counts the neighbours: on a shared 2-core VM 15 of 18 smoke runs were
# contended, yet their CPU ms/token stayed within +-10%).
COSTS = {"j_per_token": "J/token", "cpu_ms_per_token": "CPU ms/token"}
# Metrics that a neighbour inflates (wall clock): contended runs stay out of their ratios.
WALL_METRICS = ("itl_median_ms", "tokens_per_s")
# The verdicts of `pays_verdict`, in words for the int4 sentences, per cost.
VERDICT_WORDS = {
    "pays": "less {what} than the full cache",
    "costs": "more {what} than the full cache",
    "no clear difference": "no clear difference from the full cache",
}
COST_WORDS = {"j_per_token": "energy", "cpu_ms_per_token": "CPU time"}


def failure_text(errors: Sequence[Any]) -> str:
    """``failed: OOM`` when a run ran out of GPU memory, else ``failed:`` and the first error, short:
    what a table cell says instead of a number."""
    texts = [str(e) for e in errors if e is not None and not (isinstance(e, float) and math.isnan(e))]
    if any("out of memory" in t.lower() or "outofmemory" in t.lower() for t in texts):
        return "failed: OOM"
    if not texts:
        return "failed"
    first = texts[0].splitlines()[0]
    return f"failed: {first[:77] + '...' if len(first) > 80 else first}"




def context_summary(records: pd.DataFrame, metrics: Sequence[str] | None = None, batch: int | None = None,
                    **boot) -> tuple[pd.DataFrame, str]:
    """Per method and context at one batch (the smallest measured unless given), with CIs: contexts
    compare like with like only at the same batch, and a folder of sweeps mixes batches at 16k."""
    perf = perf_records(records)
    metrics = list(metrics or CONTEXT_METRICS)
    batch = smallest_batch(perf) if batch is None else batch
    if perf.empty or "ctx" not in perf.columns or batch is None:
        return pd.DataFrame(columns=["label", "ctx", "n"]), "no performance records"
    at = perf[perf["batch"] == batch]
    ctxs = sorted(int(c) for c in at["ctx"].dropna().unique())
    caption = f"batch {batch}, ctx {', '.join(map(str, ctxs))}" if ctxs else f"no runs at batch {batch}"
    return method_summary(at, metrics, by=["label", "ctx"], **boot), caption


def pick_batch_ctx(records: pd.DataFrame, ctx: int | None = None) -> tuple[int | None, str]:
    """The context of the batch section: ``ctx`` if several batches ran there, else the context
    with the most batch sizes (nearest to ``ctx`` on ties); None and why when no context has two."""
    if records.empty or not {"ctx", "batch"} <= set(records.columns):
        return None, "no performance records"
    counts = records.dropna(subset=["ctx", "batch"]).groupby("ctx")["batch"].nunique()
    several = {int(c): int(n) for c, n in counts.items() if n > 1}
    if not several:
        batches = sorted(int(b) for b in records["batch"].dropna().unique())
        return None, (f"one batch size per context (batch {', '.join(map(str, batches))}): "
                      f"no batch scaling in this folder")
    target = DEFAULT_CTX if ctx is None else ctx
    if target in several:
        return target, f"ctx {target}"
    best = min(several, key=lambda c: (-several[c], abs(math.log(c / target)), -c))
    if ctx is None:
        return best, f"ctx {best} (the context with the most batch sizes)"
    return best, f"ctx {best} (the context with the most batch sizes; {ctx} has fewer than two)"


def batch_summary(records: pd.DataFrame, ctx: int | None = None, metrics: Sequence[str] | None = None,
                  **boot) -> tuple[pd.DataFrame, int | None, str]:
    """Per (method, batch) at one context (:func:`pick_batch_ctx`), mean and CI per metric, with
    a ``status``: methods measured at one batch only are left out, and a (method, batch) whose runs
    all failed stays as a row with ``n`` 0 and ``status`` ``failed: OOM``."""
    metrics = list(metrics or BATCH_METRICS)
    perf = all_perf_records(records)
    chosen, caption = pick_batch_ctx(perf, ctx)
    if chosen is None:
        present = [m for m in metrics if m in perf.columns]
        empty = pd.DataFrame(columns=["label", "batch", "n", *[f"{m}{s}" for m in present for s in ("", "_lo", "_hi")],
                                      "status"])
        return empty, None, caption
    at = perf[perf["ctx"] == chosen]
    scaled = at.groupby("label")["batch"].nunique()
    at = at[at["label"].isin(scaled[scaled > 1].index)]
    ok = ok_mask(at)
    summary = method_summary(at[ok], metrics, by=["label", "batch"], **boot)
    summary["status"] = "ok"
    fails = {key: failure_text(g["error"] if "error" in g.columns else [])
             for key, g in at[~ok].groupby(["label", "batch"])}
    extra = []
    for (label, batch), text in fails.items():
        hit = (summary["label"] == label) & (summary["batch"] == batch)
        if hit.any():
            n_failed = int(((at["label"] == label) & (at["batch"] == batch) & ~ok).sum())
            summary.loc[hit, "status"] = f"ok ({n_failed} {text})"
        else:
            extra.append({"label": label, "batch": batch, "n": 0, "status": text})
    if extra:
        summary = pd.concat([summary, pd.DataFrame(extra)], ignore_index=True)
    caption = f"Batch sizes at {caption}: mean [95% t-interval; none below 3 runs]"
    if "new_tokens" in at.columns and at["new_tokens"].nunique() > 1:
        per_batch = at.groupby("batch")["new_tokens"].agg(lambda v: "/".join(map(str, sorted(set(v.dropna())))))
        caption += ("; new tokens per sequence differ (" + ", ".join(f"batch {b}: {t}" for b, t in per_batch.items())
                    + "): J/token includes the prefill, so compare decode J/token across batches")
    return reading_order(summary), chosen, caption


def rows_or_say(table: pd.DataFrame, sentence: str) -> pd.DataFrame | None:
    """The table, or (printed) ``sentence`` when it has no rows: no empty header in the report."""
    if table is None or table.empty:
        print(sentence)
        return None
    return table


def pays_metric(pays: pd.DataFrame) -> tuple[str, str]:
    """The metric the *where compression pays* chart colours: the cost its verdicts read (J/token
    where energy was measured, CPU ms/token on a CPU), else time between tokens."""
    for metric, title in COSTS.items():
        col = f"{metric}_ratio"
        if col in pays.columns and pd.to_numeric(pays[col], errors="coerce").notna().any():
            if "cost" not in pays.columns or (pays["cost"] == metric).any():
                return metric, title
    return "itl_median_ms", "time between tokens"


def pays_why(pays: pd.DataFrame, no_energy: str | None = None) -> str:
    """Why the *where compression pays* chart has no ratio to colour: the cells' verdicts (every
    run contended, failed, no full run), or the missing energy when J/token is the metric."""
    metric, _ = pays_metric(pays)
    if metric == "j_per_token" or pays.empty:
        return no_energy or "no performance records"
    if metric in COSTS:
        return "no ratio in any cell"
    return "no ratio in any cell: " + "; ".join(dict.fromkeys(str(v) for v in pays["verdict"]))


def say(lines: Sequence[str] | str | None) -> None:
    """Print the lines there are (nothing for none): a notebook cell then shows no empty output."""
    lines = [lines] if isinstance(lines, str) else list(lines or [])
    if any(lines):
        print("\n".join(line for line in lines if line))


def captioned(table: pd.DataFrame, caption: str) -> pd.DataFrame | None:
    """Print ``caption`` and return the table when it has rows; None and silence when empty (a
    figure of the same section already says why)."""
    if table is None or table.empty:
        return None
    print(caption)
    return table


def rows_or_none(table: pd.DataFrame) -> pd.DataFrame | None:
    """The table, or None when it has no rows: a notebook cell then shows nothing under the
    sentence that already said why, instead of an empty header."""
    return None if table is None or table.empty else table


def pays_verdict(ratio: float, lo: float, hi: float, cost: str = "J/token") -> str:
    """Does compression pay? On the cost's ratio to the full cache (J/token, or CPU ms/token on a
    CPU) and its 95% CI."""
    if ratio is None or math.isnan(ratio):
        return f"no {cost} data"
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return "no interval (fewer than 3 runs a side)"
    if hi < 1:
        return "pays"
    if lo > 1:
        return "costs"
    return "no clear difference"


def cell_cost(cell: pd.DataFrame) -> str:
    """The cost a cell's verdict reads: ``j_per_token`` (energy), except on a CPU-only cell with CPU
    time recorded (:func:`kvlab.reporting.frames.cpu_only`), where it is ``cpu_ms_per_token``."""
    if cpu_only(cell) and "cpu_ms_per_token" in cell.columns and cell["cpu_ms_per_token"].notna().any():
        return "cpu_ms_per_token"
    return "j_per_token"


def compression_pays(records: pd.DataFrame, baseline: str = "full", metrics: Sequence[str] | None = None,
                     n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """For every measured (ctx, batch) cell, each method's metrics over the full cache's in the same
    cell: ratio of means with a Welch-log interval (:mod:`kvlab.intervals`) (``{metric}_ratio``, ``_lo``, ``_hi``) and a
    ``verdict`` (:func:`pays_verdict`) on the cell's ``cost`` (:func:`cell_cost`: J/token, or CPU
    ms/token on a CPU). A method that failed in a cell, or ran where the full cache failed (that is
    where compression pays in capacity), gets a row saying so. Runs flagged ``contended`` (measured
    while other work took the CPU: :func:`kvlab.hostload.contention`) are counted in ``n_contended``
    and left out of the wall-clock ratios (:data:`WALL_METRICS`) and of J/token; CPU time keeps them
    (the time the process ran, which a neighbour does not add to), so ``n`` and ``n_base`` count the
    runs behind the verdict. Each row also carries the method's ``quality`` on the same model (or, for
    a model without quality records such as synthetic weights, on a real model, named as another) and
    ``collapse``; the verdict is qualified by it (:func:`kvlab.reporting.fidelity.qualified_verdict`)."""
    perf = all_perf_records(records)
    metrics = [m for m in (metrics or PAYS_METRICS) if m in perf.columns or m == "j_per_token"]
    within = [c for c in CELL if c in perf.columns]
    ratio_cols = [f"{m}_ratio{s}" for m in metrics for s in ("", "_lo", "_hi")]
    head = ["label", "ctx", "batch", "n", "n_base", "n_contended", "cost"]
    if perf.empty or "method" not in perf.columns or not {"ctx", "batch"} <= set(within):
        return pd.DataFrame(columns=[*head, *ratio_cols, "verdict"])
    cols = ["label", *within, "n", "n_base", "n_contended", "cost", *ratio_cols, "verdict"]
    rows = []
    for keys, cell in perf.groupby(within, sort=True):
        where = dict(zip(within, keys if isinstance(keys, tuple) else (keys,), strict=True))
        cost = cell_cost(cell)
        keeps_busy = cost == "cpu_ms_per_token"
        ok = ok_mask(cell)
        busy = contended_mask(cell)
        is_base = cell["method"] == baseline
        base_all, base_quiet = cell[is_base & ok], cell[is_base & ok & ~busy]
        base = base_all if keeps_busy else base_quiet
        base_failed = cell[is_base & ~ok]
        for label, g in cell[~is_base].groupby("label", sort=False):
            g_all = g[ok_mask(g)]
            g_quiet = g_all[~busy[g_all.index]]
            g_ok = g_all if keeps_busy else g_quiet
            n_busy = int(busy[g_all.index].sum() + busy[base_all.index].sum())
            row: dict[str, Any] = {"label": label, **where, "n": len(g_ok), "n_base": len(base),
                                   "n_contended": n_busy, "cost": cost}
            row.update(dict.fromkeys(ratio_cols, math.nan))
            if g_ok.empty and n_busy and not g_all.empty:
                row["verdict"] = "every run contended (other processes took the CPU): left out"
            elif g_ok.empty:
                row["verdict"] = failure_text(g["error"] if "error" in g.columns else [])
            elif base.empty and not base_all.empty:
                row["verdict"] = f"every {baseline} run contended (other processes took the CPU): no ratio"
            elif base.empty:
                row["verdict"] = (f"ran where {baseline} " + failure_text(base_failed.get("error", []))
                                  if not base_failed.empty else f"no {baseline} run in this cell")
            else:
                for m in metrics:
                    if m in cell.columns:
                        x, b = (g_quiet, base_quiet) if m in WALL_METRICS or m == "j_per_token" else (g_all, base_all)
                        r = ratio_ci(pd.to_numeric(x[m], errors="coerce"),
                                     pd.to_numeric(b[m], errors="coerce"), n_boot, level, seed)
                        row[f"{m}_ratio"], row[f"{m}_ratio_lo"], row[f"{m}_ratio_hi"] = r
                row["verdict"] = pays_verdict(row.get(f"{cost}_ratio", math.nan),
                                              row.get(f"{cost}_ratio_lo", math.nan),
                                              row.get(f"{cost}_ratio_hi", math.nan), COSTS[cost])
            rows.append(row)
    return add_quality(reading_order(pd.DataFrame(rows, columns=cols)), records, baseline)


def pays_table(pays: pd.DataFrame, metrics: dict[str, str] | None = None) -> pd.DataFrame:
    """:func:`compression_pays` as display text: ``ratio [lo, hi]`` per metric, 1.0 = the full cache."""
    metrics = metrics or PAYS_METRICS
    out = pd.DataFrame({"ctx": pays["ctx"].to_numpy(), "batch": pays["batch"].to_numpy(),
                        "method": pays["label"].astype(str).to_numpy(),
                        "runs (method/full)": [f"{int(a)}/{int(b)}" for a, b in zip(pays["n"], pays["n_base"],
                                                                                     strict=True)]})
    if "model" in pays.columns and pays["model"].nunique() > 1:
        out.insert(0, "model", pays["model"].to_numpy())
    cpu = "cost" in pays.columns and not pays.empty and pays["cost"].eq("cpu_ms_per_token").all()
    for m, title in metrics.items():
        if m == "j_per_token" and cpu:  # a CPU has no energy counter: an all-n/a column says nothing
            continue
        if f"{m}_ratio" in pays.columns:
            out[f"{title} / full"] = [ci_text(r[f"{m}_ratio"], r[f"{m}_ratio_lo"], r[f"{m}_ratio_hi"])
                                      for r in pays.to_dict("records")]
    if "n_contended" in pays.columns and pays["n_contended"].fillna(0).astype(int).gt(0).any():
        head = "contended runs (out of wall-time ratios)" if cpu else "contended runs left out"
        out[head] = pays["n_contended"].fillna(0).astype(int).to_numpy()
    if "quality" in pays.columns:
        out["quality"] = pays["quality"].to_numpy()
    costs = list(dict.fromkeys(pays["cost"])) if "cost" in pays.columns else ["j_per_token"]
    if len(costs) == 1:
        out[f"verdict ({COSTS.get(costs[0], costs[0])})"] = pays["verdict"].to_numpy()
    else:
        out["verdict"] = [f"{v} ({COSTS.get(c, c)})" for v, c in zip(pays["verdict"], pays["cost"], strict=True)]
    return out.sort_values(["ctx", "batch"], kind="stable").reset_index(drop=True)


def energy_answer(pays: pd.DataFrame, pattern: str = "int4", baseline: str = "full",
                  why: str | None = None) -> list[str]:
    """The int4-vs-full-cache question in sentences, one per (ctx, batch) cell, from
    :func:`compression_pays`, on the cell's cost: 'quanto int4 used +35% J/token vs full at 16k,
    batch 1 (95% CI +30% to +41%, 3 vs 3 runs): more energy than the full cache', or on a CPU '...
    +80% CPU ms/token ...: more CPU time than the full cache'. ``pattern`` picks the labels."""
    rows = pays[pays["label"].astype(str).str.contains(pattern, regex=False)] if not pays.empty else pays
    if rows.empty:
        return [f"no '{pattern}' runs in this folder"]
    lines = []
    for r in rows.sort_values(["ctx", "batch"], kind="stable").to_dict("records"):
        cost = r.get("cost") if isinstance(r.get("cost"), str) else "j_per_token"
        title = COSTS.get(cost, cost)
        where = f"at {fmt_ctx(r['ctx'])}, batch {int(r['batch'])}"
        ratio, lo, hi = r[f"{cost}_ratio"], r[f"{cost}_ratio_lo"], r[f"{cost}_ratio_hi"]
        if ratio is None or math.isnan(ratio):
            reason = r["verdict"] if r["verdict"] != f"no {title} data" else (why or f"no {title} recorded")
            lines.append(f"{r['label']} {where}: {reason}")
            continue
        runs = f"{int(r['n'])} vs {int(r['n_base'])} runs"
        ci = (f"95% Welch-log CI {(lo - 1) * 100:+.0f}% to {(hi - 1) * 100:+.0f}%, {runs}" if not math.isnan(lo)
              else f"{runs}, no interval below 3 runs a side")
        words = VERDICT_WORDS.get(r["verdict"], "").format(what=COST_WORDS.get(cost, title))
        if not words and r["verdict"] != "no interval (fewer than 3 runs a side)":
            words = r["verdict"]  # a verdict qualified by quality says so itself
        tail = f": {words}" if words else ""
        quality = f"; quality: {r['quality']}" if isinstance(r.get("quality"), str) else ""
        lines.append(f"{r['label']} used {(ratio - 1) * 100:+.0f}% {title} vs {baseline} {where} ({ci}){tail}"
                     f"{quality}")
    return lines


def cpu_cost_note(records: pd.DataFrame, rapl: str | None = None) -> str | None:
    """One sentence on why CPU time is the cost of CPU-only records, and the steal and contention
    measured during their decodes; None when some record ran on a GPU (energy is the cost there).
    ``rapl``: the machine's RAPL status as the manifest recorded it (:func:`kvlab.hostload.rapl_status`)."""
    perf = perf_records(records)
    if perf.empty or not cpu_only(perf) or "cpu_ms_per_token" not in perf.columns:
        return None
    counter = f"RAPL {rapl}" if rapl else "no energy counter read"
    text = ("On a CPU the cost is the process's CPU time (user + system, all threads) per generated token: "
            "it counts the work the method made the CPU do, which steal and other processes barely "
            f"change while they stretch wall time, and kvlab reads no CPU energy ({counter})")
    if {"decode_host_steal_ms", "decode_s"} <= set(perf.columns):
        share = (pd.to_numeric(perf["decode_host_steal_ms"], errors="coerce")
                 / (pd.to_numeric(perf["decode_s"], errors="coerce") * 10.0)).dropna()
        if not share.empty:
            text += (f"; during these {len(share)} decodes the hypervisor took {share.median():.0f}% of a CPU as "
                     f"steal (median; up to {share.max():.0f}%)")
    busy = int(contended_mask(perf).sum())
    text += (f", and {busy} of {len(perf)} runs were flagged contended: their wall times are context, "
             f"left out of the wall-time ratios." if busy else ".")
    return text


def tenhz_gap(records: pd.DataFrame, **boot) -> tuple[pd.DataFrame, str]:
    """How far the study's 10 Hz power integration is from the energy counter: per (ctx, batch),
    ``gap_pct`` = (10 Hz energy / counter energy - 1) x 100 with a CI over runs, and the energy
    window's length (the gap scales with 1 / window); plus one sentence over all runs."""
    perf = perf_records(records)
    cols = ["ctx", "batch", "n", "gap_pct", "gap_pct_lo", "gap_pct_hi", "window_s", "window_s_lo", "window_s_hi"]
    if not {"energy_j", "energy_10hz_j"} <= set(perf.columns):
        return pd.DataFrame(columns=cols), "no energy measurements (energy_source none on this device)"
    counter = pd.to_numeric(perf["energy_j"], errors="coerce")
    sampled = pd.to_numeric(perf["energy_10hz_j"], errors="coerce")
    d = perf[(counter > 0) & sampled.notna()].copy()
    if d.empty:
        return pd.DataFrame(columns=cols), "no energy measurements (energy_source none on this device)"
    d["gap_pct"] = (sampled[d.index] / counter[d.index] - 1) * 100
    if "window_s" in d.columns and d["window_s"].notna().any():
        d["window_s"] = pd.to_numeric(d["window_s"], errors="coerce")
    elif {"prefill_s", "decode_s"} <= set(d.columns):
        d["window_s"] = pd.to_numeric(d["prefill_s"], errors="coerce") + pd.to_numeric(d["decode_s"], errors="coerce")
    else:
        d["window_s"] = math.nan
    summary = method_summary(d, ["gap_pct", "window_s"], by=["ctx", "batch"], **boot)
    mean, lo, hi = mean_interval(d["gap_pct"], boot.get("level", 0.95)).as_tuple()
    ci = f" (95% t-interval {lo:+.1f}% to {hi:+.1f}%)" if not math.isnan(lo) else f" (n={len(d)}, no interval)"
    w = d["window_s"].dropna()
    span = f", energy windows {w.min():.1f} to {w.max():.1f} s" if not w.empty else ""
    sentence = (f"Over {len(d)} runs the 10 Hz power integration read {mean:+.1f}% of the counter's "
                f"energy{ci}{span}.")
    return summary, sentence


