"""Needle-in-a-haystack tasks in the RULER style, on the noise haystack (no downloads).

A needle reads "One of the special magic numbers for {key} is: {value}." with an adjective-noun
key and a 7-digit value; the answer prefix repeats the question's wording so the model's reply
starts with the value. This is the format that a 135M model solves at 1k-8k tokens with the full
cache (see the reference notes); small wording changes swing its baseline from 100% to 0%.
"""

from __future__ import annotations

import random
from dataclasses import replace

from kvlab.tasks.prompt import Encoder, TaskError, TaskItem, assemble, check_depth, content_start
from kvlab.tasks.words import ADJECTIVES, NOISE_LINE, NOUNS


def random_keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct adjective-noun keys."""
    keys: list[str] = []
    while len(keys) < n:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in keys:
            keys.append(key)
    return keys


def random_numbers(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    """``n`` distinct ``digits``-digit numbers as text."""
    values: list[str] = []
    while len(values) < n:
        value = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if value not in values:
            values.append(value)
    return values


def needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _instruction(plural: bool) -> str:
    if plural:
        return ("Some special magic numbers are hidden within the following text. Make sure to memorize "
                "them. I will quiz you about the numbers afterwards.")
    return ("A special magic number is hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the number afterwards.")


def _check_count(name: str, value: int, least: int) -> int:
    if int(value) < least:
        raise TaskError(f"{name}={value}: use at least {least}")
    return int(value)


def niah_single(enc: Encoder, *, length: int, depth: float, sample: int, seed: int,
                max_new_tokens: int = 16) -> TaskItem:
    """One needle at ``depth``; the question asks for its value."""
    rng = random.Random(seed)
    depth = check_depth(depth)
    (key,), (value,) = random_keys(rng, 1), random_numbers(rng, 1)
    return assemble(
        enc, task="niah_single", length=length, depth=depth, sample=sample, seed=seed,
        instruction=_instruction(plural=False), filler_line=NOISE_LINE,
        needles=[(depth, needle(key, value))],
        question=f"What is the special magic number for {key} mentioned in the provided text?",
        answer_prefix=f"The special magic number for {key} mentioned in the provided text is",
        answer_text=f" {value}", references=[value], metric="string_match_all",
        max_new_tokens=max_new_tokens, meta={"key": key},
    )


def niah_multikey(enc: Encoder, *, length: int, depth: float, sample: int, seed: int,
                  num_distractors: int = 3, max_new_tokens: int = 16) -> TaskItem:
    """The queried needle at ``depth`` among distractor needles with other keys at random depths:
    tests whether a policy keeps the *right* needle, not just any salient number."""
    rng = random.Random(seed)
    depth = check_depth(depth)
    n = _check_count("num_distractors", num_distractors, 0) + 1
    keys, values = random_keys(rng, n), random_numbers(rng, n)
    needles = [(depth, needle(keys[0], values[0]))]
    needles += [(rng.random(), needle(k, v)) for k, v in zip(keys[1:], values[1:], strict=True)]
    return assemble(
        enc, task="niah_multikey", length=length, depth=depth, sample=sample, seed=seed,
        instruction=_instruction(plural=True), filler_line=NOISE_LINE, needles=needles,
        question=f"What is the special magic number for {keys[0]} mentioned in the provided text?",
        answer_prefix=f"The special magic number for {keys[0]} mentioned in the provided text is",
        answer_text=f" {values[0]}", references=[values[0]], metric="string_match_all",
        max_new_tokens=max_new_tokens, meta={"key": keys[0], "distractor_keys": keys[1:]},
    )


def niah_multivalue(enc: Encoder, *, length: int, depth: float, sample: int, seed: int,
                    num_values: int = 4, max_new_tokens: int = 48) -> TaskItem:
    """One key with ``num_values`` values: the first needle at ``depth``, the others at random
    depths; the score is the fraction of values recalled."""
    rng = random.Random(seed)
    depth = check_depth(depth)
    n = _check_count("num_values", num_values, 1)
    (key,), values = random_keys(rng, 1), random_numbers(rng, n)
    depths = [depth] + [rng.random() for _ in range(n - 1)]
    needles = [(d, needle(key, v)) for d, v in zip(depths, values, strict=True)]
    item = assemble(
        enc, task="niah_multivalue", length=length, depth=depth, sample=sample, seed=seed,
        instruction=_instruction(plural=True), filler_line=NOISE_LINE, needles=needles,
        question=f"What are all the special magic numbers for {key} mentioned in the provided text?",
        answer_prefix=f"The special magic numbers for {key} mentioned in the provided text are",
        answer_text=" " + ", ".join(values), references=values, metric="string_match_all",
        max_new_tokens=max_new_tokens, meta={"key": key},
    )
    # the teacher-forced gold lists the values in the order they appear in the text
    positions = item.meta["needle_token_positions"]
    in_text_order = [values[k] for k in sorted(range(n), key=lambda k: positions[k])]
    answer_ids = enc.encode(" " + ", ".join(in_text_order))
    return replace(item, answer_ids=answer_ids, answer_start=content_start(enc, answer_ids))
