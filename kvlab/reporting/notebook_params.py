"""Notebook glue: paths that work from JupyterLab, papermill and ``kvlab report`` alike, and the
sweep notebook's parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvlab.reporting import ReportError


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


def notebook_sweep_params(params_file: str | Path | None = None, namespace: dict | None = None, **values):
    """Sweep params for the sweep notebook: the YAML file as the base, then every sweep key that is
    not None in ``namespace`` (the notebook's ``globals()``: its parameters, including what
    papermill ``-p``/``-f`` injected) and in ``values``.

    Validated by kvlab.params (a scalar ``ctx`` becomes a one-element list there).
    """
    import yaml

    from kvlab.params import SweepParams, parse_params

    data: dict[str, Any] = {}
    if params_file:
        path = project_path(params_file)
        if not path.is_file():
            raise ReportError(f"params file {path} not found: pass params_file='params/smoke.yaml' or None")
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        data.setdefault("name", path.stem)
    merged = {k: v for k, v in (namespace or {}).items() if k in SweepParams.model_fields}
    merged.update(values)
    data.update({k: v for k, v in merged.items() if v is not None})
    return parse_params(data)

