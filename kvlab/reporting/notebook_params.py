"""Notebook glue: paths that work from JupyterLab, papermill and ``kvlab report`` alike, and the
notebooks' parameters: the sweep notebook's turned into sweep params, the report notebook's
checked. A parameter name the notebook does not have, a list given to ``papermill -p`` (which
passes it as text) and a baseline no record has are handled here, before any work; the message is
written to the terminal first (the kernel's own stderr), then raised for papermill's cell error."""

from __future__ import annotations

import difflib
import functools
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.errors import UserError
from kvlab.reporting import ReportError
from kvlab.sweep.params import SweepParams, parse_params
from kvlab.yamlfile import load_yaml

# The report notebook's parameters cell, and the names each notebook's own cells assign (a rerun in
# JupyterLab finds them in globals(); they are no parameter a user gave).
REPORT_PARAMETERS = ("records_dir", "ctx", "baseline", "pattern", "n_boot", "parity")
SWEEP_NOTEBOOK_PARAMETERS = ("params_file", "out_dir", *SweepParams.model_fields)
NOTEBOOK_OWN_NAMES = {
    "sweep": {"params", "folder", "engines"},
    "serving": {"params", "rows", "df"},
    "report": {"study", "summary", "at", "caption", "parity_file", "methods", "per_ctx", "ctx_caption", "dist",
               "pays", "no_energy", "engines", "rel", "batch", "batch_ctx", "batch_caption", "at_budget", "stack",
               "metric", "metric_title", "gap", "gap_sentence"},
}
IPYTHON_NAMES = {"In", "Out", "exit", "quit", "get_ipython", "open"}


def said_first(fn):
    """A notebook helper whose :class:`UserError` is also written to the kernel's own stderr (the
    terminal papermill runs in) before it is raised, so kvlab's line is read before papermill's
    traceback of the cell."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            stream = sys.__stderr__
            if stream is not None:
                print(f"\nkvlab: error: {err}", file=stream, flush=True)  # below any progress bar
            raise
    return wrapper


def unknown_parameters(namespace: dict, known, notebook: str) -> list[str]:
    """Names in a notebook's globals that are data (not modules, functions or classes), not one of its
    parameters and not assigned by its own cells: what ``papermill -p NAME`` injected by mistake."""
    own = NOTEBOOK_OWN_NAMES[notebook] | IPYTHON_NAMES
    return sorted(k for k, v in namespace.items() if not k.startswith("_") and k not in known and k not in own
                  and not (callable(v) or inspect.ismodule(v)))


def refuse_unknown(namespace: dict | None, known, notebook: str) -> None:
    unknown = unknown_parameters(namespace or {}, known, notebook)
    if unknown:
        hints = [f"{name!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(
            name, list(known), n=1)) else "") for name in unknown]
        raise ReportError(f"notebooks/{notebook}.ipynb has no parameter {', '.join(hints)}; its parameters: "
                          f"{', '.join(known)}")


def parsed_text_values(given: dict[str, Any]) -> dict[str, Any]:
    """``papermill -p methods '["snapkv"]'`` passes the text, not the list: a text value that opens
    with ``[`` or ``{`` for a key that is not plain text is read as YAML (JSON is YAML), as meant."""
    out = dict(given)
    for key, value in given.items():
        field = SweepParams.model_fields.get(key)
        if isinstance(value, str) and value.strip()[:1] in ("[", "{") and field is not None \
                and field.annotation is not str:
            out[key] = load_yaml(value, f"-p {key} {value!r}", ReportError)
    return out


def baseline_problem(records, baseline: str, where: str, flag: str = "--baseline") -> str | None:
    """Why ``baseline`` names no method (or label) of ``records`` (dicts), or None."""
    records = list(records)
    names = {str(r[k]) for r in records for k in ("method", "label") if r.get(k) is not None}
    if baseline in names:
        return None
    methods = sorted({str(r["method"]) for r in records if r.get("method") is not None})
    return (f"{flag} {baseline!r} is no method in {where}: its records hold {', '.join(methods) or 'none'}; "
            f"pass one of them (or leave it out for full)")


@said_first
def notebook_study(namespace: dict):
    """The report notebook's first step: its parameters checked (names, baseline), the study loaded."""
    from kvlab.reporting.study import load_study

    refuse_unknown(namespace, REPORT_PARAMETERS, "report")
    study = load_study(project_path(namespace.get("records_dir") or "outputs/smoke"))
    baseline = namespace.get("baseline") or "full"
    columns = [c for c in ("method", "label") if c in study.records.columns]
    # full is the notebook's default: a folder without it (quantized or decoding runs alone) still renders
    problem = baseline_problem(study.records[columns].to_dict("records"), baseline, str(study.folder),
                               flag="baseline") if columns and baseline != "full" else None
    if problem:
        raise ReportError(problem + " (-p baseline NAME)")
    return study


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


@said_first
def notebook_sweep_params(params_file: str | Path | None = None, namespace: dict | None = None, **values):
    """Sweep params for the sweep notebook: the YAML file as the base, then every sweep key that is
    not None in ``namespace`` (the notebook's ``globals()``: its parameters, including what
    papermill ``-p``/``-f`` injected) and in ``values``.

    With no ``params_file``, the base comes from the machine (:func:`sweep_defaults`) and its
    sentence is printed. Validated by kvlab.sweep.params (a scalar ``ctx`` becomes a one-element list).
    """
    refuse_unknown(namespace, SWEEP_NOTEBOOK_PARAMETERS, "sweep")
    merged = {k: v for k, v in (namespace or {}).items() if k in SweepParams.model_fields}
    merged.update(values)
    given = parsed_text_values({k: v for k, v in merged.items() if v is not None})
    data: dict[str, Any] = {}
    if not params_file:
        defaults = sweep_defaults(given, _cuda_available())
        print(f"kvlab: {defaults.note}")
        params_file, data = defaults.params_file, dict(defaults.values)
    if params_file:
        path = project_path(params_file)
        if not path.is_file():
            raise ReportError(f"params file {path} not found: pass params_file='params/smoke.yaml' or None")
        data = {**(load_yaml(path.read_text(encoding="utf-8"), f"params file {path}", ReportError) or {}), **data}
        data.setdefault("name", path.stem)
    data.update(given)
    return parse_params(data)

