"""The base of every params schema kvlab validates (sweep params, a method entry, a context
distribution, a quality block): unknown keys are refused, and so is what pydantic's lax mode
would silently reinterpret.

- ``true``/``false`` where a number is expected (pydantic takes ``batch: [true]`` as batch 1);
- an empty list for a list-valued key (``engine: []`` would plan no runs and call the sweep complete);
- a list that names one value twice (``engine: [hf, hf]`` would measure and record one run twice).

Each is one line naming the key, through the schema's own error path. A schema whose list may
legitimately be empty or repeat a value marks the field ``json_schema_extra={"empty_ok": True}`` or
``{"repeats_ok": True}``.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def admits_bool(annotation: Any) -> bool:
    """Whether a field's type takes ``true``/``false`` as what they are (bool, Any, or a union or
    container holding one of them)."""
    if annotation is bool or annotation is Any:
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    return any(admits_bool(a) for a in typing.get_args(annotation))


def is_list_type(annotation: Any) -> bool:
    """Whether a field's type is (or may be) a list."""
    if typing.get_origin(annotation) is list:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(is_list_type(a) for a in typing.get_args(annotation))
    return False


def first_repeat(values: list) -> Any | None:
    """The first value of a list that an earlier one equals (``1`` and ``1.0`` alike; mappings by
    their content), as given; None when every value is distinct."""
    seen = set()
    for v in values:
        numeric = isinstance(v, int | float) and not isinstance(v, bool)
        key = repr(float(v)) if numeric else json.dumps(v, sort_keys=True, default=str)
        if key in seen:
            return v
        seen.add(key)
    return None


def as_yaml(value: Any) -> str:
    """A value as a params file spells it (true, null, 0.5, 'hf')."""
    if value is None or isinstance(value, bool):
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value)


BOOL_PROBLEM = "true/false is not a number here; give a number (or a list of numbers)"


def has_bool(value: Any) -> bool:
    """Whether a value or a member of a list value is a boolean."""
    return any(isinstance(v, bool) for v in (value if isinstance(value, list | tuple) else [value]))


class StrictModel(BaseModel):
    """A pydantic model that refuses unknown keys, booleans taken as numbers, empty lists and
    repeated list values (module docstring); subclasses get this for every field they add."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _nothing_reinterpreted(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields[info.field_name]
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if not admits_bool(field.annotation) and has_bool(value):
            raise ValueError(BOOL_PROBLEM)
        if isinstance(value, list | tuple) and is_list_type(field.annotation):
            if not value and not extra.get("empty_ok"):
                raise ValueError("empty; list at least one value (or leave the key out for its default)")
            repeat = first_repeat(list(value))
            if repeat is not None and not extra.get("repeats_ok"):
                raise ValueError(f"{as_yaml(repeat)} is listed twice; list each value once (each would be "
                                 f"measured and recorded again under the same run id)")
        return value
