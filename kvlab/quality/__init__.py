"""The quality pass: run task items under cache policies, score them, compare them with the full cache.

- :mod:`~kvlab.quality.spec`: what a pass runs (``TaskSpec``) and its items;
- :mod:`~kvlab.quality.items`: one item under one policy (prefill, question, reply, teacher forcing);
- :mod:`~kvlab.quality.records`: record ids and columns, the full-cache reference;
- :mod:`~kvlab.quality.run`: the pass (``run_quality``);
- :mod:`~kvlab.quality.continuation`: the continuation task;
- :mod:`~kvlab.quality.notes`: what a score means (notes, paired summaries).

This package stays light (params validation reads ``TaskSpec``); ``run_quality`` loads torch and is
imported on first use.
"""

from __future__ import annotations

from typing import Any

from kvlab.quality.notes import quality_notes, summarize
from kvlab.quality.spec import TaskSpec


def __getattr__(name: str) -> Any:
    if name == "run_quality":  # the pass imports torch: not before a caller needs it
        from kvlab.quality.run import run_quality

        return run_quality
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TaskSpec", "quality_notes", "run_quality", "summarize"]
