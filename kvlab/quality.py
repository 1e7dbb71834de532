"""The quality pass: run task items under cache policies, score them, compare them with the full cache.

Protocol (RULER/kvpress): the context is prefilled through the policy's cache (a policy evicts only
at the end of that first forward), then the question and answer prefix go through as a second
forward on the compressed cache, then greedy decoding. ``query_aware=True`` puts the question in
the compressed prefill instead, which favours SnapKV-like methods.

Every item is also scored teacher-forced on its gold answer, against the full cache on the same
tokens: gold NLL, first-answer-token accuracy, KL(full || compressed) and top-1 agreement. These
have signal where a small model fails a task in free generation. A (task, length) cell whose
full-cache score is below ``no_signal_threshold`` is marked ``no_signal`` in its records, so
reports leave its *score* out of averages instead of averaging noise (its fidelity metrics stay
meaningful: they compare with the full cache, not with the gold).

Continuation fidelity ("continuation" task): split a long text into a context and a continuation,
compress the context, teacher-force the continuation, and report its NLL against the full cache
and no context at all, as "context utility retained" U.
"""

from __future__ import annotations

import copy
import math
import random
import sys
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvlab.columns import engine_columns, model_columns, policy_columns
from kvlab.metrics import (
    answer_span_fidelity,
    bootstrap_ci,
    context_utility,
    kl_per_position,
    mean_token_nll,
    paired_difference,
)
from kvlab.tasks import TASKS, Encoder, TaskItem, make_items, task_name
from kvlab.tasks.prompt import TaskError, item_seed

CONTINUATION = "continuation"
QUALITY_COLUMNS = ("task", "length", "depth", "sample", "query_aware", "score", "gold_nll",
                   "first_token_acc", "kl", "top1_agree", "no_signal")


class TaskSpec(BaseModel):
    """What the quality pass runs; validated before any model work.

    ``tasks`` are generated task names and/or ``"continuation"``; ``longbench`` is a path to a
    user's LongBench jsonl file or folder (its datasets become tasks ``longbench/<dataset>``, cut
    to each of ``lengths``). ``depths`` are fractions in [0, 1]. ``samples`` is per
    (task, length, depth), or per (dataset, length) for LongBench and per length for continuation.
    """

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = Field(default_factory=lambda: ["niah_single"])
    lengths: list[int] = Field(default_factory=lambda: [1024, 2048])
    depths: list[float] = Field(default_factory=lambda: [0.1, 0.5, 0.9])
    samples: int = 2
    seed: int = 0
    query_aware: bool = False
    no_signal_threshold: float = 0.7
    max_new_tokens: int | None = None
    task_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    longbench: str | None = None
    longbench_datasets: list[str] | None = None
    text_files: list[str] = Field(default_factory=list)
    continuation_tokens: int = 256
    min_context_gain: float = 0.02  # nats/token the full context must save for continuation signal

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: list[str]) -> list[str]:
        return [t if t == CONTINUATION else task_name(t) for t in tasks]

    @field_validator("lengths")
    @classmethod
    def _positive_lengths(cls, lengths: list[int]) -> list[int]:
        if not lengths or any(n <= 0 for n in lengths):
            raise ValueError(f"lengths {lengths}: give one or more positive token counts")
        return lengths

    @field_validator("depths")
    @classmethod
    def _fraction_depths(cls, depths: list[float]) -> list[float]:
        if not depths or any(not 0 <= d <= 1 for d in depths):
            raise ValueError(f"depths {depths}: give fractions in [0, 1] (0.5 = middle of the context)")
        return depths

    @field_validator("samples", "continuation_tokens")
    @classmethod
    def _at_least_one(cls, n: int) -> int:
        if n < 1:
            raise ValueError(f"{n}: use at least 1")
        return n

    @field_validator("max_new_tokens")
    @classmethod
    def _positive_new_tokens(cls, n: int | None) -> int | None:
        if n is not None and n < 1:
            raise ValueError(f"max_new_tokens={n}: use at least 1 (or leave it unset for the task default)")
        return n

    @field_validator("text_files")
    @classmethod
    def _files_exist(cls, files: list[str]) -> list[str]:
        missing = [f for f in files if not Path(f).is_file()]
        if missing:
            raise ValueError(f"text file(s) not found: {', '.join(missing)}")
        return files

    @field_validator("longbench")
    @classmethod
    def _longbench_exists(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).exists():
            raise ValueError(f"longbench path {path} does not exist: pass a LongBench jsonl file or folder")
        return path

    @model_validator(mode="after")
    def _something_to_run(self) -> TaskSpec:
        if not self.tasks and not self.longbench:
            raise ValueError("nothing to run: give tasks and/or a longbench path")
        unknown = set(self.task_params) - set(TASKS)
        if unknown:
            raise ValueError(f"task_params for unknown task(s) {sorted(unknown)}; tasks: {', '.join(TASKS)}")
        return self


