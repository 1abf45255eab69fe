"""Selection at the knee: validation rates where the training traffic is contested."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from policies.evaluation.compare import CONTESTED
from policies.training.recipe import RecipeConfig
from policies.training.selection import (
    SELECTION_STATICS,
    knee_selection_rates,
    validation_workloads,
)
from rlbatch.control.controllers import make_controller
from rlbatch.serving.run import run


@pytest.fixture(scope="module")
def head_trace(tmp_path_factory: pytest.TempPathFactory, azure_trace: Path) -> Path:
    # The first ~10 minutes of the Azure trace (a 7.5 min training window): one A100 serves
    # it with every request in the SLA at rate 1, contested at 2-32, collapsed at 64.
    path = tmp_path_factory.mktemp("trace") / "azure_head.csv"
    path.write_text("".join(azure_trace.read_text().splitlines(keepends=True)[:301]))
    return path


def _best_sla(cfg: RecipeConfig, trace: Path, rate: float) -> float:
    w = validation_workloads(cfg, {str(trace): (rate,)})[0][2]
    rows = [run(w, make_controller(s), cfg.spec()).row for s in SELECTION_STATICS]
    return float(max(rows, key=lambda r: float(r["goodput_rps"]))["sla_attainment"])


def test_knee_keeps_contested_scales_evenly_spread_and_stops_past_the_knee(
        head_trace: Path) -> None:
    cfg = RecipeConfig(traces=(str(head_trace),), deployments=(), rate_scale=2.0)
    # x2: 1 light, 2-32 contested, 64 collapsed; the scan stops there (the contested 3 after
    # it is never run, else the picks would be 2, 4, 32)
    rates, rows = knee_selection_rates(cfg, str(head_trace), count=3,
                                       scan=(0.5, 1, 2, 4, 8, 16, 32, 1.5))
    assert rates == [2.0, 8.0, 32.0]
    assert _best_sla(cfg, head_trace, 1.0) > CONTESTED[1]
    assert _best_sla(cfg, head_trace, 64.0) < CONTESTED[0]
    for rate in rates:  # the rows handed to selection are those of a fresh run
        w = validation_workloads(cfg, {str(head_trace): (rate,)})[0][2]
        fresh = [run(w, make_controller(s), cfg.spec()).row for s in SELECTION_STATICS]
        assert [r["goodput_rps"] for r in rows[rate]] == [r["goodput_rps"] for r in fresh]
        assert CONTESTED[0] <= _best_sla(cfg, head_trace, rate) <= CONTESTED[1]


def test_knee_refuses_traffic_that_is_never_contested(head_trace: Path) -> None:
    cfg = RecipeConfig(traces=(str(head_trace),), deployments=())
    with pytest.raises(ValueError, match="contested"):
        knee_selection_rates(cfg, str(head_trace), scan=(0.5, 1.0))


def test_validation_at_the_knee_replaces_only_the_first_deployments_rates(
        head_trace: Path) -> None:
    cfg = RecipeConfig(traces=(str(head_trace),), deployments=("h100-80g/llama-2-7b",),
                       selection_rates=(0.6, 0.7, 0.8), selection_knee=True)
    items = validation_workloads(cfg, {str(head_trace): (3.0, 5.0)})
    assert [(name.rpartition("@")[2], d) for name, d, _ in items] == [
        ("3", 0), ("5", 0), (f"{0.7 * cfg.multiplier(1):g} on h100-80g/llama-2-7b", 1)]


def test_mixed_windows_are_added_only_when_asked_and_are_the_same_every_time(
        head_trace: Path) -> None:
    cfg = RecipeConfig(traces=(str(head_trace),), deployments=("h100-80g/llama-2-7b",),
                       selection_rates=(0.6, 0.7, 0.8))
    plain = validation_workloads(cfg)
    assert not any(name.endswith("mixed") for name, _, _ in plain)
    mixed_cfg = replace(cfg, selection_mixes=True)
    items = validation_workloads(mixed_cfg)
    extra = [item for item in items if item[0].endswith("mixed")]
    assert [(name, d) for name, d, _ in extra] == [(f"{plain[1][0]} mixed", 0)]
    assert [(n, d) for n, d, _ in items if not n.endswith("mixed")] == [
        (n, d) for n, d, _ in plain]
    window = extra[0][2]
    # equal bucket shares drawn from a short-heavy window: long prompts far above its share
    long_share = sum(r.prompt_tokens >= 4096 for r in window.requests) / len(window)
    source = plain[1][2]
    assert long_share > max(0.1, 2 * sum(r.prompt_tokens >= 4096 for r in source.requests)
                            / len(source))
    again = next(w for n, _, w in validation_workloads(mixed_cfg) if n.endswith("mixed"))
    assert again.requests == window.requests
