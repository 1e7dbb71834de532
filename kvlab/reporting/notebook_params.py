"""Notebook glue: paths that work from JupyterLab, papermill and ``kvlab report`` alike, and the
sweep notebook's parameters."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.reporting import ReportError
from kvlab.sweep.params import SweepParams, parse_params


def project_root(start: str | Path | None = None) -> Path:
    """The kvlab checkout around ``start`` (default: cwd): the nearest folder up with a
    pyproject.toml and a notebooks/ folder; cwd when there is none (an installed kvlab)."""
    start = Path(start or Path.cwd()).resolve()
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "notebooks").is_dir():
            return folder
    return start


def project_path(path: str | Path) -> Path:
    """A notebook path parameter: absolute as given; relative to cwd if it exists there, else to
    the project root, so one value works from JupyterLab (cwd notebooks/), from papermill run at
    the root, and as ``"."`` when ``kvlab report`` runs the notebook inside the records folder."""
    path = Path(path)
    if path.is_absolute() or path.exists():
        return path
    return project_root() / path


# The sweep notebook with no params file: what runs where. On a GPU, the study's protocol at the
# requested context on both decode engines (kvlab's finding is method cost vs implementation cost:
# transformers' step, hf, beside kvlab's static-KV graph-replayed step, fast), reduced to end inside
# one 10-minute device command (the h200-16k.yaml grid: every method at keep 0.1, quanto int4/int2,
# fp8, 3 repeats, SDPA pinned to flash). The sweep interleaves engines and methods within each
# repeat, so a budget stop still leaves both engines measured; a rerun resumes. hf alone ran 24
# runs in 6 min at 16k on an H200, fast runs take seconds. On a CPU, the smoke sweep
# (SmolLM2, real weights) where its context limit allows.
GPU_DEFAULTS: dict[str, Any] = {
    "name": "notebook-study", "models": ["llama-3.1-8b"], "weights": "synthetic", "dtype": "bfloat16",
    "sdpa_backend": "flash", "engine": ["hf", "fast"],
    "methods": ["full", "streamingllm", "snapkv", "pyramidkv", "tova", {"method": "quanto", "bits": [4, 2]}, "fp8"],
    "keep": [0.1], "ctx": [16384], "batch": [1], "new_tokens": 128, "prompts": 1, "repeats": 3,
    "warmup_runs": 1, "idle_s": 5, "jitter_ms": 100, "time_budget_s": 540,
}
CPU_PARAMS_FILE = "params/smoke.yaml"
CPU_MAX_CONTEXT = 8192  # SmolLM2-135M, the smoke sweep's model
CPU_NEW_TOKENS = 8  # params/smoke.yaml


@dataclass(frozen=True)
class SweepDefaults:
    """The base of a sweep notebook run given no params file: a params file, values on top, and
    one sentence saying which and why (the notebook prints it)."""

    params_file: str | None
    values: dict[str, Any]
    note: str


def _ctx_list(ctx: Any) -> list[int]:
    if ctx is None:
        return []
    try:
        return [int(c) for c in (ctx if isinstance(ctx, list | tuple) else [ctx])]
    except (TypeError, ValueError):  # a bad -p ctx: the line kvlab sweep gives, not int()'s
        raise ReportError(f"ctx: {ctx!r} is not a length in tokens; give e.g. -p ctx 16384 (or a list in "
                          f"-f params.yaml)") from None


def sweep_defaults(given: dict[str, Any], cuda_available: bool) -> SweepDefaults:
    """Pick the sweep notebook's defaults from the machine (pure: ``cuda_available`` is passed in).

    ``given`` holds the values the user set (not None). A CUDA device, given or found, gets the
    study's methods on the Llama-3.1-8B shape with synthetic weights on both engines at the
    requested context; a
    CPU gets the smoke sweep, and a context above what it can run raises one :class:`ReportError`
    line saying what to run instead, in papermill's syntax.
    """
    device = given.get("device") or ("cuda" if cuda_available else "cpu")
    ctx = _ctx_list(given.get("ctx"))
    if str(device).startswith("cuda"):
        values = {**GPU_DEFAULTS, "device": device}
        run = {**values, **given}  # what will run: the note says the user's values where given
        note = (f"no params file: the study's methods on the llama-3.1-8b shape (synthetic weights) on {device} "
                f"with engine {' and '.join(run['engine'])} at ctx {', '.join(map(str, ctx or values['ctx']))}, "
                f"{run['repeats']} repeats, stopping "
                f"cleanly after {run['time_budget_s']} s (rerun to resume)")
        return SweepDefaults(None, values, note)
    too_long = [c for c in ctx if c + CPU_NEW_TOKENS > CPU_MAX_CONTEXT]
    if too_long and not given.get("models"):
        where = "this machine has no CUDA device" if not cuda_available else "device is cpu"
        raise ReportError(
            f"ctx {too_long[0]} needs a GPU ({where}; the CPU default, the smoke sweep on smollm2-135m, "
            f"runs up to ctx {CPU_MAX_CONTEXT - CPU_NEW_TOKENS}): run `papermill notebooks/sweep.ipynb "
            f"out.ipynb -p device cpu -p ctx 1024` here, or `-p ctx {too_long[0]}` on a CUDA machine")
    note = (f"no params file: the smoke sweep ({CPU_PARAMS_FILE}, smollm2-135m, real weights) on cpu"
            + (f" at ctx {', '.join(map(str, ctx))}" if ctx else ""))
    return SweepDefaults(CPU_PARAMS_FILE, {"device": "cpu"}, note)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def notebook_sweep_params(params_file: str | Path | None = None, namespace: dict | None = None, **values):
    """Sweep params for the sweep notebook: the YAML file as the base, then every sweep key that is
    not None in ``namespace`` (the notebook's ``globals()``: its parameters, including what
    papermill ``-p``/``-f`` injected) and in ``values``.

    With no ``params_file``, the base comes from the machine (:func:`sweep_defaults`) and its
    sentence is printed. Validated by kvlab.sweep.params (a scalar ``ctx`` becomes a one-element list).
    """
    import yaml

    merged = {k: v for k, v in (namespace or {}).items() if k in SweepParams.model_fields}
    merged.update(values)
    given = {k: v for k, v in merged.items() if v is not None}
    data: dict[str, Any] = {}
    if not params_file:
        defaults = sweep_defaults(given, _cuda_available())
        print(f"kvlab: {defaults.note}")
        params_file, data = defaults.params_file, dict(defaults.values)
    if params_file:
        path = project_path(params_file)
        if not path.is_file():
            raise ReportError(f"params file {path} not found: pass params_file='params/smoke.yaml' or None")
        data = {**(yaml.safe_load(path.read_text(encoding="utf-8")) or {}), **data}
        data.setdefault("name", path.stem)
    data.update(given)
    return parse_params(data)