# ------------------------------------------------------------------ forward passes


def forward_at(model, ids: Sequence[int], cache, start: int):
    """Forward ``ids`` through ``cache`` at logical positions ``start, start+1, ...``; returns
    logits [len(ids), V] (float32, CPU). ``kvlab.decode.prefill`` takes the positions from the
    cache's logical length; checking it against ``start`` catches a cache that reports its
    physical length after eviction (which would shift every later position)."""
    import torch

    from kvlab.decode import prefill

    seen = cache.get_seq_length()
    if seen != start:
        raise RuntimeError(f"the cache reports {seen} tokens seen, expected {start}: its get_seq_length() "
                           f"must count every token, evicted or not")
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = prefill(model, input_ids, cache, logits_to_keep=0)
    return logits[0].float().cpu()


def fork_cache(cache, model):
    """A deep copy of ``cache`` that shares the model's modules and weights (a policy's cache may
    hold references to them); ``None`` when the cache cannot be copied."""
    memo: dict[int, Any] = {id(model): model}
    for module in model.modules():
        memo[id(module)] = module
    for tensor in list(model.parameters()) + list(model.buffers()):
        memo[id(tensor)] = tensor
    try:
        return copy.deepcopy(cache, memo)
    except Exception:  # noqa: BLE001 - any failure means "re-prefill instead"
        return None


def _prefill(model, ids: Sequence[int], cache, chunk: int | None = None) -> None:
    import torch

    from kvlab.chunked import prefill

    device = next(model.parameters()).device
    with torch.inference_mode():
        prefill(model, torch.tensor([list(ids)], dtype=torch.long, device=device), cache, chunk)


def _greedy(model, cache, first_token: int, n_new: int, start: int) -> list[int]:
    """``n_new`` greedy tokens in all, ``first_token`` (at position ``start``) included."""
    import torch

    from kvlab.decode import greedy_decode

    device = next(model.parameters()).device
    first = torch.tensor([[first_token]], dtype=torch.long, device=device)
    with torch.inference_mode():
        tokens = greedy_decode(model, cache, first, max(1, n_new), start_position=start)
    return [int(t) for t in tokens[0].tolist()]


def _fast_greedy(engine, policy, cache, first_token: int, n_new: int, start: int):
    """``n_new`` greedy tokens from the fast engine's decoder for this prefilled cache, and its stats."""
    import torch

    decoder = engine.decoder_for_cache(policy, cache, n_new)
    decoder.load(cache)
    stats = {f"cache_{k}": v for k, v in decoder.stats().items()}
    first = torch.tensor([first_token], dtype=torch.long, device=decoder.device)
    with torch.inference_mode():
        tokens = decoder.decode(first, n_new, start)
    return [int(t) for t in tokens[0].tolist()], stats


def _cache_stats(cache) -> dict[str, Any]:
    try:
        from kvlab.policies import cache_stats
    except ImportError:
        return {}
    try:
        stats = cache_stats(cache)
    except Exception:  # noqa: BLE001 - stats are informative only
        return {}
    return {f"cache_{k}": v for k, v in stats.items()}


