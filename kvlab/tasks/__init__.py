"""Offline quality tasks: generated retrieval prompts and user-provided LongBench files.

Every generated item is seeded by (base seed, task, length, depth, sample), so every method and
every run sees identical token ids, and methods can be compared paired.

    enc = Encoder(loaded.tokenizer)
    items = make_items("niah_single", enc, lengths=[1024, 2048], depths=[0.1, 0.5, 0.9], samples=2)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvlab.tasks.prompt import Encoder, TaskError, TaskItem, chat_frame, item_seed
from kvlab.tasks.retrieval import niah_multikey, niah_multivalue, niah_single
from kvlab.tasks.variable_tracking import variable_tracking

# name -> builder(enc, *, length, depth, sample, seed, **params) -> TaskItem
TASKS: dict[str, Callable[..., TaskItem]] = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "variable_tracking": variable_tracking,
}
ALIASES = {"vt": "variable_tracking", "niah": "niah_single"}

__all__ = ["ALIASES", "Encoder", "TASKS", "TaskError", "TaskItem", "chat_frame", "item_seed",
           "make_item", "make_items", "task_name"]


def task_name(name: str) -> str:
    """The registry name of a task (accepts the aliases ``vt`` and ``niah``)."""
    name = ALIASES.get(name, name)
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; tasks: {', '.join(TASKS)} (LongBench files: use --longbench PATH)")
    return name


def _encoder(tokenizer_or_encoder: Any) -> Encoder:
    if isinstance(tokenizer_or_encoder, Encoder):
        return tokenizer_or_encoder
    return Encoder(tokenizer_or_encoder)


def make_item(task: str, tokenizer: Any, length: int, depth: float = 0.5, sample: int = 0,
              base_seed: int = 0, **params) -> TaskItem:
    """One seeded item of ``task`` with exactly ``length`` prompt tokens."""
    name = task_name(task)
    if int(length) <= 0:
        raise TaskError(f"length {length}: give a positive number of prompt tokens")
    seed = item_seed(base_seed, name, int(length), float(depth), int(sample))
    try:
        return TASKS[name](_encoder(tokenizer), length=int(length), depth=float(depth), sample=int(sample),
                           seed=seed, **params)
    except TypeError as err:
        if "unexpected keyword" in str(err):
            raise TaskError(f"task {name!r}: {err}") from None
        raise


def make_items(task: str, tokenizer: Any, lengths: Iterable[int], depths: Iterable[float] = (0.5,),
               samples: int = 1, base_seed: int = 0, **params) -> list[TaskItem]:
    """The full (length x depth x sample) grid of one task, in a fixed order."""
    enc = _encoder(tokenizer)
    return [make_item(task, enc, length, depth, sample, base_seed, **params)
            for length in lengths for depth in depths for sample in range(int(samples))]
