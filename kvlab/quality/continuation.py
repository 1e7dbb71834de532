"""Continuation fidelity (the "continuation" task): split a long text into a context and a
continuation, compress the context, teacher-force the continuation, and report its NLL against the
full cache and no context at all, as "context utility retained" U."""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvlab.columns import model_columns
from kvlab.engine.generation import forward_at, prefill_ids
from kvlab.metrics import context_utility, kl_per_position, mean_token_nll
from kvlab.quality.records import emit, quality_record, quality_run_id, reference_policy
from kvlab.quality.spec import CONTINUATION, TaskSpec
from kvlab.tasks import Encoder, TaskItem
from kvlab.tasks.prompt import TaskError, item_seed


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
        return forward_at(model, cont[:-1], DynamicCache(), 0)
    cache = policy.make_cache(model)
    prefill_ids(model, item.context_ids, cache, policy.prefill_chunk)
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
    spec = task_spec if isinstance(task_spec, TaskSpec) else TaskSpec(**task_spec)
    enc = Encoder(loaded.tokenizer)
    base = base if base is not None else {**model_columns(loaded), "seed": spec.seed}
    reference = reference_policy(policies)
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
            emit(out_writer, rec)
        records += cell
    return records


def _tensor(ids):
    return torch.as_tensor(list(ids), dtype=torch.long)


def _continuation_task_item(it: ContinuationItem) -> TaskItem:
    return TaskItem(task=CONTINUATION, length=it.length, depth=None, sample=it.sample,
                    seed=item_seed(0, f"{CONTINUATION}:{it.source}", it.length, None, it.sample) ^ it.offset,
                    context_ids=it.context_ids, question_ids=(), answer_prefix_ids=(),
                    answer_ids=it.continuation_ids[1:], references=(), metric="continuation_utility",
                    max_new_tokens=0)
