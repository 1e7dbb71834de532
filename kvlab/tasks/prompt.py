"""Prompts as three token segments, with exact length control in the model's own tokens.

A task item is (context, question, answer prefix), as in RULER and kvpress: the context is what a
policy compresses, the question and answer prefix are run afterwards on the compressed cache. The
segments are rendered inside the model's chat template (when the tokenizer has one) and the answer
prefix follows the assistant header, so a small model starts its reply with the answer.

Lengths count the prompt tokens (context + question + answer prefix), exactly, like the perf
records' ``ctx``. (RULER also counts the generation budget; kvlab reports it separately.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from kvlab.errors import UserError
from kvlab.metrics import score_prediction

_MARK = "\u2063KVLAB_USER_CONTENT\u2063"


class TaskError(UserError):
    """Bad task name, length, depth or tokenizer; the message names the fix."""


@dataclass(frozen=True)
class ChatFrame:
    """The text a chat template puts before and after one user message (tail ends at the
    assistant header, where the answer prefix goes)."""

    head: str
    tail: str
    templated: bool


def chat_frame(tokenizer: Any, use_chat_template: bool = True) -> ChatFrame:
    """Split the tokenizer's chat template around a user message; a tokenizer without one gets a
    plain frame (the answer prefix on the line after the question)."""
    template = getattr(tokenizer, "chat_template", None)
    if not use_chat_template or not template:
        return ChatFrame(head="", tail="\n", templated=False)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(rendered, str) or rendered.count(_MARK) != 1:
        raise TaskError("the tokenizer's chat template did not render one user message; pass use_chat_template=False")
    head, tail = rendered.split(_MARK)
    return ChatFrame(head=head, tail=tail, templated=True)


class Encoder:
    """A tokenizer with memoised encoding and the chat frame: the one interface tasks use.

    Any object with ``encode(text, add_special_tokens=False)`` and ``decode(ids)`` works (tests use
    a byte-level toy); ``chat_template``/``apply_chat_template`` are used when present.
    """

    def __init__(self, tokenizer: Any, use_chat_template: bool = True):
        if tokenizer is None:
            raise TaskError(
                "quality tasks need a tokenizer, and synthetic-weight models have none: "
                "use a model with real weights (e.g. smollm2-135m or a local folder)"
            )
        self.tokenizer = tokenizer
        self.frame = chat_frame(tokenizer, use_chat_template)
        self._encode = lru_cache(maxsize=4096)(self._encode_uncached)
        self.newline_ids = self.encode("\n")

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> tuple[int, ...]:
        return self._encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def eos_ids(self) -> frozenset[int]:
        """Token ids that end a reply (EOS and the chat template's end-of-turn token)."""
        ids = set()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(i) for i in eos)
        return frozenset(ids)


@dataclass(frozen=True)
class TaskItem:
    """One prompt of one task, ready to run under any policy (every policy sees the same ids)."""

    task: str
    length: int
    depth: float | None
    sample: int
    seed: int
    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]
    answer_prefix_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    references: tuple[str, ...]
    metric: str
    max_new_tokens: int
    metric_kwargs: dict = field(default_factory=dict)
    first_line_only: bool = False
    answer_start: int = 0  # first answer token that is not whitespace (e.g. after a lone " ")
    meta: dict = field(default_factory=dict)

    @property
    def n_prompt_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids) + len(self.answer_prefix_ids)

    def score(self, prediction: str) -> float:
        """The task's metric for one prediction, in [0, 1]."""
        if self.first_line_only:
            prediction = prediction.lstrip("\n").split("\n")[0]
        return score_prediction(self.metric, prediction, list(self.references), **self.metric_kwargs)


def content_start(enc: Encoder, ids: tuple[int, ...]) -> int:
    """Index of the first token that decodes to more than whitespace: first-answer-token
    accuracy is measured there, since many tokenizers split " 1234567" into " " + digits."""
    return next((i for i, t in enumerate(ids) if enc.decode([t]).strip()), 0)


def item_seed(base_seed: int, task: str, length: int, depth: float | None, sample: int) -> int:
    """A stable seed per (task, length, depth, sample): the same prompt in every run and method
    (Python's ``hash`` of a str changes between processes, so it is not used)."""
    text = f"{base_seed}|{task}|{length}|{depth!r}|{sample}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def check_depth(depth: float) -> float:
    depth = float(depth)
    if not 0.0 <= depth <= 1.0:
        raise TaskError(f"depth {depth} is outside [0, 1]: give the needle depth as a fraction (0.5 = middle)")
    return depth


