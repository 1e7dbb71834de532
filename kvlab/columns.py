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


def engine_columns(engine, fast_stats: dict[str, Any] | None = None,
                   prefill_rows: int | None = None) -> dict[str, Any]:
    """``engine`` (``hf`` or ``fast``), ``prefill_rows`` (sequences prefilled at a time; None: the
    whole batch at once) and, for ``fast``, how its decoder stored and attended the KV (``fast_stats``:
    :meth:`kvlab.engine.fast.FastDecoder.stats`)."""
    name = engine if isinstance(engine, str) else ("hf" if engine is None else engine.name)
    cols: dict[str, Any] = {"engine": name, "prefill_rows": prefill_rows}
    if fast_stats is not None:
        cols.update(kv_format=fast_stats["kv_format"], fast_attention=fast_stats["attention"],
                    cuda_graph=fast_stats["graph"], fast_compile=fast_stats.get("step_compile"),
                    cache_bytes_allocated=fast_stats["bytes_allocated"])
    return cols
