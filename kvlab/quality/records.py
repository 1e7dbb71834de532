"""Quality records: their ids (known before an item runs, so a pass resumes), their columns, and
the full-cache reference every record is compared with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlab.columns import policy_columns
from kvlab.policies import make_policy
from kvlab.records import make_run_id, utc_now
from kvlab.tasks import TaskItem


def is_reference(policy) -> bool:
    """Whether ``policy`` is the full cache with a one-shot prefill (the reference of a pass)."""
    return policy.name == "full" and getattr(policy, "prefill_chunk", None) is None


def reference_policy(policies: Sequence):
    """The pass's reference: the one-shot full cache among ``policies``, else a new one."""
    return next((p for p in policies if is_reference(p)), None) or make_policy("full")


def item_key(item: TaskItem, query_aware: bool) -> dict[str, Any]:
    return {"task": item.task, "length": item.length, "depth": item.depth, "sample": item.sample,
            "query_aware": bool(query_aware)}


def quality_run_id(base: dict[str, Any], policy, item: TaskItem, query_aware: bool) -> str:
    """The stable id of one (model, policy, item) quality record, known before it runs: a resumed
    pass skips the items whose records are already written."""
    pcols = policy_columns(policy)
    engine = {"engine": base["engine"]} if base.get("engine", "hf") != "hf" else {}  # hf ids as before
    return make_run_id({"kind": "quality", "model": base.get("model"), "sweep": base.get("sweep"),
                        "method": pcols["method"], "policy_params": pcols["policy_params"],
                        "item_seed": item.seed, **item_key(item, query_aware), **engine}, 0)


def quality_record(base: dict[str, Any], policy, item: TaskItem, *, query_aware: bool,
                   score: float | None, fidelity: dict[str, Any], extra: dict[str, Any] | None = None,
                   status: str = "ok", error: str | None = None) -> dict[str, Any]:
    """One quality record: identity columns, the item's key, its score and fidelity metrics.

    ``run_id`` hashes everything that identifies the measurement, so a re-run of the same
    (model, policy, item) replaces rather than duplicates it in ``load_records``.
    """
    pcols = policy_columns(policy, base.get("engine") or "hf")
    key = item_key(item, query_aware)
    rec = {
        "run_id": quality_run_id(base, policy, item, query_aware),
        "sweep": base.get("sweep"),
        "kind": "quality",
        "created_at": utc_now(),
        "status": status,
        "error": error,
        **{k: v for k, v in base.items() if k not in ("sweep", "run_id")},
        **pcols,
        "seed": base.get("seed"),
        **key,
        "score": score,
        "gold_nll": fidelity.get("gold_nll"),
        "first_token_acc": fidelity.get("first_token_acc"),
        "kl": fidelity.get("kl"),
        "top1_agree": fidelity.get("top1_agree"),
        "no_signal": None,  # set per (task, length) cell once the full cache has been scored
        "tf_token_acc": fidelity.get("tf_token_acc"),
        "metric": item.metric,
        "prompt_tokens": item.n_prompt_tokens,
        "answer_tokens": len(item.answer_ids),
        "item_seed": item.seed,
    }
    rec.update(extra or {})
    return rec


def emit(writer, record: dict[str, Any]) -> None:
    """Hand a record to a :class:`kvlab.records.RecordWriter`, a callable, or nobody (None)."""
    if writer is None:
        return
    if hasattr(writer, "append"):
        writer.append(record)
    else:
        writer(record)

