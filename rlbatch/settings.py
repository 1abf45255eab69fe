"""Typed settings: a dataclass is the one source of its settings file, overrides and flags.

A setting is a field of a dataclass, documented by the ``:param name:`` line of the class
docstring. From the fields come, with no second spelling anywhere:

* **settings files** (TOML; a table is a nested dataclass): :func:`load_settings_file`;
* **overrides** ``KEY=VALUE`` (``--set``; a dotted key reaches into a nested dataclass,
  e.g. ``guard.kv_budget.fraction=0.8``): :func:`parse_overrides`;
* **command-line flags**, ``--field-name`` per field with the field's type, default and
  docstring: :func:`add_flags` and :func:`from_flags` (as vLLM derives its engine flags
  from its config classes).

:func:`apply` puts such values on an instance: each is converted to the field's type
(``none`` for an optional field, ``true`` / ``false`` for a flag, ``a,b`` for a tuple, a table
for a nested dataclass) and the dataclass validates the result. An unknown key, a key given
twice or a bad value raises :class:`SettingsError` naming the key and what it takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import tomllib
import types
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")
_PARAM = re.compile(r"^\s*:param (\w+):\s*(.*)$")


class SettingsError(ValueError):
    """A settings file, an override or a flag that does not fit the settings it sets."""


def field_types(cls: Any) -> dict[str, Any]:
    """The resolved type of each field of the dataclass ``cls``."""
    return _field_types(cls)


@cache
def _field_types(cls: Any) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def field_docs(cls: Any) -> dict[str, str]:
    """Each field's ``:param name:`` text from the class docstring (joined, one line)."""
    return _field_docs(cls)


def _dataclass_type(tp: Any) -> type | None:
    """``tp`` when it is a dataclass type, else ``None``."""
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


@cache
def _field_docs(cls: Any) -> dict[str, str]:
    docs: dict[str, str] = {}
    current = ""
    for line in (cls.__doc__ or "").splitlines():
        match = _PARAM.match(line)
        if match:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current and line.strip() and not line.strip().startswith(":"):
            docs[current] += " " + line.strip()
        else:
            current = ""
    return docs


