"""`kvlab serve`'s settings: one cache method per server, from flags or a params file whose keys
map 1:1 onto :class:`ServeConfig` (flags given win). Checked here, before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from kvlab.errors import UserError


class ServeConfigError(UserError):
    """A bad `kvlab serve` flag or params-file key; the message names it and the fix."""


@dataclass(frozen=True)
class ServeConfig:
    model: str
    method: str = "full"
    policy: dict[str, Any] = field(default_factory=dict)  # the method's parameters (`kvlab policies`)
    weights: str | None = None
    device: str = "cpu"
    pool_gb: float | None = None  # the KV block pool; None: CPU_POOL_GB on CPU, the GPU's free memory on CUDA
    block_size: int = 16
    max_num_seqs: int | None = None  # the scheduler's batch limit; None: the engine's default
    max_num_batched_tokens: int | None = None  # tokens per step (chunked prefill); None: the engine's default
    host: str = "127.0.0.1"
    port: int = 8000
    max_in_flight: int | None = None  # requests held at once (waiting + running); beyond it, 503

    def check(self) -> ServeConfig:
        if not isinstance(self.model, str) or not self.model:
            raise ServeConfigError("model: name a preset (`kvlab models`) or a local model folder")
        if not isinstance(self.policy, dict):
            raise ServeConfigError(f"policy must be a mapping of the method's parameters, not {self.policy!r}")
        if not (isinstance(self.port, int) and 0 <= self.port <= 65535):
            raise ServeConfigError(f"port {self.port!r}: an integer in 0-65535 (0 picks a free port)")
        if not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise ServeConfigError(f"block_size {self.block_size!r}: tokens per KV block, an integer >= 1")
        if self.pool_gb is not None and not (isinstance(self.pool_gb, int | float) and self.pool_gb > 0):
            raise ServeConfigError(f"pool_gb {self.pool_gb!r}: a positive size in GB (or leave it out)")
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ServeConfigError(f"{key} {value!r}: an integer >= 1 (or leave it out)")
        if self.max_in_flight is not None and not (isinstance(self.max_in_flight, int) and self.max_in_flight >= 1):
            raise ServeConfigError(f"max_in_flight {self.max_in_flight!r}: an integer >= 1 (or leave it out)")
        if self.weights not in (None, "real", "synthetic"):
            raise ServeConfigError(f"weights {self.weights!r}: real or synthetic")
        return self


    def engine_options(self) -> dict[str, Any]:
        """``make_serving_engine``'s keywords besides the method's parameters."""
        pool_gb = self.pool_gb if self.pool_gb is not None or self.device.startswith("cuda") else CPU_POOL_GB
        options = {"pool_gb": pool_gb, "block_size": self.block_size, "device": self.device}
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, key) is not None:
                options[key] = getattr(self, key)
        return options


CPU_POOL_GB = 1.0  # SmolLM2-135M in float32: about 21k tokens of KV
KEYS = tuple(f.name for f in fields(ServeConfig))


def read_params_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ServeConfigError(f"--params {path}: cannot read it ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ServeConfigError(f"--params {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ServeConfigError(f"--params {path}: a mapping of {', '.join(KEYS)}")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ServeConfigError(f"--params {path}: unknown key(s) {', '.join(unknown)}; the keys are {', '.join(KEYS)}")
    return data


def make_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> ServeConfig:
    """The file's values, then the flags given (policy parameters merged key by key)."""
    if not isinstance(file_values.get("policy") or {}, dict):
        raise ServeConfigError(f"policy must be a mapping of the method's parameters, not {file_values['policy']!r}")
    merged = {**file_values, **{k: v for k, v in flag_values.items() if k != "policy" and v is not None}}
    merged["policy"] = {**(file_values.get("policy") or {}), **(flag_values.get("policy") or {})}
    if "model" not in merged:
        raise ServeConfigError("no model: pass --model NAME or a params file with `model:`")
    return ServeConfig(**merged).check()
