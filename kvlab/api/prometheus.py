"""The ``/metrics`` page: the engine's gauges and counters in Prometheus' text format."""

from __future__ import annotations

from collections.abc import Mapping

# engine stats key -> (metric name, type, help)
ENGINE_METRICS = {
    "running": ("kvlab_num_requests_running", "gauge", "Requests in the running batch."),
    "waiting": ("kvlab_num_requests_waiting", "gauge", "Requests waiting for admission."),
    "blocks_used": ("kvlab_kv_blocks_used", "gauge", "KV-cache blocks allocated to requests."),
    "blocks_free": ("kvlab_kv_blocks_free", "gauge", "KV-cache blocks free in the pool."),
    "blocks_total": ("kvlab_kv_blocks_total", "gauge", "KV-cache blocks in the pool."),
    "preemptions_total": ("kvlab_num_preemptions_total", "counter", "Requests preempted (recompute)."),
}


def _family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {_number(value)}" for labels, value in samples]
    return lines


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def metrics_text(stats: Mapping, outcomes: Mapping[str, int], *, energy_j: float | None,
                 cpu_s: float, method: str) -> str:
    """The page: engine stats, requests by outcome, the energy counter (NVML joules where a GPU
    serves) and the server's CPU seconds (always: the CPU-time equivalent of energy)."""
    lines: list[str] = []
    for key, (name, kind, help_text) in ENGINE_METRICS.items():
        if stats.get(key) is not None:
            lines += _family(name, kind, help_text, [("", stats[key])])
    lines += _family("kvlab_requests_total", "counter", "Requests by outcome (ok, refused, aborted, failed).",
                     [(f'{{outcome="{k}"}}', v) for k, v in sorted(outcomes.items())])
    if energy_j is not None:
        lines += _family("kvlab_energy_joules_total", "counter", "The serving GPU's NVML energy counter.",
                         [("", energy_j)])
    lines += _family("process_cpu_seconds_total", "counter", "User and system CPU time of the server.",
                     [("", cpu_s)])
    lines += _family("kvlab_info", "gauge", "The cache method this server runs.", [(f'{{method="{method}"}}', 1)])
    return "\n".join(lines) + "\n"
