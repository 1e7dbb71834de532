"""The column groups every record shares, built in one place.

A sweep's perf record, a quality record and ``kvlab generate``'s JSON describe the same things the
same way: which model (and its provenance), which policy, which engine. Each group is a pure
function of the object it describes; callers add their own identity and measured columns.
"""

from __future__ import annotations

from typing import Any


def model_columns(loaded) -> dict[str, Any]:
    """Provenance of the loaded model (weights, dtype, device, ...), its GPU and attention."""
    device = str(loaded.device)
    gpu_name = None
    if device.startswith("cuda"):
        import torch

        gpu_name = torch.cuda.get_device_name(torch.device(device))
    return {**loaded.provenance(), "gpu_name": gpu_name,
            "attn_implementation": getattr(loaded.model.config, "_attn_implementation", None)}


def policy_columns(policy) -> dict[str, Any]:
    """Method, label and parameters of a cache policy (``prefill_chunk``: None for a one-shot prefill)."""
    return {"method": policy.name, "label": policy.label, "policy_params": dict(policy.params()),
            "keep": policy.keep, "bits": policy.bits, "prefill_chunk": getattr(policy, "prefill_chunk", None)}


def engine_columns(engine: str, prefill_rows: int | None = None) -> dict[str, Any]:
    """``engine`` (``hf`` or ``fast``) and ``prefill_rows`` (sequences prefilled at a time; None: the
    whole batch at once). A decoder's own columns add what it stores (``Decoder.columns``)."""
    return {"engine": engine, "prefill_rows": prefill_rows}
