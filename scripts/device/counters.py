"""Every GPU's cumulative NVML energy counter, by UUID, as JSON (issue #18's per-GPU attribution).

Read before and after a sweep; ``python -m kvlab.analysis.attribution`` lays the sweep's windows
against two such snapshots:

    python3 scripts/device/counters.py -o DIR/start.json             # one snapshot
    python3 scripts/device/counters.py --idle-s 5 -o DIR/idle.json   # and each GPU's idle power

With ``--idle-s N`` it reads twice, N seconds apart, and adds each GPU's ``idle_w`` (the counter's
rise over the wait: run it when nothing uses the GPUs); the file's readings are the second ones.
NVML numbers GPUs its own way (it ignores CUDA_VISIBLE_DEVICES), so a GPU is its UUID; ``index``
is NVML's, for people.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def snapshot(nvml, clock=time.time) -> dict[str, Any]:
    """Each GPU's counter (J since the driver loaded) and the moment it was read (mid-loop)."""
    t0 = clock()
    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        gpus.append({"index": i, "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
                     "name": _text(nvml.nvmlDeviceGetName(handle)),
                     "energy_j": nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0})
    t1 = clock()
    return {"read_at_unix": (t0 + t1) / 2, "host": socket.gethostname(), "gpus": gpus}


def with_idle(nvml, seconds: float, clock=time.time, sleep=time.sleep) -> dict[str, Any]:
    """A snapshot taken ``seconds`` after another, each GPU's ``idle_w`` the counter's rise between."""
    first = snapshot(nvml, clock)
    sleep(seconds)
    second = snapshot(nvml, clock)
    dt = second["read_at_unix"] - first["read_at_unix"]
    before = {g["uuid"]: g["energy_j"] for g in first["gpus"]}
    for g in second["gpus"]:
        if g["uuid"] in before and dt > 0:
            g["idle_w"] = (g["energy_j"] - before[g["uuid"]]) / dt
    second["idle_s"] = dt
    return second


def main(argv: list[str] | None = None, nvml=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", type=Path, help="write the JSON here (and print a summary line)")
    ap.add_argument("--idle-s", type=float, default=0.0, help="also measure idle power over this many seconds")
    args = ap.parse_args(argv)
    if nvml is None:
        import pynvml as nvml  # nvidia-ml-py
    nvml.nvmlInit()
    try:
        data = with_idle(nvml, args.idle_s) if args.idle_s > 0 else snapshot(nvml)
    finally:
        nvml.nvmlShutdown()
    text = json.dumps(data, indent=1)
    if args.out is None:
        print(text)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    summary = ", ".join(f"{g['index']} {g['uuid'][:12]} {g['energy_j'] / 1000:.1f} kJ"
                        + (f" idle {g['idle_w']:.1f} W" if "idle_w" in g else "") for g in data["gpus"])
    print(f"counters.py: {args.out}: {summary or 'no GPU'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
