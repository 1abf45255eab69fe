"""What a policy artifact records of the guard it is served behind, and the check at serving.

A policy learns to act through the guard: the guard's rules are part of the environment it
was trained in, and its figures hold behind the guard they were measured behind only. When
the P99 rule changed, the two-pool policy trained behind the previous rule fell from 1.03x
to 0.76x the best static without anything saying so. The artifact therefore
records the guard's configuration and :data:`GUARD_REVISION` (written at training, the
guard it was trained and selected behind); serving rebuilds that configuration and warns
when the guard in force differs from it. An artifact re-measured behind a later guard
records that guard, and the one it was trained behind under ``guard_trained``.

A record whose revision is under 9 has no ``kv_commit``: its KV budget counted the sum of the
counts, so it is rebuilt with ``kv_commit="final"``, not today's default. A record spells the
KV budget as three flat keys (``kv_budget``, ``kv_budget_fraction``, ``kv_commit``), as every
shipped artifact does; :class:`~rlbatch.control.discipline.KvBudget` is what they become.
A record with the ``tpot_fit`` rule on but without ``tpot_fit_calibrated`` or
``tpot_fit_spread`` is rebuilt with them off (the rule had neither then), not with today's
defaults; a record with the rule off is rebuilt with today's settings of the rule (they never
acted), and they are not compared while the rule is off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields

from rlbatch.control.discipline import KvBudget
from rlbatch.control.guard import GuardConfig

GUARD_REVISION = 11
"""Bumped whenever a rule behaves differently under the same configuration (8: the P99 trim
serves a steady share of long prompts; 9: the KV budget holds the peak of the projected KV,
``kv_commit``; 10: the P99 trim's "the batch is too slow" test reads the mean step weighted
by iterations, not the mean of each tick's; 11: the rules that scale what is in force scale it
as it stood before the ``tpot_fit`` ceiling). CHANGELOG.md has the history."""


TPOT_FIT_SETTINGS = ("tpot_fit_margin", "tpot_fit_calibrated", "tpot_fit_spread")
"""The ``tpot_fit`` rule's settings: they matter only where the rule is on."""

_BUDGET_KEYS = ("kv_budget", "kv_budget_fraction", "kv_commit")
"""How a record spells the KV budget (:class:`~rlbatch.control.discipline.KvBudget`): the
flat keys every shipped artifact carries, so records stay readable both ways."""


def guard_record(config: GuardConfig) -> dict[str, object]:
    """``config``'s fields, JSON-ready, and ``revision``: :data:`GUARD_REVISION`."""
    record: dict[str, object] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name == "kv_budget":
            budget = value or KvBudget()
            record.update(kv_budget=value is not None, kv_budget_fraction=budget.fraction,
                          kv_commit=budget.commit)
            continue
        record[f.name] = list(value) if isinstance(value, tuple) else value
    record["revision"] = GUARD_REVISION
    return record


def guard_from_record(record: Mapping[str, object]) -> GuardConfig:
    """The configuration :func:`guard_record` wrote (``revision`` aside: see
    :func:`record_mismatch`); a field missing from the record takes its default, except
    ``kv_commit`` in a record whose revision is under 9 (``final``, the rule then) and the
    ``tpot_fit`` rule's calibration and spread in a record with the rule on (off, as then);
    with the rule off its recorded settings give way to today's.

    :param record: the recorded dict.
    :raises ValueError: a field this version does not know, or an invalid value.
    """
    known = {f.name for f in fields(GuardConfig)} | set(_BUDGET_KEYS)
    unknown = sorted(set(record) - known - {"revision"})
    if unknown:
        raise ValueError(f"the recorded guard has fields this rlbatch does not know: {unknown} "
                         f"(written by a newer version?)")
    values = {k: tuple(v) if isinstance(v, list) else v
              for k, v in record.items() if k in known and k not in _BUDGET_KEYS}
    default = KvBudget()
    commit = record.get("kv_commit", default.commit)
    revision = record.get("revision")
    if "kv_commit" not in record and isinstance(revision, int) and revision < 9:
        commit = "final"  # the only count under revisions before 9
    fraction = record.get("kv_budget_fraction", default.fraction)
    if not isinstance(fraction, int | float) or isinstance(fraction, bool):
        raise ValueError(f"kv_budget_fraction must be a number, got {fraction!r}")
    try:
        budget = KvBudget(float(fraction), commit)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"kv_budget_fraction / kv_commit: {exc}") from None
    values["kv_budget"] = budget if record.get("kv_budget", True) else None
    if values.get("tpot_fit") is True:
        # the rule's calibration and spread came after it: a policy trained behind the rule
        # without them is rebuilt as it was trained, whatever today's defaults
        values.setdefault("tpot_fit_calibrated", False)
        values.setdefault("tpot_fit_spread", 0.0)
    else:  # settings of a rule that never acted: turned on later, it takes today's
        for key in TPOT_FIT_SETTINGS:
            values.pop(key, None)
    return GuardConfig(**values)  # type: ignore[arg-type]


def record_mismatch(record: Mapping[str, object], config: GuardConfig) -> list[str]:
    """How ``config`` under this version's rules differs from a recorded guard: one line per
    difference; empty when they are the same.

    :param record: a :func:`guard_record` dict.
    :param config: the guard in force.
    """
    out: list[str] = []
    revision = record.get("revision")
    if revision != GUARD_REVISION:
        out.append(f"guard revision {revision} recorded, this rlbatch's rules are revision "
                   f"{GUARD_REVISION}")
    try:  # a field the record lacks was its default then: a rule added since is off there
        recorded: Mapping[str, object] = {**guard_record(guard_from_record(record)), **record}
    except (TypeError, ValueError):
        recorded = record
    rule_off = not config.tpot_fit and recorded.get("tpot_fit") is not True
    for key, value in guard_record(config).items():
        if key == "revision" or (rule_off and key in TPOT_FIT_SETTINGS):
            continue
        if key in recorded and recorded[key] != value:
            out.append(f"{key}: {recorded[key]!r} recorded, {value!r} in force")
    return out