def fill_lines(enc: Encoder, line: str, budget: int) -> list[tuple[int, ...]]:
    """Noise lines totalling exactly ``budget`` tokens: whole copies of ``line + "\\n"`` as the
    tokenizer encodes them (its last token may merge the newline with the full stop, as Qwen2's and
    Llama-3's BPE do with ".\\n"), then one copy cut short and closed with the newline's own
    tokens for the remainder (cut without a newline when the remainder is shorter than those)."""
    if budget < 0:
        raise TaskError(f"internal: negative haystack budget {budget}")
    if not enc.newline_ids:
        raise TaskError("this tokenizer encodes a newline as no token at all, so the haystack's lines cannot "
                        "be told apart; use a tokenizer that keeps whitespace")
    full = enc.encode(line + "\n")
    newline = enc.newline_ids
    lines = [full] * (budget // len(full))
    rest = budget - len(full) * len(lines)
    if rest:
        lines.append(full[: rest - len(newline)] + newline if rest >= len(newline) else full[:rest])
    return lines


def depth_slot(n_lines: int, depth: float) -> int:
    """Line index for a needle at ``depth`` (0 = before the first haystack line, 1 = after the last)."""
    return round(check_depth(depth) * n_lines)


def assemble(
    enc: Encoder,
    *,
    task: str,
    length: int,
    depth: float | None,
    sample: int,
    seed: int,
    instruction: str,
    filler_line: str,
    needles: list[tuple[float, str]],
    question: str,
    answer_prefix: str,
    answer_text: str,
    references: list[str],
    metric: str,
    max_new_tokens: int,
    meta: dict | None = None,
) -> TaskItem:
    """Build a haystack prompt of exactly ``length`` tokens.

    ``needles`` are (depth, sentence) pairs placed between haystack lines in list order; among
    needles at the same line the order is kept. The noise fills whatever the fixed parts leave.
    """
    frame = enc.frame
    context_head = enc.encode(frame.head + instruction + "\n\n")
    question_ids = enc.encode("\n" + question + frame.tail)
    answer_prefix_ids = enc.encode(answer_prefix)
    needle_ids = [enc.encode(sentence + "\n") for _, sentence in needles]
    fixed = len(context_head) + len(question_ids) + len(answer_prefix_ids) + sum(map(len, needle_ids))
    if length < fixed:
        raise TaskError(
            f"length {length} is too short for task {task!r}: its fixed parts alone take {fixed} tokens "
            f"with this tokenizer; use a length of at least {fixed}"
        )
    lines: list[tuple[int, tuple[int, ...]]] = [(-1, ids) for ids in fill_lines(enc, filler_line, length - fixed)]
    n_noise = len(lines)
    slots = [depth_slot(n_noise, d) for d, _ in needles]
    # insert from the back so earlier slot indices stay valid; equal slots keep the list order
    for k in sorted(range(len(needles)), key=lambda k: (slots[k], k), reverse=True):
        lines.insert(slots[k], (k, needle_ids[k]))
    # token offset of each needle inside the context (depth in tokens, for diagnostics)
    offsets = [0] * len(needles)
    pos = len(context_head)
    for k, ids in lines:
        if k >= 0:
            offsets[k] = pos
        pos += len(ids)
    context_ids = context_head + tuple(tok for _, ids in lines for tok in ids)
    answer_ids = enc.encode(answer_text)
    item_meta = {"needle_token_positions": offsets, "haystack_lines": n_noise}
    item_meta.update(meta or {})
    item = TaskItem(
        task=task,
        length=length,
        depth=depth,
        sample=sample,
        seed=seed,
        context_ids=context_ids,
        question_ids=question_ids,
        answer_prefix_ids=answer_prefix_ids,
        answer_ids=answer_ids,
        references=tuple(references),
        metric=metric,
        max_new_tokens=max_new_tokens,
        answer_start=content_start(enc, answer_ids),
        meta=item_meta,
    )
    if item.n_prompt_tokens != length:  # a bug, not bad input: fail loudly
        raise TaskError(f"internal: built {item.n_prompt_tokens} tokens for length {length}")
    return item
