"""Alternated repeats: every variant being compared is measured once per round, rounds repeated
(ABAB..., never AABB), so drift in clocks, temperature or host load lands on each variant alike.

The benchmarks time their variants through :func:`alternate`; a sampler is any callable returning
one measurement (a time, an energy).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def alternate(samplers: Mapping[K, Callable[[], float]], rounds: int) -> dict[K, list[float]]:
    """Each sampler called once per round, in the mapping's order, for ``rounds`` rounds; its
    measurements in call order."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, not {rounds}")
    out: dict[K, list[float]] = {key: [] for key in samplers}
    for _ in range(rounds):
        for key, sample in samplers.items():
            out[key].append(sample())
    return out
