"""The column groups every record shares, built in one place.

A sweep's perf record, a quality record and ``kvlab generate``'s JSON describe the same things the
same way: which model (and its provenance), which policy, which engine. Each group is a pure
function of the object it describes; callers add their own identity and measured columns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvlab.card import device_card


def model_columns(loaded, gpu: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Provenance of the loaded model (weights, dtype, device, ...), its card (:func:`kvlab.card.device_card`:
    ``cpu``, or the GPU's name, UUID, driver, power limit and maximum clocks; ``gpu``: a sampler's
    NVML facts, read instead of asking NVML again) and its attention."""
    return {**loaded.provenance(), **device_card(loaded.device, gpu=gpu),
            "attn_implementation": getattr(loaded.model.config, "_attn_implementation", None)}


def policy_columns(policy, engine: str = "hf") -> dict[str, Any]:
    """Method, label and parameters of a cache policy (``prefill_chunk``: None for a one-shot prefill).
    The label names what ran on ``engine`` (:meth:`kvlab.policies.base.Policy.engine_label`: on fast,
    quanto int4 is 'kvq int4-g64 (asked: quanto int4)'); ``method`` and the parameters are as asked."""
    return {"method": policy.name, "label": policy.engine_label(engine), "policy_params": dict(policy.params()),
            "keep": policy.keep, "bits": policy.bits, "prefill_chunk": getattr(policy, "prefill_chunk", None)}


def engine_columns(engine: str, prefill_rows: int | None = None) -> dict[str, Any]:
    """``engine`` (``hf`` or ``fast``) and ``prefill_rows`` (sequences prefilled at a time; None: the
    whole batch at once). A decoder's own columns add what it stores (``Decoder.columns``)."""
    return {"engine": engine, "prefill_rows": prefill_rows}