# ------------------------------------------------------------------ one item under one policy


@dataclass
class ItemRun:
    """What one policy did on one item: the greedy reply and the teacher-forced answer logits."""

    generated: list[int]
    prediction: str
    tf_logits: Any  # [len(answer_ids), V] float32
    cache: dict[str, Any] = field(default_factory=dict)


def _segments(item: TaskItem, query_aware: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if query_aware:
        return item.context_ids + item.question_ids, item.answer_prefix_ids
    return item.context_ids, item.question_ids + item.answer_prefix_ids


def run_item(loaded, policy, item: TaskItem, enc: Encoder, query_aware: bool = False,
             max_new_tokens: int | None = None, engine=None) -> ItemRun:
    """Prefill the compressed part, forward the rest, decode greedily and teacher-force the gold.

    The cache is forked after the second forward, so the teacher-forced pass and the greedy
    reply see the same compressed state; a cache that cannot be copied is rebuilt by a second
    prefill (same result, more time). With a fast ``engine`` (:class:`kvlab.engine.fast.FastEngine`)
    the greedy reply comes from its decode loop and store; the teacher-forced pass stays on
    transformers' forward through the policy's own cache.
    """
    import torch

    model = loaded.model
    first, second = _segments(item, query_aware)
    if not second:
        raise TaskError(f"item {item.task}: nothing after the compressed part; the answer prefix is empty")
    cache = (policy.fast_storage()[0] if engine is not None else policy).make_cache(model)
    _prefill(model, first, cache, policy.prefill_chunk)
    stats = _cache_stats(cache)
    logits = forward_at(model, second, cache, len(first))
    start = len(first) + len(second)
    answer = list(item.answer_ids)
    tf_cache = fork_cache(cache, model) if len(answer) > 1 and engine is None else None
    last = logits[-1]
    first_token = int(last.argmax())
    n_new = max_new_tokens or item.max_new_tokens
    if engine is None:
        generated = _greedy(model, cache, first_token, n_new, start)
    else:
        generated, stats = _fast_greedy(engine, policy, cache, first_token, max(1, n_new), start)
    if len(answer) > 1:
        if tf_cache is None:  # rebuild the same compressed state
            tf_cache = policy.make_cache(model)
            _prefill(model, first, tf_cache, policy.prefill_chunk)
            forward_at(model, second, tf_cache, len(first))
        rest = forward_at(model, answer[:-1], tf_cache, start)
        tf_logits = torch.cat([last[None], rest], dim=0)
    else:
        tf_logits = last[None]
    return ItemRun(
        generated=generated,
        prediction=reply_text(enc, generated),
        tf_logits=tf_logits,
        cache=stats,
    )


def reply_text(enc: Encoder, generated: Sequence[int]) -> str:
    """The reply up to the first end-of-turn token (decoding ignores EOS; scoring must not)."""
    eos = enc.eos_ids
    cut = next((i for i, t in enumerate(generated) if t in eos), len(generated))
    return enc.decode(generated[:cut])


# ------------------------------------------------------------------ records


def _item_key(item: TaskItem, query_aware: bool) -> dict[str, Any]:
    return {"task": item.task, "length": item.length, "depth": item.depth, "sample": item.sample,
            "query_aware": bool(query_aware)}


def quality_run_id(base: dict[str, Any], policy, item: TaskItem, query_aware: bool) -> str:
    """The stable id of one (model, policy, item) quality record, known before it runs: a resumed
    pass skips the items whose records are already written."""
    from kvlab.records import make_run_id

    pcols = policy_columns(policy)
    engine = {"engine": base["engine"]} if base.get("engine", "hf") != "hf" else {}  # hf ids as before
    return make_run_id({"kind": "quality", "model": base.get("model"), "sweep": base.get("sweep"),
                        "method": pcols["method"], "policy_params": pcols["policy_params"],
                        "item_seed": item.seed, **_item_key(item, query_aware), **engine}, 0)


def quality_record(base: dict[str, Any], policy, item: TaskItem, *, query_aware: bool,
                   score: float | None, fidelity: dict[str, Any], extra: dict[str, Any] | None = None,
                   status: str = "ok", error: str | None = None) -> dict[str, Any]:
    """One quality record: identity columns, the item's key, its score and fidelity metrics.

    ``run_id`` hashes everything that identifies the measurement, so a re-run of the same
    (model, policy, item) replaces rather than duplicates it in ``load_records``.
    """
    from kvlab.records import utc_now

    pcols = policy_columns(policy)
    key = _item_key(item, query_aware)
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


def _emit(writer, record: dict[str, Any]) -> None:
    if writer is None:
        return
    if hasattr(writer, "append"):
        writer.append(record)
    else:
        writer(record)


# ------------------------------------------------------------------ the pass


def _is_full(policy) -> bool:
    return policy.name == "full" and getattr(policy, "prefill_chunk", None) is None


def build_items(spec: TaskSpec, enc: Encoder, max_context: int | None = None) -> list[TaskItem]:
    """All generated and LongBench items of ``spec``, in a fixed order (continuation excluded)."""
    items: list[TaskItem] = []
    for task in spec.tasks:
        if task == CONTINUATION:
            continue
        params = dict(spec.task_params.get(task, {}))
        if spec.max_new_tokens:
            params["max_new_tokens"] = spec.max_new_tokens
        items += make_items(task, enc, spec.lengths, spec.depths, spec.samples, spec.seed, **params)
    if spec.longbench:
        from kvlab.tasks.longbench import longbench_items

        for length in spec.lengths:
            items += longbench_items(spec.longbench, enc, length, samples=spec.samples,
                                     datasets=spec.longbench_datasets, max_new_tokens=spec.max_new_tokens)
    if max_context:
        too_long = sorted({it.length for it in items if it.n_prompt_tokens + it.max_new_tokens > max_context})
        if too_long:
            raise TaskError(f"lengths {too_long} plus the generation budget exceed the model's context of "
                            f"{max_context} tokens; use shorter lengths")
    return items


def _cells(items: Iterable[TaskItem]) -> dict[tuple[str, int], list[TaskItem]]:
    cells: dict[tuple[str, int], list[TaskItem]] = {}
    for it in items:
        cells.setdefault((it.task, it.length), []).append(it)
    return cells


def run_quality(loaded, policies: Sequence, task_spec: TaskSpec | dict, out_writer=None,
                base: dict[str, Any] | None = None,
                progress: Callable[[str], None] | None = None,
                skip: Collection[str] = frozenset(), engine=None,
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
    ``engine``: a fast engine for the greedy replies (records say ``engine: fast``).
    """
    from kvlab.policies import make_policy
    from kvlab.policies.base import attached

    spec = task_spec if isinstance(task_spec, TaskSpec) else TaskSpec(**task_spec)
    enc = Encoder(loaded.tokenizer)
    base = {**model_columns(loaded), "seed": spec.seed, **(base or {}), **engine_columns(engine)}
    policies = list(policies)
    reference = next((p for p in policies if _is_full(p)), None) or make_policy("full")
    with attached([*policies, reference], loaded.model):
        return _run_cells(loaded, policies, reference, spec, enc, base, out_writer, progress, skip, engine,
                          progress_bar)


def _run_cells(loaded, policies, reference, spec, enc, base, out_writer, progress, skip, engine,
               progress_bar) -> list[dict[str, Any]]:
    """:func:`run_quality`'s cells, with its policies attached to the model."""
    from tqdm.auto import tqdm

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
                ref = run_item(loaded, reference, item, enc, spec.query_aware, engine=engine)
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
                _emit(out_writer, rec)
            records += cell
    finally:
        bar.close()
    if CONTINUATION in spec.tasks:
        records += run_continuation(loaded, policies, spec, out_writer, base=base, progress=progress, skip=skip)
    return records


def _item_record(loaded, policy, item, enc, spec, base, ref: ItemRun, reference, engine=None) -> dict[str, Any]:
    try:
        run = ref if policy is reference else run_item(loaded, policy, item, enc, spec.query_aware, engine=engine)
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


# ------------------------------------------------------------------ continuation fidelity


def stdlib_text() -> tuple[str, str]:
    """Long English text that ships with Python: the pydoc topic pages, else the license text,
    else the standard library's module docstrings. Returns (text, source name)."""
    try:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics"
    except ImportError:
        pass
    import sysconfig

    license_path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if license_path.is_file():
        return license_path.read_text(encoding="utf-8", errors="replace"), str(license_path)
    import importlib

    docs = []
    for name in sorted(sys.stdlib_module_names):
        try:
            doc = importlib.import_module(name).__doc__
        except Exception:  # noqa: BLE001 - some stdlib modules do not import everywhere
            continue
        if doc:
            docs.append(doc)
    return "\n\n".join(docs), "stdlib docstrings"


@dataclass(frozen=True)
class ContinuationItem:
    """A context window of a long text and the continuation that follows it."""

    source: str
    length: int
    sample: int
    offset: int
    context_ids: tuple[int, ...]
    continuation_ids: tuple[int, ...]


def continuation_items(enc: Encoder, lengths: Sequence[int], samples: int, continuation_tokens: int = 256,
                       text_files: Sequence[str] = (), seed: int = 0) -> list[ContinuationItem]:
    """Seeded windows: for each length, ``samples`` (context, continuation) pairs from the user's
    text files (joined), else from text that ships with Python."""
    if text_files:
        text = "\n\n".join(Path(f).read_text(encoding="utf-8", errors="replace") for f in text_files)
        source = ",".join(Path(f).name for f in text_files)
    else:
        text, source = stdlib_text()
    ids = enc.encode(text)
    items = []
    for length in lengths:
        span = length + continuation_tokens
        if span > len(ids):
            raise TaskError(f"the text ({source}) has {len(ids)} tokens, fewer than context {length} + "
                            f"continuation {continuation_tokens}; give longer text files or shorter lengths")
        for s in range(samples):
            rng = random.Random(item_seed(seed, CONTINUATION, length, None, s))
            off = rng.randrange(0, len(ids) - span + 1)
            items.append(ContinuationItem(source, length, s, off, ids[off:off + length],
                                          ids[off + length:off + span]))
    return items


def continuation_logits(loaded, policy, item: ContinuationItem):
    """Logits [C-1, V] for continuation tokens 1..C-1 after prefilling the context through the
    policy's cache (or no context at all when ``policy`` is None)."""
    model = loaded.model
    cont = item.continuation_ids
    if policy is None:
        from transformers import DynamicCache

        return forward_at(model, cont[:-1], DynamicCache(), 0)
    cache = policy.make_cache(model)
    _prefill(model, item.context_ids, cache, policy.prefill_chunk)
    return forward_at(model, cont[:-1], cache, len(item.context_ids))


def run_continuation(loaded, policies: Sequence, task_spec: TaskSpec | dict, out_writer=None,
                     base: dict[str, Any] | None = None,
                     progress: Callable[[str], None] | None = None,
                     skip: Collection[str] = frozenset()) -> list[dict[str, Any]]:
    """Compressed-prefix continuation NLL, KL to the full cache and U, per policy and window.

    ``score`` is U (1 = the compressed context is as useful as the full one). A length whose
    full context saves less than ``min_context_gain`` nats/token over no context is ``no_signal``.
    ``skip`` holds run ids already recorded, as in :func:`run_quality`.
    """
    from kvlab.policies import make_policy

    spec = task_spec if isinstance(task_spec, TaskSpec) else TaskSpec(**task_spec)
    enc = Encoder(loaded.tokenizer)
    base = base if base is not None else {**model_columns(loaded), "seed": spec.seed}
    reference = next((p for p in policies if _is_full(p)), None) or make_policy("full")
    for p in policies:  # idempotent; run_continuation may be called on its own
        p.check(loaded.model)
        p.prepare(loaded.model)
    items = continuation_items(enc, spec.lengths, spec.samples, spec.continuation_tokens,
                               spec.text_files, spec.seed)
    say = progress or (lambda _msg: None)
    records: list[dict[str, Any]] = []
    for length in spec.lengths:
        cell, gains = [], []
        windows = [i for i in items if i.length == length]
        todo = {id(it): [p for p in policies
                         if quality_run_id(base, p, _continuation_task_item(it), False) not in skip]
                for it in windows}
        if not any(todo.values()):
            say(f"continuation L={length}: already recorded")
            continue
        for it in windows:
            target = it.continuation_ids[1:]
            full = continuation_logits(loaded, reference, it)
            none_nll = mean_token_nll(continuation_logits(loaded, None, it), target)
            full_nll = mean_token_nll(full, target)
            gains.append(none_nll - full_nll)
            task_item = _continuation_task_item(it)
            for policy in todo[id(it)]:
                try:
                    logits = full if policy is reference else continuation_logits(loaded, policy, it)
                    nll = mean_token_nll(logits, target)
                    logp, logq = (t.log_softmax(-1) for t in (full, logits))
                    fid = {"gold_nll": nll * len(target), "first_token_acc": None,
                           "tf_token_acc": float((logq.argmax(-1) == _tensor(target)).float().mean()),
                           "kl": float(kl_per_position(logp, logq).mean()),
                           "top1_agree": float((logp.argmax(-1) == logq.argmax(-1)).float().mean())}
                    extra = {"cont_nll": nll, "cont_nll_full": full_nll, "cont_nll_none": none_nll,
                             "ppl": math.exp(nll), "text_source": it.source, "text_offset": it.offset}
                    cell.append(quality_record(base, policy, task_item, query_aware=False,
                                               score=context_utility(none_nll, nll, full_nll),
                                               fidelity=fid, extra=extra))
                except (KeyboardInterrupt, MemoryError):
                    raise
                except Exception as err:  # noqa: BLE001
                    cell.append(quality_record(base, policy, task_item, query_aware=False, score=None,
                                               fidelity={}, status="failed", error=f"{type(err).__name__}: {err}"))
            say(f"continuation L={length} sample={it.sample}: full NLL {full_nll:.3f}, none {none_nll:.3f}")
        mean_gain = sum(gains) / len(gains)
        for rec in cell:
            rec["no_signal"] = bool(not mean_gain >= spec.min_context_gain)
            rec["context_gain"] = mean_gain
            _emit(out_writer, rec)
        records += cell
    return records


def _tensor(ids):
    import torch

    return torch.as_tensor(list(ids), dtype=torch.long)


def _continuation_task_item(it: ContinuationItem) -> TaskItem:
    return TaskItem(task=CONTINUATION, length=it.length, depth=None, sample=it.sample,
                    seed=item_seed(0, f"{CONTINUATION}:{it.source}", it.length, None, it.sample) ^ it.offset,
                    context_ids=it.context_ids, question_ids=(), answer_prefix_ids=(),
                    answer_ids=it.continuation_ids[1:], references=(), metric="continuation_utility",
                    max_new_tokens=0)


# ------------------------------------------------------------------ what a score means


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
    import pandas as pd

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
    """Per (task, length, method/label) means with bootstrap CIs and paired differences against
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
                row[m], row[f"{m}_lo"], row[f"{m}_hi"] = bootstrap_ci(vals, n_boot, ci, seed)
                if not full.empty and label != "full":
                    common = indexed.index.intersection(full.index)
                    a = pd.to_numeric(indexed.loc[common, m], errors="coerce").tolist()
                    b = pd.to_numeric(full.loc[common, m], errors="coerce").tolist()
                    d = paired_difference(a, b, n_boot, ci, seed)
                    row[f"{m}_diff"], row[f"{m}_diff_lo"], row[f"{m}_diff_hi"] = d["diff"], d["diff_lo"], d["diff_hi"]
            rows.append(row)
    return pd.DataFrame(rows)
