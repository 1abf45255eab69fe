"""Controller specs: a preset, a preset with typed settings, or a settings file.

::

    static:16                     a preset (static:N, vllm-default, playbook, aimd, random,
                                  fixed:N, fixed:A/B/C/D@N, mpc, ppo:PATH)
    fixed:256[order=deadline]     a preset with settings: KEY=VALUE, comma-separated; a
                                  dotted key reaches into a table (guard.p99=false,
                                  guard.kv_budget.fraction=0.8, release=none)
    my-controller.toml            a settings file (a path without ``:``):
                                  ``controller = "fixed:256"``, optionally ``name = "..."``,
                                  then the settings as keys and tables

The keys are the fields of the preset's settings dataclass (each factory says which one:
e.g. :class:`policies.rules.FixedSettings`), converted and validated by
:mod:`rlbatch.settings`: an unknown key, a key given twice or a bad value is an error that
names the key. ``--set KEY=VALUE`` on the command line adds the same settings to every
controller of a list (:func:`with_overrides`). A list is comma-separated, and
``static:{4,8,16}`` expands to three. A controller's name (its rows' ``controller``) is its
spec as written, settings included, or a settings file's ``name``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlbatch.settings import SettingsError, load_settings_file, parse_overrides

_ITEM_START = re.compile(r",(?=\s*[\w.]+\s*=)")
"""Where a bracket's next ``KEY=`` starts (commas inside a value, ``ladder=4,8,16``, stay)."""


@dataclass(frozen=True)
class ParsedSpec:
    """A controller spec taken apart.

    :param preset: the preset (``fixed:256``).
    :param settings: the settings, nested (a settings file's, then the bracket's).
    :param name: the name the controller carries.
    """

    preset: str
    settings: Mapping[str, Any]
    name: str


def _split(text: str) -> tuple[str, list[str]]:
    """``preset[items]`` -> (preset, items)."""
    text = text.strip()
    if not text.endswith("]"):
        if "[" in text or "]" in text:
            raise SettingsError(f"controller settings go in brackets at the end, e.g. "
                                f"fixed:256[order=deadline]; got {text!r}")
        return text, []
    head, sep, inner = text[:-1].partition("[")
    if not sep or "[" in inner or "]" in inner:
        raise SettingsError(f"controller settings go in one pair of brackets at the end, "
                            f"e.g. fixed:256[order=deadline]; got {text!r}")
    items = [item.strip() for item in _ITEM_START.split(inner) if item.strip()]
    return head.strip(), items


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, table by table."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def spec_preset(text: str) -> str:
    """The preset of a spec (or the settings file it names), without reading any file.

    :param text: the spec.
    :raises SettingsError: brackets out of place.
    """
    return _split(text)[0]


def spec_settings_text(text: str) -> str:
    """The bracket of a spec, brackets included (empty without one).

    :param text: the spec.
    :raises SettingsError: brackets out of place.
    """
    items = _split(text)[1]
    return f"[{','.join(items)}]" if items else ""


def parse_spec(text: str) -> ParsedSpec:
    """Take a controller spec apart (module docstring).

    :param text: the spec.
    :raises SettingsError: brackets out of place, an override that is not KEY=VALUE or is
        given twice, or a settings file that cannot be read, is not TOML or names no
        ``controller``.
    """
    preset, items = _split(text)
    settings = parse_overrides(items)
    name = text.strip()
    if preset.endswith(".toml") and ":" not in preset:  # ppo:PATH.toml is a folder's name
        data = load_settings_file(preset)
        inner = data.pop("controller", None)
        if not isinstance(inner, str) or not inner or inner.endswith((".toml", "]")):
            raise SettingsError(f"settings file {preset}: 'controller' must name a preset "
                                f"(e.g. controller = \"fixed:256\"), got {inner!r}")
        label = data.pop("name", None)
        if label is not None and not isinstance(label, str):
            raise SettingsError(f"settings file {preset}: 'name' must be a string")
        if label and not items:
            name = label
        settings = _merge(data, settings)
        preset = inner
    return ParsedSpec(preset, settings, name)


def with_overrides(spec: str, overrides: Sequence[str]) -> str:
    """``spec`` with ``--set`` overrides added to its bracket (the name then says them).

    :param spec: a controller spec.
    :param overrides: ``KEY=VALUE`` texts.
    :raises SettingsError: an override that is not KEY=VALUE, or a key the spec (or another
        override) already sets.
    """
    if not overrides:
        return spec
    preset, items = _split(spec)
    items = [*items, *(o.strip() for o in overrides)]
    parse_overrides(items)  # refuses a key given twice
    return f"{preset}[{','.join(items)}]"


def controller_specs(text: str) -> list[str]:
    """Split a comma-separated controller list; ``static:{4,8,16}`` expands to three.

    :param text: the list.
    :raises ValueError: it names no controller.
    """
    specs: list[str] = []
    for part in _split_top_level(text):
        head, brace, rest = part.partition("{")
        inner, close, tail = rest.partition("}")
        if brace and close:
            specs.extend(head + x.strip() + tail for x in inner.split(",") if x.strip())
        else:
            specs.append(part)
    if not specs:
        raise ValueError(f"no controller in {text!r}")
    return specs


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside braces and brackets."""
    parts: list[str] = []
    depth = 0
    current = ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return [p for p in parts if p]
