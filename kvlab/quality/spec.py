"""What the quality pass runs (:class:`TaskSpec`, validated before any model work) and its items.

The pass runs task items under cache policies, scores them and compares them with the full cache.

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

from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvlab.schema import StrictModel
from kvlab.tasks import TASKS, Encoder, TaskItem, make_items, task_name
from kvlab.tasks.longbench import longbench_items
from kvlab.tasks.prompt import TaskError

CONTINUATION = "continuation"
QUALITY_COLUMNS = ("task", "length", "depth", "sample", "query_aware", "score", "gold_nll",
                   "first_token_acc", "kl", "top1_agree", "no_signal")


class TaskSpec(StrictModel):
    """What the quality pass runs; validated before any model work.

    ``tasks`` are generated task names and/or ``"continuation"``; ``longbench`` is a path to a
    user's LongBench jsonl file or folder (its datasets become tasks ``longbench/<dataset>``, cut
    to each of ``lengths``). ``depths`` are fractions in [0, 1]. ``samples`` is per
    (task, length, depth), or per (dataset, length) for LongBench and per length for continuation.
    """

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = Field(default_factory=lambda: ["niah_single"], json_schema_extra={"empty_ok": True})  # longbench alone
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
    text_files: list[str] = Field(default_factory=list, json_schema_extra={"empty_ok": True})
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

    @field_validator("longbench_datasets")
    @classmethod
    def _datasets_of_longbench(cls, datasets: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if datasets is not None and "longbench" in info.data and info.data["longbench"] is None:  # (a bad path: its own line)
            raise ValueError(f"{datasets} picks LongBench datasets, but no longbench path is given: add it, "
                             f"or drop the datasets")
        return datasets

    @field_validator("no_signal_threshold")
    @classmethod
    def _a_score(cls, threshold: float) -> float:
        if not 0 <= threshold <= 1:
            raise ValueError(f"{threshold}: a full-cache score in [0, 1] below which an item has no signal (default 0.7)")
        return threshold

    @field_validator("min_context_gain")
    @classmethod
    def _a_gain(cls, gain: float) -> float:
        if not gain >= 0:
            raise ValueError(f"{gain}: nats per token the full context must save, >= 0 (default 0.02)")
        return gain

    @model_validator(mode="after")
    def _something_to_run(self) -> TaskSpec:
        if not self.tasks and not self.longbench:
            raise ValueError("nothing to run: give tasks and/or a longbench path")
        unknown = set(self.task_params) - set(TASKS)
        if unknown:
            raise ValueError(f"task_params for unknown task(s) {sorted(unknown)}; tasks: {', '.join(TASKS)}")
        return self


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
        for length in spec.lengths:
            items += longbench_items(spec.longbench, enc, length, samples=spec.samples,
                                     datasets=spec.longbench_datasets, max_new_tokens=spec.max_new_tokens)
    if max_context:
        too_long = sorted({it.length for it in items if it.n_prompt_tokens + it.max_new_tokens > max_context})
        if too_long:
            raise TaskError(f"lengths {too_long} plus the generation budget exceed the model's context of "
                            f"{max_context} tokens; use shorter lengths")
    return items



def items_problem(spec: TaskSpec, tokenizer: Any, model: str) -> str | None:
    """Why ``spec``'s task items cannot be built with ``model``'s tokenizer (a length too short for
    the fixed parts, a tokenizer the tasks cannot use), or None: tokenizing only, so a sweep learns
    it before its first run rather than after the last."""
    try:
        build_items(spec, Encoder(tokenizer))
    except TaskError as err:
        return f"quality on {model}: {err}"
    return None
