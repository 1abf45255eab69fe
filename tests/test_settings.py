"""Typed settings: values converted to each field's type, nested tables, overrides, settings
files, flags derived from the fields, and controller specs built on them."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from policies.mpc import MpcController
from policies.ppo import PpoController
from policies.rules import FixedController
from rlbatch.control.controllers import make_controller
from rlbatch.control.discipline import AdmissionDiscipline, KvBudget
from rlbatch.control.guard import GuardConfig
from rlbatch.control.specs import controller_specs, parse_spec, spec_preset, with_overrides
from rlbatch.settings import (
    SettingsError,
    add_flags,
    apply,
    convert,
    field_docs,
    from_flags,
    load_settings_file,
    override_items,
    parse_overrides,
)


@dataclass(frozen=True)
class Inner:
    """A nested table.

    :param fraction: a share, in (0, 1].
    :param mode: one of two words.
    """

    fraction: float = 1.0
    mode: Literal["peak", "final"] = "peak"

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")


@dataclass(frozen=True)
class Outer:
    """Settings with every kind of field.

    :param count: how many, an integer spread
        over two docstring lines.
    :param ratio: a number.
    :param on: a switch.
    :param label: optional text.
    :param ladder: a list.
    :param inner: a table.
    :param maybe: an optional table.
    """

    count: int = 3
    ratio: float = 0.5
    on: bool = True
    label: str | None = None
    ladder: tuple[int, ...] = (1, 2)
    inner: Inner = Inner()
    maybe: Inner | None = None


@pytest.mark.parametrize(("tp", "text", "value"), [
    (int, "7", 7), (float, "inf", math.inf), (float, "2", 2.0), (bool, "off", False),
    (bool, "YES", True), (str | None, "none", None), (str | None, "x", "x"),
    (tuple[int, ...], "4, 8,16", (4, 8, 16)), (Literal["a", "b"], "b", "b"),
    (int | None, None, None), (float, 3, 3.0), (bool, True, True),
])
def test_values_are_converted_to_the_field_type(tp: object, text: object, value: object) -> None:
    assert convert(tp, text, "k") == value


@pytest.mark.parametrize(("tp", "text", "message"), [
    (int, "7.5", "k takes an integer, got '7.5'"), (int, True, "k takes an integer"),
    (float, "nan", "k takes a number"), (float, "fast", "k takes a number"),
    (bool, "maybe", "k takes true or false"), (Literal["a", "b"], "c", "k takes a | b"),
    (str, 5, "k takes a string"), (tuple[int, ...], "4,x", "k[1] takes an integer"),
    (Inner, "3", "k is a table of Inner settings"),
])
def test_bad_values_name_the_key_and_what_it_takes(tp: object, text: object,
                                                   message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        convert(tp, text, "k")


def test_apply_sets_nested_tables_and_the_dataclass_validates() -> None:
    out = apply(Outer(), {"count": "5", "inner": {"fraction": "0.25"},
                          "maybe": {"mode": "final"}, "ladder": [4, 8]})
    assert out == Outer(count=5, inner=Inner(0.25), maybe=Inner(mode="final"), ladder=(4, 8))
    assert apply(out, {"maybe": "none"}).maybe is None
    with pytest.raises(SettingsError, match=r"unknown setting 'inner\.fractoin'; Inner has "
                                            r"fraction, mode"):
        apply(Outer(), {"inner": {"fractoin": "1"}})
    with pytest.raises(SettingsError, match=r"inner: fraction must be in \(0, 1\], got 2\.0"):
        apply(Outer(), {"inner": {"fraction": "2"}})


@pytest.mark.parametrize("target", [
    Outer(),
    Outer(count=5, ratio=0.125, on=False, label="x", ladder=(4, 8, 16)),
    Outer(inner=Inner(0.25, "final")),
    Outer(maybe=Inner()),  # a table switched on at its defaults
    Outer(maybe=Inner(mode="final")),
])
def test_override_items_name_what_differs_and_apply_back(target: Outer) -> None:
    for base in (Outer(), Outer(label="y", maybe=Inner(0.5), inner=Inner(mode="final"))):
        items = override_items(target, base, "x.")
        assert all(item.startswith("x.") for item in items)
        assert apply(base, parse_overrides(items)["x"] if items else {}) == target
    assert override_items(Outer(), Outer()) == []
    assert override_items(Outer(ladder=[1, 2]), Outer()) == []  # type: ignore[arg-type]
    assert override_items(Outer(count=5, inner=Inner(0.25)), Outer()) == [
        "count=5", "inner.fraction=0.25"]
    assert override_items(Outer(), Outer(maybe=Inner())) == ["maybe=none"]


def test_override_items_refuse_two_kinds() -> None:
    with pytest.raises(SettingsError, match="two instances of one dataclass"):
        override_items(Outer(), Inner())


def test_overrides_nest_by_dots_and_refuse_repeats_and_clashes() -> None:
    assert parse_overrides(["a.b.c=1", "a.d = x", "e=2"]) == {"a": {"b": {"c": "1"}, "d": "x"},
                                                              "e": "2"}
    for bad, message in [(["a.b=1", "a.b=2"], "'a.b' given twice"),
                         (["a=1", "a.b=2"], "a is set as a value and as a table"),
                         (["novalue"], "KEY=VALUE"), (["a..b=1"], "KEY=VALUE"),
                         (["=1"], "KEY=VALUE")]:
        with pytest.raises(SettingsError, match=re.escape(message)):
            parse_overrides(bad)


def test_flags_derive_from_the_fields() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, Outer, exclude=("inner", "maybe"), prefix="x_")
    args = parser.parse_args(["--x-count", "9", "--no-x-on", "--x-ladder", "4,8"])
    assert from_flags(Outer, args, exclude=("inner", "maybe"), prefix="x_") == Outer(
        count=9, on=False, ladder=(4, 8))
    assert "how many, an integer spread over two docstring lines" in parser.format_help()
    assert field_docs(Outer)["count"] == "how many, an integer spread over two docstring lines."
    with pytest.raises(SystemExit):
        parser.parse_args(["--x-count", "nine"])
    with pytest.raises(SettingsError, match="is a table"):
        add_flags(argparse.ArgumentParser(), Outer)


def test_settings_files_are_toml(tmp_path: Path) -> None:
    good = tmp_path / "c.toml"
    good.write_text('controller = "fixed:256"\nname = "deadline-256"\norder = "deadline"\n'
                    '[guard]\np99 = false\n[guard.kv_budget]\nfraction = 0.8\n')
    assert load_settings_file(good)["guard"] == {"p99": False, "kv_budget": {"fraction": 0.8}}
    controller = make_controller(str(good))
    assert isinstance(controller, FixedController) and controller.name == "deadline-256"
    assert controller.discipline == AdmissionDiscipline("deadline", KvBudget(0.8))
    assert not controller.guard.config.p99
    # a bracket on a file overrides it, and the name then says so
    over = make_controller(f"{good}[guard.kv_budget.fraction=0.5]")
    assert over.discipline.kv_budget == KvBudget(0.5) and over.name.endswith("[guard.kv_budget"
                                                                            ".fraction=0.5]")
    twice = tmp_path / "twice.toml"
    twice.write_text('controller = "mpc"\nhorizon_s = 10\nhorizon_s = 20\n')
    for path, message in [(twice, "twice.toml"), (tmp_path / "none.toml", "none.toml"),
                          (good.with_name("bad.toml"), "'controller' must name a preset")]:
        if path.name == "bad.toml":
            path.write_text('order = "fifo"\n')
        with pytest.raises(SettingsError, match=re.escape(message)):
            make_controller(str(path))


def test_specs_split_expand_and_take_overrides() -> None:
    assert controller_specs("static:{4,8},fixed:{64,128}[order=deadline,guard.ladder=4,8],mpc") \
        == ["static:4", "static:8", "fixed:64[order=deadline,guard.ladder=4,8]",
            "fixed:128[order=deadline,guard.ladder=4,8]", "mpc"]
    parsed = parse_spec("fixed:64[order=deadline,guard.ladder=4,8]")
    assert parsed.preset == "fixed:64"
    assert parsed.settings == {"order": "deadline", "guard": {"ladder": "4,8"}}
    assert with_overrides("fixed:64", ["order=deadline"]) == "fixed:64[order=deadline]"
    assert with_overrides("mpc[every_s=5]", ["guarded=false"]) == "mpc[every_s=5,guarded=false]"
    assert with_overrides("static:8", []) == "static:8"
    with pytest.raises(SettingsError, match="'order' given twice"):
        with_overrides("fixed:64[order=fifo]", ["order=deadline"])
    assert spec_preset("ppo:a/b[order=fifo]") == "ppo:a/b"
    for bad in ("fixed:64[order=fifo", "fixed[64]:x", "fixed:64[a=1][b=2]"):
        with pytest.raises(SettingsError, match="brackets"):
            parse_spec(bad)


@pytest.mark.parametrize(("spec", "kind"), [
    ("fixed:64[guard.ladder=4,8,16,32,64]", FixedController),
    ("ppo:policies/default[guard.max_total_cap=128]", PpoController),
    ("mpc[totals=8,16,32,horizon_s=20]", MpcController),
])
def test_every_controller_kind_takes_typed_settings(spec: str, kind: type) -> None:
    controller = make_controller(spec)
    assert isinstance(controller, kind) and controller.name == spec
    assert controller.pipeline is not None


def test_ppo_guard_settings_change_the_recorded_guard_not_the_default() -> None:
    recorded = make_controller("ppo:policies/default")
    changed = make_controller("ppo:policies/default[guard.p99=false]")
    assert recorded.pipeline is not None and changed.pipeline is not None
    assert changed.pipeline.config.ladder == recorded.pipeline.config.ladder
    assert changed.pipeline.config.max_cap == 256 and not changed.pipeline.config.p99
    assert changed.guard_warnings == ["p99: True recorded, False in force"]  # type: ignore[attr-defined]


def test_settings_errors_name_the_controller_and_the_key() -> None:
    cases = [("static:16[order=deadline]", "static:N takes no settings"),
             ("vllm-default[a=1]", "vllm-default takes no settings"),
             ("playbook[short_cap=x]", "playbook: short_cap takes an integer"),
             ("aimd[guard.p99_fallback=none]", "aimd: guard.p99_fallback takes proportional"),
             ("random:2[ladder=1]", "random:2: unknown setting 'ladder'; GuardSettings has "
                                    "guard"),
             ("mpc[totals=3]", "mpc totals must be on the codec's ladder"),
             ("ppo:policies/default[release.wait_fraction=0]", "wait_fraction must be > 0"),
             ("ppo:policies/default[release=off]", "none turns it off"),
             ("fixed:64[guarded=false,guard.p99=false]", "its guard.* settings would be "
                                                         "ignored"),
             ("mpc[horizon_s=0]", "horizon_s, every_s and window_s must be > 0"),
             ("fixed:64[guard.kv_budget.fraction=2]", "guard.kv_budget: fraction must be in")]
    for spec, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            make_controller(spec)
    assert make_controller("playbook[long_cap=4]").guard.config == GuardConfig(  # type: ignore[attr-defined]
        p99_fallback="no_batching", kv_budget=KvBudget(commit="final"))


def test_nan_is_refused_from_a_file_as_from_text() -> None:
    for value in (math.nan, "nan"):
        with pytest.raises(SettingsError, match="k takes a number"):
            convert(float, value, "k")


def test_a_policy_folder_named_like_a_settings_file_is_a_preset() -> None:
    parsed = parse_spec("ppo:/srv/policies/v1.toml[order=fifo]")
    assert (parsed.preset, dict(parsed.settings)) == ("ppo:/srv/policies/v1.toml",
                                                      {"order": "fifo"})


def test_a_factory_that_builds_no_controller_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlbatch.control import controllers

    monkeypatch.setitem(controllers.BUILTIN_CONTROLLERS, "odd", lambda arg, settings: object())
    with pytest.raises(TypeError, match=re.escape("not a rlbatch.control.controllers.Controller")):
        make_controller("odd")
