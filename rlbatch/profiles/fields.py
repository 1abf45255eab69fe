"""Validated reads of profile JSON fields: errors name the file and the offending field."""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "FREE_FORM_KEYS",
    "ProfileError",
    "check_keys",
    "get_bool",
    "get_field",
    "get_section",
    "get_str",
    "pos_float",
    "pos_int",
]

FREE_FORM_KEYS = frozenset({"description", "notes", "fit", "hf_id"})


class ProfileError(ValueError):
    """A profile (or a measurement file) is missing, unknown or malformed.

    The message names the file and the offending field.
    """


def get_field(data: dict[str, Any], key: str, source: str, default: Any = ...) -> Any:
    if key in data:
        return data[key]
    if default is ...:
        raise ProfileError(f"{source}: missing required field {key!r}")
    return default


def pos_float(data: dict[str, Any], key: str, source: str, default: Any = ...,
               allow_zero: bool = False) -> float:
    value = get_field(data, key, source, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProfileError(f"{source}: field {key!r} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0.0 or (value == 0.0 and not allow_zero):
        kind = "non-negative" if allow_zero else "positive"
        raise ProfileError(f"{source}: field {key!r} must be a finite {kind} number, "
                           f"got {value!r}")
    return value


def pos_int(data: dict[str, Any], key: str, source: str, default: Any = ...,
             allow_zero: bool = False) -> int:
    value = get_field(data, key, source, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(f"{source}: field {key!r} must be an integer, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        kind = "non-negative" if allow_zero else "positive"
        raise ProfileError(f"{source}: field {key!r} must be a {kind} integer, got {value!r}")
    return value


def get_bool(data: dict[str, Any], key: str, source: str, default: Any = ...) -> bool:
    value = get_field(data, key, source, default)
    if not isinstance(value, bool):
        raise ProfileError(f"{source}: field {key!r} must be true or false, got {value!r}")
    return value


def get_str(data: dict[str, Any], key: str, source: str, default: Any = ...) -> str:
    value = get_field(data, key, source, default)
    if not isinstance(value, str) or not value:
        raise ProfileError(f"{source}: field {key!r} must be a non-empty string, got {value!r}")
    return value


def check_keys(data: dict[str, Any], allowed: set[str], source: str) -> None:
    unknown = sorted(set(data) - allowed - FREE_FORM_KEYS)
    if unknown:
        raise ProfileError(f"{source}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def get_section(data: dict[str, Any], key: str, source: str) -> dict[str, Any] | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProfileError(f"{source}: field {key!r} must be an object or null, got {value!r}")
    return value
