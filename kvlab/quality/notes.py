"""What a quality score means: the notes a quality table needs beside it, and paired summaries
against the full cache."""

from __future__ import annotations

from collections.abc import Sequence

from kvlab.intervals import mean_interval
from kvlab.metrics import paired_difference

# Why SnapKV (and PyramidKV, which scores like it) can score 0 on a needle: the method, not a bug.
SNAPKV_NEEDLE_NOTE = (
    "SnapKV (and PyramidKV, which scores tokens the same way) scores 0 on the needle here, and that is "
    "the method, not a bug: question-agnostic SnapKV keeps, per KV head, the tokens the last window of "
    "the prompt attends to most; on SmolLM2 (3 KV heads) the first layers' heads give the needle's digits "
    "the lowest window attention of the whole prompt and evict them, so the copy breaks (even at keep "
    "0.9). kvlab's SnapKV selections were checked independently and are identical to NVIDIA kvpress "
    "0.5.5's at 500-5200 tokens; TOVA, which scores with the last token only, keeps the needle."
)
NEEDLE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue")
SNAPKV_LIKE = ("snapkv", "pyramidkv")


def quality_notes(records) -> list[str]:
    """Sentences a quality table needs beside it: the SnapKV note when a SnapKV-scored method
    (SnapKV, PyramidKV) scored 0 on a needle task where the full cache found it."""
    import pandas as pd  # lazily: kvlab.quality is imported by params validation

    df = records if isinstance(records, pd.DataFrame) else pd.DataFrame.from_records(list(records))
    need = {"method", "task", "score"}
    if df.empty or not need <= set(df.columns):
        return []
    ok = df[df["status"] == "ok"] if "status" in df.columns else df
    needle = ok[ok["task"].isin(NEEDLE_TASKS)]
    scores = pd.to_numeric(needle["score"], errors="coerce")
    full_found = scores[needle["method"] == "full"].mean() > 0 if (needle["method"] == "full").any() else True
    snap = scores[needle["method"].isin(SNAPKV_LIKE)]
    return [SNAPKV_NEEDLE_NOTE] if len(snap) and snap.mean() == 0 and full_found else []


# ------------------------------------------------------------------ paired summaries


SUMMARY_METRICS = ("score", "gold_nll", "first_token_acc", "kl", "top1_agree")


def summarize(records, metrics: Sequence[str] = SUMMARY_METRICS, n_boot: int = 2000, ci: float = 0.95,
              seed: int = 0):
    """Per (task, length, method/label) means with t-intervals (:mod:`kvlab.intervals`) and paired differences against
    the full cache (paired on depth, sample and query_aware), plus the ``no_signal`` flag.

    ``records`` is a list of quality record dicts or a DataFrame from ``load_records``.
    """
    import pandas as pd

    df = records if isinstance(records, pd.DataFrame) else pd.DataFrame.from_records(list(records))
    if df.empty:
        return pd.DataFrame()
    df = df[(df["kind"] == "quality") & (df["status"] == "ok")].copy()
    df["depth_key"] = df["depth"].fillna(-1.0)
    pair_key = ["depth_key", "sample", "query_aware"]
    rows = []
    for (task, length), cell in df.groupby(["task", "length"], sort=False):
        full = cell[cell["label"] == "full"].set_index(pair_key)  # one shot: chunked runs are "full chunk N"
        for (method, label), arm in cell.groupby(["method", "label"], sort=False):
            row = {"task": task, "length": length, "method": method, "label": label, "n": len(arm),
                   "no_signal": bool(arm["no_signal"].fillna(False).any())}
            indexed = arm.set_index(pair_key)
            for m in metrics:
                vals = pd.to_numeric(arm[m], errors="coerce").tolist()
                row[m], row[f"{m}_lo"], row[f"{m}_hi"] = mean_interval(vals, ci).as_tuple()
                if not full.empty and label != "full":
                    common = indexed.index.intersection(full.index)
                    a = pd.to_numeric(indexed.loc[common, m], errors="coerce").tolist()
                    b = pd.to_numeric(full.loc[common, m], errors="coerce").tolist()
                    d = paired_difference(a, b, n_boot, ci, seed)
                    row[f"{m}_diff"], row[f"{m}_diff_lo"], row[f"{m}_diff_hi"] = d["diff"], d["diff_lo"], d["diff_hi"]
            rows.append(row)
    return pd.DataFrame(rows)
