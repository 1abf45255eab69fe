"""What a policy artifact records of the guard it is served behind, and the check at serving.

A policy learns to act through the guard: the guard's rules are part of the environment it
was trained in, and its figures hold behind the guard they were measured behind only. Issue
14 (stop 8) changed the P99 rule, and the two-pool policy trained behind the previous rule
fell from 1.03x to 0.76x the best static without anything saying so. The artifact therefore
records the guard's configuration and :data:`GUARD_REVISION` (written at training, the
guard it was trained and selected behind); serving rebuilds that configuration and warns
when the guard in force differs from it. An artifact re-measured behind a later guard
records that guard, and the one it was trained behind under ``guard_trained`` (stop 20).

A record from before revision 9 has no ``kv_commit``: its KV budget counted the sum of the
counts, so it is rebuilt with ``kv_commit="final"``, not today's default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields

from rlbatch.control.guard import GuardConfig

GUARD_REVISION = 10
"""Bumped whenever a rule behaves differently under the same configuration (8: the P99 trim
serves a steady share of long prompts, BENCHMARKS.md issue 14, stop 8; 9: the KV budget holds
the peak of the projected KV, ``kv_commit``, stop 20; 10: the P99 trim's "the batch is too
slow" test reads the mean step weighted by iterations, not the mean of each tick's, stop 25)."""


def guard_record(config: GuardConfig) -> dict[str, object]:
    """``config``'s fields, JSON-ready, and ``revision``: :data:`GUARD_REVISION`."""
    record: dict[str, object] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        record[f.name] = list(value) if isinstance(value, tuple) else value
    record["revision"] = GUARD_REVISION
    return record


def guard_from_record(record: Mapping[str, object]) -> GuardConfig:
    """The configuration :func:`guard_record` wrote (``revision`` aside: see
    :func:`record_mismatch`); a field missing from the record takes its default, except
    ``kv_commit`` before revision 9 (``final``, the rule then).

    :param record: the recorded dict.
    :raises ValueError: a field this version does not know, or an invalid value.
    """
    known = {f.name for f in fields(GuardConfig)}
    unknown = sorted(set(record) - known - {"revision"})
    if unknown:
        raise ValueError(f"the recorded guard has fields this rlbatch does not know: {unknown} "
                         f"(written by a newer version?)")
    values = {k: tuple(v) if isinstance(v, list) else v
              for k, v in record.items() if k in known}
    revision = record.get("revision")
    if "kv_commit" not in values and isinstance(revision, int) and revision < 9:
        values["kv_commit"] = "final"  # the only count before revision 9
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
    for key, value in guard_record(config).items():
        if key != "revision" and key in record and record[key] != value:
            out.append(f"{key}: {record[key]!r} recorded, {value!r} in force")
    return out
