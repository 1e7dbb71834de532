"""kvlab.repeats: alternated repeats (ABAB), with the call order known in advance."""

import pytest

from kvlab.repeats import alternate


def test_each_sampler_runs_once_per_round_in_order():
    calls = []

    def sampler(name):
        return lambda: calls.append(name) or float(len(calls))

    times = alternate({"a": sampler("a"), "b": sampler("b"), "c": sampler("c")}, rounds=3)
    assert calls == ["a", "b", "c"] * 3  # ABCABCABC, never AAABBBCCC
    assert times == {"a": [1.0, 4.0, 7.0], "b": [2.0, 5.0, 8.0], "c": [3.0, 6.0, 9.0]}


def test_a_drift_lands_on_every_sampler_alike():
    """A clock that slows by 1 ms per call: alternated, two identical kernels differ by one call's
    drift in every round; run in a row (AABB, 3 rounds each) the second would look 3 ms slower."""
    clock = iter(range(100))
    times = alternate({"a": lambda: 10.0 + next(clock), "b": lambda: 10.0 + next(clock)}, rounds=3)
    assert [b - a for a, b in zip(times["a"], times["b"], strict=True)] == [1.0, 1.0, 1.0]


def test_rounds_below_one_are_refused():
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        alternate({"a": lambda: 1.0}, rounds=0)
