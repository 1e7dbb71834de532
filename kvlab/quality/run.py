"""The quality pass: every item of a :class:`~kvlab.quality.spec.TaskSpec` under every policy, cell
by cell, with the full cache as the reference of each record."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvlab.columns import engine_columns, model_columns
from kvlab.engine.engines import Engine, make_engine
from kvlab.metrics import answer_span_fidelity
from kvlab.policies.base import attached
from kvlab.quality.continuation import run_continuation
from kvlab.quality.items import ItemRun, run_item
from kvlab.quality.records import emit, quality_record, quality_run_id, reference_policy
from kvlab.quality.spec import CONTINUATION, TaskSpec, build_items
from kvlab.tasks import Encoder, TaskItem


def _cells(items: Iterable[TaskItem]) -> dict[tuple[str, int], list[TaskItem]]:
    cells: dict[tuple[str, int], list[TaskItem]] = {}
    for it in items:
        cells.setdefault((it.task, it.length), []).append(it)
    return cells


def run_quality(loaded, policies: Sequence, task_spec: TaskSpec | dict, out_writer=None,
                base: dict[str, Any] | None = None,
                progress: Callable[[str], None] | None = None,
                skip: Collection[str] = frozenset(), engine: Engine | None = None,
                progress_bar: bool = False) -> list[dict[str, Any]]:
    """Run every item of ``task_spec`` under every policy; return (and write) quality records.

    The full cache always runs as the reference (its records are emitted only if a ``full``
    policy is among ``policies``). Records of a (task, length) cell are written together once the
    cell is done, with ``no_signal`` set from the full cache's mean score. ``out_writer`` is a
    :class:`kvlab.records.RecordWriter` or any callable taking a record dict; ``base`` adds
    identity columns (e.g. ``sweep``); ``progress_bar`` shows a tqdm bar with an ETA over the
    (item, policy) runs.

    Resuming: records whose run id is in ``skip`` (those already written ok) are neither run nor
    written again; a cell with none left is skipped whole, and in a cell with some left only the
    full-cache reference reruns for the items already done (for the cell's mean score).
    ``engine`` (:func:`kvlab.engine.engines.make_engine`) decodes the greedy replies (default
    ``hf``; records say which).
    """
    engine = engine or make_engine("hf", loaded)
    spec = task_spec if isinstance(task_spec, TaskSpec) else TaskSpec(**task_spec)
    enc = Encoder(loaded.tokenizer)
    base = {**model_columns(loaded), "seed": spec.seed, **(base or {}), **engine_columns(engine.name)}
    policies = list(policies)
    reference = reference_policy(policies)
    with attached([*policies, reference], loaded.model):
        return _run_cells(loaded, policies, reference, spec, enc, base, out_writer, progress, skip, engine,
                          progress_bar)


def _run_cells(loaded, policies, reference, spec, enc, base, out_writer, progress, skip, engine,
               progress_bar) -> list[dict[str, Any]]:
    """:func:`run_quality`'s cells, with its policies attached to the model."""
    items = build_items(spec, enc, getattr(loaded.spec, "max_context", None))
    say = progress or (lambda _msg: None)
    records: list[dict[str, Any]] = []
    bar = tqdm(total=len(items) * len(policies), desc="quality", unit="run", disable=not progress_bar,
               dynamic_ncols=True)
    try:
        for (task, length), cell_items in _cells(items).items():
            todo = {id(item): [p for p in policies if quality_run_id(base, p, item, spec.query_aware) not in skip]
                    for item in cell_items}
            if not any(todo.values()):
                say(f"{task} L={length}: already recorded")
                bar.update(len(cell_items) * len(policies))
                continue
            cell: list[dict[str, Any]] = []
            full_scores: list[float] = []
            for item in cell_items:
                ref = run_item(loaded, reference, item, enc, engine, spec.query_aware)
                full_scores.append(item.score(ref.prediction))
                bar.update(len(policies) - len(todo[id(item)]))
                for policy in todo[id(item)]:
                    bar.set_postfix_str(f"{policy.label} {task} L={length}", refresh=False)
                    cell.append(_item_record(loaded, policy, item, enc, spec, base, ref, reference, engine))
                    bar.update(1)
                say(f"{task} L={length} depth={item.depth} sample={item.sample}: full={full_scores[-1]:.2f}")
            full_mean = sum(full_scores) / len(full_scores)
            for rec in cell:
                rec["no_signal"] = bool(full_mean < spec.no_signal_threshold)
                rec["full_score"] = full_mean
                emit(out_writer, rec)
            records += cell
    finally:
        bar.close()
    if CONTINUATION in spec.tasks:
        records += run_continuation(loaded, policies, spec, out_writer, base=base, progress=progress, skip=skip)
    return records


def _item_record(loaded, policy, item, enc, spec, base, ref: ItemRun, reference, engine) -> dict[str, Any]:
    try:
        run = ref if policy is reference else run_item(loaded, policy, item, enc, engine, spec.query_aware)
        fid = answer_span_fidelity(run.tf_logits, item.answer_ids, ref.tf_logits, item.answer_start)
        extra = {"prediction": run.prediction, "references": list(item.references),
                 "first_margin": fid["first_margin"], "new_tokens": len(run.generated), **run.cache}
        return quality_record(base, policy, item, query_aware=spec.query_aware,
                              score=item.score(run.prediction), fidelity=fid, extra=extra)
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as err:  # noqa: BLE001 - one failing policy must not lose the cell
        return quality_record(base, policy, item, query_aware=spec.query_aware, score=None, fidelity={},
                              status="failed", error=f"{type(err).__name__}: {err}")

