"""A policy artifact records the guard it was trained behind; serving rebuilds and checks it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from policies.artifact import ArtifactError, load_artifact
from policies.ppo import PpoController, artifact_guard
from rlbatch.control.action_codec import TOTAL_LADDER
from rlbatch.control.discipline import KvBudget
from rlbatch.control.guard import GuardConfig
from rlbatch.control.guard_record import (
    GUARD_REVISION,
    guard_from_record,
    guard_record,
    record_mismatch,
)

SHIPPED = Path(__file__).resolve().parents[1] / "policies"


@pytest.mark.parametrize("config", [
    GuardConfig(),
    GuardConfig(ladder=TOTAL_LADDER, p99_surge_ratio=0.0, p99_metrics=("ttft", "tpot"),
                p99_fallback="no_batching", max_seq_len=4096, kv_budget=None),
    GuardConfig(kv_budget=KvBudget(0.8, "final")),
])
def test_record_round_trips_through_json(config: GuardConfig) -> None:
    record = json.loads(json.dumps(guard_record(config)))
    assert record["revision"] == GUARD_REVISION
    assert guard_from_record(record) == config
    assert record_mismatch(record, config) == []


@pytest.mark.parametrize("revision, expected", [(8, "final"), (9, "peak"), (None, "peak")])
def test_a_record_without_kv_commit_keeps_the_count_of_its_revision(
        revision: int | None, expected: str) -> None:
    # before revision 9 the KV budget could only count the sum: an old artifact is not
    # served behind a rule it never saw
    record = guard_record(GuardConfig())
    del record["kv_commit"]
    record["revision"] = revision
    budget = guard_from_record(record).kv_budget
    assert budget is not None and budget.commit == expected


def test_mismatch_names_each_difference() -> None:
    record = guard_record(GuardConfig(p99_surge_ratio=0.0))
    record["revision"] = GUARD_REVISION - 1
    lines = record_mismatch(record, GuardConfig(kv_budget=None))
    assert lines == [
        f"guard revision {GUARD_REVISION - 1} recorded, this rlbatch's rules are revision "
        f"{GUARD_REVISION}",
        "p99_surge_ratio: 0.0 recorded, 2.0 in force",
        "kv_budget: True recorded, False in force",
    ]


def test_unknown_or_invalid_fields_are_refused() -> None:
    with pytest.raises(ValueError, match=r"does not know: \['p99_magic'\]"):
        guard_from_record({**guard_record(GuardConfig()), "p99_magic": 1})
    with pytest.raises(ValueError, match="kv_budget_fraction"):
        guard_from_record({"kv_budget_fraction": 2.0})


def _with_guard(src: Path, dst: Path, record: object) -> Path:
    dst.mkdir(parents=True)
    (dst / "policy.safetensors").write_bytes((src / "policy.safetensors").read_bytes())
    meta = json.loads((src / "policy.json").read_text())
    if record is None:
        meta.pop("guard", None)
    else:
        meta["guard"] = record
    (dst / "policy.json").write_text(json.dumps(meta))
    return dst


def test_serving_uses_the_recorded_guard_and_warns_on_another(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trained = GuardConfig(ladder=TOTAL_LADDER, p99_surge_ratio=0.0)
    path = _with_guard(SHIPPED / "default", tmp_path / "p", guard_record(trained))
    artifact = load_artifact(path)
    assert artifact_guard(artifact) == trained
    with caplog.at_level(logging.WARNING, logger="policies.ppo"):
        same = PpoController(artifact, name="same")
        assert same.guard.config == trained and same.guard_warnings == []
        other = PpoController(artifact, name="other", guard=GuardConfig(ladder=TOTAL_LADDER))
    assert other.guard_warnings == ["p99_surge_ratio: 0.0 recorded, 2.0 in force"]
    assert [r.getMessage() for r in caplog.records] == [
        "other: p99_surge_ratio: 0.0 recorded, 2.0 in force"]


def test_artifact_without_a_record_is_served_with_a_warning(tmp_path: Path) -> None:
    artifact = load_artifact(_with_guard(SHIPPED / "default", tmp_path / "p", None))
    controller = PpoController(artifact)
    assert controller.guard.config == GuardConfig(ladder=TOTAL_LADDER)
    assert len(controller.guard_warnings) == 1
    assert "does not record the guard" in controller.guard_warnings[0]


def test_a_corrupt_record_fails_clearly(tmp_path: Path) -> None:
    artifact = load_artifact(_with_guard(SHIPPED / "default", tmp_path / "p",
                                         {"ladder": [4, 2]}))
    with pytest.raises(ArtifactError, match="recorded guard: ladder must be strictly"):
        PpoController(artifact)


@pytest.mark.parametrize("artifact", ["policies/default", "policies/seeds/seed1",
                                      "policies/seeds/seed2", "policies/two-pool"])
def test_shipped_policies_record_the_guard_they_are_served_behind(artifact: str) -> None:
    # their EVAL.md figures are measured behind this rlbatch's rules (the peak KV budget)
    path = Path(__file__).resolve().parents[1] / artifact
    controller = PpoController(load_artifact(path))
    assert controller.guard_warnings == []
    assert controller.guard.config.kv_budget == KvBudget(1.0, "peak")