def _optional(tp: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``X | None``, else ``(tp, False)``."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def describe(tp: Any) -> str:
    """What a value of type ``tp`` looks like, for error messages and help."""
    inner, optional = _optional(tp)
    if inner is bool:
        text = "true or false"
    elif inner is int:
        text = "an integer"
    elif inner is float:
        text = "a number"
    elif inner is str:
        text = "a string"
    elif get_origin(inner) is Literal:
        text = " | ".join(str(a) for a in get_args(inner))
    elif get_origin(inner) is tuple:
        text = f"a comma-separated list of {describe(get_args(inner)[0])}"
    elif _dataclass_type(inner) is not None:
        text = f"a table of {inner.__name__} settings"
    else:
        text = str(inner)
    return f"{text} or none" if optional else text


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    raise ValueError(value)


def _to_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(value)
    return int(value)


def _to_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(value)
    number = float(value)
    if math.isnan(number):
        raise ValueError(value)
    return number


def _to_str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(value)
    return value


_SCALARS: dict[Any, Any] = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def convert(tp: Any, value: Any, key: str) -> Any:
    """``value`` (text from an override or a flag, or a TOML value) as type ``tp``.

    :param tp: the field's type.
    :param value: the value given.
    :param key: the setting's name, for the error.
    :raises SettingsError: the value does not fit.
    """
    inner, optional = _optional(tp)
    if optional and (value is None or (isinstance(value, str) and value.lower() == "none")):
        return None
    table = _dataclass_type(inner)
    if table is not None:
        off = "; none turns it off" if optional else ""
        raise SettingsError(f"{key} is a table of {table.__name__} settings (set its keys, "
                            f"e.g. {key}.{next(iter(field_types(table)))}=...{off}), got "
                            f"{value!r}")
    bad = SettingsError(f"{key} takes {describe(tp)}, got {value!r}")
    if get_origin(inner) is Literal:
        if value in get_args(inner):
            return value
        raise bad
    if get_origin(inner) is tuple:
        element = get_args(inner)[0]
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise bad
        return tuple(convert(element, item.strip() if isinstance(item, str) else item,
                             f"{key}[{i}]") for i, item in enumerate(items))
    scalar = _SCALARS.get(inner)
    if scalar is None:
        raise SettingsError(f"{key}: fields of type {tp} cannot be set")
    try:
        return scalar(value)
    except ValueError:
        raise bad from None


def apply(obj: T, values: Mapping[str, Any], where: str = "") -> T:
    """``obj`` (a dataclass instance) with ``values`` set: a nested mapping sets the fields of a
    nested dataclass (an optional one that is ``None`` starts from its defaults).

    :param obj: the settings to start from.
    :param values: field name -> value (text, a TOML value, or a mapping for a table).
    :param where: the dotted path of ``obj`` in its settings, for errors.
    :raises SettingsError: an unknown key, a value that does not fit, or a combination the
        dataclass refuses (its message, prefixed with where it was set).
    """
    cls = type(obj)
    known = field_types(cls)
    changes: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{where}{key}"
        if key not in known:
            raise SettingsError(f"unknown setting {path!r}; {cls.__name__} has "
                                f"{', '.join(known)}")
        table = _dataclass_type(_optional(known[key])[0])
        if table is not None and isinstance(value, Mapping):
            current = getattr(obj, key)
            base = current if current is not None else table()
            changes[key] = apply(base, value, f"{path}.")
        else:
            changes[key] = convert(known[key], value, path)
    try:
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    except (ValueError, TypeError) as exc:
        if isinstance(exc, SettingsError):
            raise
        raise SettingsError(f"{where.rstrip('.') or cls.__name__}: {exc}") from None


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` texts as a nested mapping (``a.b=1`` -> ``{"a": {"b": "1"}}``).

    :param items: the overrides, as given.
    :raises SettingsError: no ``=``, an empty key, a key given twice, or a key set both as a
        value and as a table (``release=none`` with ``release.wait_fraction=0.3``).
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise SettingsError(f"an override is KEY=VALUE (e.g. guard.p99=false), got {item!r}")
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SettingsError(f"{'.'.join(parts[:depth + 1])} is set as a value and as "
                                    f"a table in {list(items)}")
            node = child
        leaf = parts[-1]
        if leaf in node:
            raise SettingsError(f"setting {key.strip()!r} given twice")
        node[leaf] = value.strip()
    return out


def _text(value: Any) -> str:
    """A field's value as :func:`convert` reads it back."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ",".join(_text(v) for v in value)
    return str(value)


def override_items(obj: Any, base: Any, prefix: str = "") -> list[str]:
    """The ``KEY=VALUE`` texts that turn ``base`` into ``obj`` (instances of one dataclass):
    ``apply(base, parse_overrides(override_items(obj, base)))`` equals ``obj``. Only the
    fields that differ are named; a nested dataclass by its own fields (``guard.p99=false``).

    :param obj: the settings to reach.
    :param base: the settings to start from.
    :param prefix: put before every key (``guard.``).
    :raises SettingsError: ``obj`` and ``base`` are not instances of one dataclass.
    """
    if not dataclasses.is_dataclass(obj) or type(obj) is not type(base):
        raise SettingsError(f"override_items takes two instances of one dataclass, got "
                            f"{type(obj).__name__} and {type(base).__name__}")
    items: list[str] = []
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        value, start = getattr(obj, f.name), getattr(base, f.name)
        if value == start or (isinstance(value, tuple | list) and isinstance(start, tuple | list)
                              and tuple(value) == tuple(start)):
            continue
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            # a table that was off starts from its defaults: name one field to switch it on
            start = start if start is not None else type(value)()
            nested = override_items(value, start, f"{key}.")
            first = dataclasses.fields(value)[0].name
            items += nested or [f"{key}.{first}={_text(getattr(value, first))}"]
        else:
            items.append(f"{key}={_text(value)}")
    return items


def load_settings_file(path: str | Path) -> dict[str, Any]:
    """A TOML settings file as a mapping (TOML itself refuses a key given twice).

    :param path: the file.
    :raises SettingsError: it cannot be read or is not TOML (the message names the file).
    """
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise SettingsError(f"settings file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"settings file {path}: {exc}") from None


def flag_name(field: str, prefix: str = "") -> str:
    """The command-line flag of a field: ``max_queue_len`` -> ``--max-queue-len``."""
    return "--" + (prefix + field).replace("_", "-")


def add_flags(group: Any, cls: type, *, only: Sequence[str] | None = None,
              exclude: Sequence[str] = (), prefix: str = "",
              defaults: object | None = None, help_suffix: Mapping[str, str] | None = None
              ) -> None:
    """One flag per field of ``cls`` (scalars, literals, optional scalars and tuples):
    its type converter, its default (from ``defaults``, else the field's) and its docstring
    as help. A boolean field gets ``--name`` / ``--no-name``.

    :param group: a parser or argument group.
    :param cls: the settings dataclass.
    :param only: these fields only (default: every field not excluded).
    :param exclude: fields left out (set otherwise).
    :param prefix: prepended to each flag and destination (``sla_`` -> ``--sla-ttft-s``).
    :param defaults: an instance whose values are the defaults.
    :param help_suffix: per field, text appended to its help.
    """
    docs = field_docs(cls)
    types_ = field_types(cls)
    names = list(only) if only is not None else [n for n in types_ if n not in exclude]
    base = defaults if defaults is not None else None
    for name in names:
        tp = types_[name]
        inner, optional = _optional(tp)
        if _dataclass_type(inner) is not None:
            raise SettingsError(f"{cls.__name__}.{name} is a table: no flag derives from it")
        default = getattr(base, name) if base is not None else _field_default(cls, name)
        text = _plain(docs.get(name, "")) + (help_suffix or {}).get(name, "")
        dest = prefix + name
        if inner is bool:
            group.add_argument(flag_name(name, prefix), dest=dest, default=default,
                               action=argparse.BooleanOptionalAction, help=text)
            continue
        kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": text,
                                  "type": _converter(tp, flag_name(name, prefix))}
        if get_origin(inner) is Literal and not optional:
            kwargs["choices"] = get_args(inner)
            kwargs.pop("type")
        group.add_argument(flag_name(name, prefix), **kwargs)


def from_flags(cls: type[T], args: argparse.Namespace, *, only: Sequence[str] | None = None,
               exclude: Sequence[str] = (), prefix: str = "", **fixed: Any) -> T:
    """The ``cls`` instance :func:`add_flags` described, validated by ``cls``.

    :param cls: the settings dataclass.
    :param args: parsed options.
    :param only: as given to :func:`add_flags`.
    :param exclude: as given to :func:`add_flags`.
    :param prefix: as given to :func:`add_flags`.
    :param fixed: fields set otherwise (the excluded ones).
    """
    names = list(only) if only is not None else [n for n in field_types(cls)
                                                 if n not in exclude]
    values = {name: getattr(args, prefix + name) for name in names}
    return cls(**values, **fixed)


def _plain(doc: str) -> str:
    """A docstring's text without reST markup (``code``, :mod:`~a.b` -> code, b)."""
    doc = re.sub(r":\w+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1]
                 if m.group(0)[m.group(0).index("`") + 1] == "~" else m.group(1), doc)
    return doc.replace("``", "")


def _field_default(cls: type, name: str) -> Any:
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return None


def _converter(tp: Any, flag: str) -> Any:
    def parse(text: str) -> Any:
        try:
            return convert(tp, text, flag)
        except SettingsError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = describe(tp)  # argparse names the type in its error
    return parse
