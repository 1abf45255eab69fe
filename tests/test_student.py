"""The student's action space and observation, its artifact, behaviour cloning, and the
evaluation protocol's judging rules."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import envs
from envs.batch_size import BatchSizeEnv
from policies.artifact import ArtifactError, copy_artifact, load_artifact
from policies.evaluation.protocol import judge, user_pick
from policies.ppo import PpoController
from policies.training.distill import Demonstrations, action_accuracy, fit_policy, student_labeller
from policies.training.finetune import ClipObservation
from policies.training.recipe import Recipe, RecipeConfig, build_student, export_student
from rlbatch.control.action_codec import SHARE_LADDER, TOTAL_LADDER, TotalShareCodec, make_codec
from rlbatch.control.controllers import make_controller
from rlbatch.control.observation import OBS_VERSIONS, feature_names, observation_size
from rlbatch.control.types import ControlAction
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload.scenarios import make_scenario

CODEC = TotalShareCodec(TOTAL_LADDER, SHARE_LADDER, ("fp16", "fp8"), 4)


def test_total_share_decodes_total_and_shares() -> None:
    action = CODEC.decode([11, 3, 0, 2, 1, 1, 0, 0, 1])
    assert action == ControlAction((None, 128, 64, 32), ("fp16", "fp8", "fp16", "fp8"), 256)
    assert CODEC.decode([0, 0, 0, 0, 0, 0, 0, 0, 0]).caps == (1, 1, 1, 1)


@pytest.mark.parametrize("total,caps", [(64, (None, None, 16, 8)), (4, (None, 2, 1, 1)),
                                        (256, (None, 128, 64, 32))])
def test_total_share_round_trips(total: int, caps: tuple[int | None, ...]) -> None:
    action = ControlAction(caps, ("fp16",) * 4, total)
    assert CODEC.decode(CODEC.encode(action)) == action


def test_static_cap_is_expressible() -> None:
    """static:N (no per-bucket cap, total N) is an action of the student."""
    encoded = CODEC.encode(ControlAction((None,) * 4, ("fp16",) * 4, 48))
    assert CODEC.decode(encoded) == ControlAction((None,) * 4, ("fp16",) * 4, 48)


@pytest.mark.parametrize("action,message", [
    ([12, 0, 0, 0, 0, 0, 0, 0, 0], "total index 12"),
    ([0, 4, 0, 0, 0, 0, 0, 0, 0], "share index 4"),
    ([0, 0, 3, 0, 0, 0, 0, 0, 0], "pool index 3"),
    ([0, 0, 0], "shape"),
    ([0.5, 0, 0, 0, 0, 0, 0, 0, 0], "integers"),
])
def test_total_share_rejects_bad_actions(action: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CODEC.decode(np.array(action))


def test_make_codec_names_kinds() -> None:
    with pytest.raises(ValueError, match="unknown action kind"):
        make_codec("both", ladder=(1, 2), pools=("fp16",), num_buckets=1)


def test_observation_v2_adds_named_trends() -> None:
    names = feature_names(("a", "b"), 2)
    assert len(names) == observation_size(2, 2) == observation_size(2, 1) + 3 * 2 + 4
    assert names[-4:] == ["running_total", "total_cap", "load_ratio", "doomed_rate"]


def test_decision_ticks_hold_the_action() -> None:
    env = gym.make(envs.ENV_ID, scenario="day", episode_s=60.0, drain_s=10.0,
                   action_kind="total_share", obs_version=2, decision_ticks=4).unwrapped
    assert isinstance(env, BatchSizeEnv)
    env.reset(seed=0)
    _obs, _r, _t, _tr, info = env.step(env.action_space.sample())
    assert info["time_s"] == pytest.approx(4.0)
    assert env.guard.config.max_cap == 256


def _tiny_cfg(tmp_path: Path) -> RecipeConfig:
    return RecipeConfig(out=str(tmp_path), net_arch=(16,), epochs=30)


def test_behaviour_cloning_fits_a_consistent_teacher(tmp_path: Path) -> None:
    """A teacher that maps a feature to the total index is learned exactly."""
    cfg = _tiny_cfg(tmp_path)
    size = observation_size(4, 2)
    policy = build_student(cfg, CODEC, size)
    rng = np.random.default_rng(0)
    obs = rng.uniform(0, 1, size=(400, size)).astype(np.float32)
    actions = np.zeros((400, len(CODEC.nvec)), dtype=np.int64)
    actions[:, 0] = np.where(obs[:, 0] > 0.5, 7, 3)
    actions[:, 1::2] = 3
    demos = Demonstrations(obs, actions)
    before = action_accuracy(policy, demos)
    losses = fit_policy(policy, demos, epochs=300, batch_size=32, learning_rate=3e-3)
    assert losses[-1] < losses[0]
    assert before < 0.1 and action_accuracy(policy, demos) >= 0.95


@pytest.mark.parametrize("obs_version", [3, 4])
def test_student_artifact_serves_like_the_network(tmp_path: Path, obs_version: int) -> None:
    cfg = replace(_tiny_cfg(tmp_path), obs_version=obs_version)
    one_pool = TotalShareCodec(TOTAL_LADDER, SHARE_LADDER, ("fp16",), 4)
    policy = build_student(cfg, one_pool, observation_size(4, cfg.obs_version))
    meta = export_student(policy, cfg, one_pool, tmp_path / "student")
    artifact = load_artifact(meta)
    assert artifact.metadata["action_kind"] == "total_share"
    obs = np.random.default_rng(1).uniform(0, 1, size=(8, artifact.obs_size)).astype(np.float32)
    import torch

    with torch.no_grad():
        mode = policy.get_distribution(torch.as_tensor(obs)).mode().numpy()
    np.testing.assert_array_equal(artifact.act(obs), mode)
    controller = PpoController(artifact, name="student")
    workload = make_scenario("day", seed=0, duration_s=30.0)
    row = run(workload, controller, DeploymentSpec(), drain_s=30.0).row
    assert row["completed"] + row["rejected"] + row["unfinished"] == len(workload)
    assert controller.guard.config.max_cap == 256
    # the recipe records the guard the student acted behind; serving rebuilds it, silently
    assert artifact.metadata["guard"]["ladder"] == list(TOTAL_LADDER)
    assert controller.guard_warnings == []
    assert artifact.metadata["obs_version"] == obs_version
    assert len(artifact.metadata["feature_names"]) == observation_size(4, obs_version)


def test_recipe_refuses_an_unknown_observation_version() -> None:
    with pytest.raises(ValueError, match="obs_version must be one of"):
        RecipeConfig(obs_version=max(OBS_VERSIONS) + 1)
    RecipeConfig(obs_version=max(OBS_VERSIONS))


def _row(controller: str, trace: str, rate: float, goodput: float, sla: float,
         per_bucket: dict[str, float] | None = None, overflows: int = 0) -> dict[str, Any]:
    buckets = per_bucket or {"a": sla}
    return {"controller": controller, "trace": trace, "rate_scale": rate,
            "goodput_rps": goodput, "sla_attainment": sla, "kv_overflows": overflows,
            "per_bucket": {b: {"sla_attainment": v, "completed": 10, "rejected": 0}
                           for b, v in buckets.items()}}


def test_user_pick_ignores_collapsed_training_runs() -> None:
    rows = [_row("static:64", "t", 1.0, 3.0, 0.9), _row("static:128", "t", 1.0, 2.0, 0.8),
            # collapsed: the best static meets the SLA for < 20%; static:128 would win it
            _row("static:64", "t", 2.0, 0.1, 0.05), _row("static:128", "t", 2.0, 5.0, 0.1)]
    rows += [_row(f"static:{n}", "t", r, 0.0, 0.0) for n in (4, 8, 16, 32, 256)
             for r in (1.0, 2.0)]
    assert user_pick(rows) == "static:64"


def test_judge_fails_a_starving_candidate() -> None:
    rows = [_row("static:64", "u", 1.0, 2.0, 0.5, {"a": 0.5, "b": 0.5}),
            _row("playbook", "u", 1.0, 1.0, 0.3),
            _row("cand", "u", 1.0, 2.2, 0.55, {"a": 0.9, "b": 0.2})]
    result = judge(rows, "cand", "static:64")
    assert result["summary"]["vs_best_static_gmean"] == pytest.approx(1.1)
    assert result["summary"]["runs_with_starved_bucket"] == 1
    assert result["summary"]["must_met"] is False
    fair = [*rows[:2], _row("cand", "u", 1.0, 2.4, 0.6, {"a": 0.6, "b": 0.5})]
    assert judge(fair, "cand", "static:64")["summary"]["must_met"] is True
    assert not math.isnan(judge(fair, "cand", "static:64")["summary"]["vs_playbook_gmean"])


def test_starved_buckets_name_their_gap_in_requests() -> None:
    from policies.evaluation.compare import starved_shortfalls

    best = _row("static:64", "u", 1.0, 2.0, 0.5, {"a": 0.5, "b": 0.9})
    best["per_bucket"]["b"].update(completed=70, rejected=4)
    mine = _row("cand", "u", 1.0, 2.0, 0.5, {"a": 0.46, "b": 0.81})
    # a: 4 points under, not starved; b: 9 points of 74 decided requests = 7 requests
    assert starved_shortfalls(mine, best) == ["b (7 of 74)"]
    assert starved_shortfalls(best, best) == []


def test_mpc_teacher_exposes_its_proposal() -> None:
    teacher = make_controller("mpc")
    assert teacher.reports_proposals
    assert not make_controller("playbook").reports_proposals


def test_rate_multiplier_scales_every_protocol_run() -> None:
    from policies.evaluation.protocol import deployment_rate_scale, training_runs, unseen_runs

    base, scaled = unseen_runs(), unseen_runs(2.5)
    assert [r.rates for r in scaled] == [tuple(round(x * 2.5, 6) for x in r.rates)
                                         for r in base]
    assert [r.window for r in scaled] == [r.window for r in base]
    assert training_runs(2.0)[0].rates == (1.0, 1.5, 1.8, 2.0)
    assert deployment_rate_scale("a100-80g", "llama-2-7b", {"fp16": 1, "fp8": 1}) == 2.5
    assert deployment_rate_scale("a100-80g", "llama-2-7b", {"fp16": 1}) == 1.0
    assert deployment_rate_scale("h100-80g", "llama-2-7b", {"fp16": 1}) == 2.0
    assert deployment_rate_scale("a100-80g", "llama-2-7b", {"fp16": 3}) == 1.0  # not measured
    with pytest.raises(ValueError, match="rate multiplier"):
        unseen_runs(0.0)


def test_mooncake_multiplier_scales_only_the_mooncake_runs() -> None:
    from policies.evaluation.protocol import mooncake_rate_scale_for, unseen_runs

    base, split = unseen_runs(5.0), unseen_runs(5.0, 0.4)
    assert split[0] == base[0]  # the Azure runs keep the rate multiplier
    assert split[1].name == "mooncake" and split[1].rates == (0.2, 0.24, 0.3)
    assert unseen_runs(5.0, None) == base
    assert mooncake_rate_scale_for("h200-141g", "llama-3.1-8b", {"fp16": 1}) == 0.4
    assert mooncake_rate_scale_for("a100-80g", "llama-2-7b", {"fp16": 1}) is None
    with pytest.raises(ValueError, match="rate multiplier"):
        unseen_runs(1.0, 0.0)


def test_protocol_refuses_a_bad_mooncake_multiplier(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    from policies.evaluation.protocol import main

    with pytest.raises(SystemExit):
        main(["--controllers", "fixed:256", "--mooncake-rate-scale", "-1"])
    assert "--mooncake-rate-scale must be > 0" in capsys.readouterr().err


def test_recipe_rate_multiplier_scales_training_workloads() -> None:
    from policies.training.episodes import sample_workloads
    from rlbatch.workload import load_trace

    traces = [load_trace(t) for t in RecipeConfig().traces]
    one = sample_workloads(RecipeConfig(generated_share=0.0), np.random.default_rng(3), 3,
                           traces)
    two = sample_workloads(RecipeConfig(generated_share=0.0, rate_scale=2.0),
                           np.random.default_rng(3), 3, traces)
    for a, b in zip(one, two, strict=True):
        assert len(b) > len(a)  # the same draws at twice the rate: a longer stretch of trace
    with pytest.raises(ValueError, match="rate_scale"):
        RecipeConfig(rate_scale=0.0)


def test_unseen_run_finds_a_run_by_label_prefix() -> None:
    from policies.evaluation.protocol import run_label, unseen_run

    found = unseen_run("mooncake", "a100-80g", "llama-2-7b", {"fp16": 1, "fp8": 1})
    assert run_label(found).startswith("mooncake") and found.unseen
    with pytest.raises(ValueError, match="no protocol run starts with 'nope': azure"):
        unseen_run("nope", "a100-80g", "llama-2-7b", {"fp16": 1})


def test_run_options_give_the_unseen_run_at_the_rate_and_refuse_an_unknown_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from policies.evaluation.protocol import add_run_options, run_from_args

    p = argparse.ArgumentParser()
    add_run_options(p)
    args = p.parse_args(["--run", "mooncake", "--rate", "0.5"])
    spec, run_set, workload = run_from_args(p, args)
    assert spec.admission.over_length == "truncate"
    slow = run_from_args(p, p.parse_args(["--run", "mooncake", "--rate", "0.25"]))[2]
    assert run_set.name == "mooncake" and len(workload) == len(slow)
    assert workload.requests[-1].arrival_s == pytest.approx(
        slow.requests[-1].arrival_s / 2, rel=1e-6)
    with pytest.raises(SystemExit):
        run_from_args(p, p.parse_args(["--run", "nope", "--rate", "1"]))
    assert "no protocol run starts with 'nope'" in capsys.readouterr().err


def test_observation_range_clips_what_the_student_sees(tmp_path: Path) -> None:
    cfg = _tiny_cfg(tmp_path)
    one_pool = TotalShareCodec(TOTAL_LADDER, SHARE_LADDER, ("fp16",), 4)
    size = observation_size(4, cfg.obs_version)
    policy = build_student(cfg, one_pool, size)
    rng = np.random.default_rng(2)
    fitted = Demonstrations(rng.uniform(0.2, 0.4, size=(50, size)).astype(np.float32),
                            np.zeros((50, len(one_pool.nvec)), dtype=np.int64))
    bounds = fitted.observation_range()
    assert bounds["low"] == fitted.obs.min(axis=0).tolist()
    plain = load_artifact(export_student(policy, cfg, one_pool, tmp_path / "plain"))
    clipped = load_artifact(export_student(policy, cfg, one_pool, tmp_path / "clipped",
                                           {"obs_range": bounds}))
    inside = fitted.obs[:8]
    np.testing.assert_array_equal(clipped.logits(inside), plain.logits(inside))
    outside = rng.uniform(-5.0, 5.0, size=(64, size)).astype(np.float32)
    into = np.clip(outside, fitted.obs.min(axis=0), fitted.obs.max(axis=0))
    np.testing.assert_array_equal(clipped.act(outside), plain.act(into))
    assert not np.array_equal(clipped.logits(outside), plain.logits(outside))
    meta = json.loads((tmp_path / "clipped" / "policy.json").read_text())
    meta["obs_range"]["high"] = meta["obs_range"]["high"][:-1]
    (tmp_path / "clipped" / "policy.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="obs_range"):
        load_artifact(tmp_path / "clipped")


def test_recipe_records_the_fitted_range_only_when_asked(tmp_path: Path) -> None:
    cfg = replace(_tiny_cfg(tmp_path), episodes=2, episode_s=30.0)
    plain, clipping = Recipe(cfg), Recipe(replace(cfg, obs_clip=True))
    plain.teacher_data()
    clipping.teacher_data()
    assert plain.fitted_range() == {}
    data = Demonstrations.concat(clipping.demos)
    assert len(data) > 2
    bounds = clipping.fitted_range()["obs_range"]
    assert bounds == data.observation_range()
    assert np.all(np.array(bounds["low"]) <= np.array(bounds["high"]))
    assert np.any(np.array(bounds["low"]) < np.array(bounds["high"]))


def test_clip_observation_keeps_fine_tuning_inside_the_range() -> None:
    env = gym.make(envs.ENV_ID, scenario="day", episode_s=60.0)
    size = env.observation_space.shape[0]
    low, high = np.zeros(size), np.full(size, 0.05)
    clipped = ClipObservation(env, low, high)
    obs, _ = clipped.reset(seed=0)
    seen = [obs]
    for _ in range(20):
        obs, *_ = clipped.step(clipped.action_space.sample())
        seen.append(obs)
    stacked = np.array(seen)
    assert stacked.dtype == np.float32
    assert np.all(stacked >= 0.0) and np.all(stacked <= np.float32(0.05))
    assert np.any(stacked == np.float32(0.05))


def test_student_labeller_records_the_students_states_with_the_teachers_labels(
        tmp_path: Path) -> None:
    student = PpoController(load_artifact("policies/two-pool"), name="student")
    labeller = student_labeller(student, "mpc[routing=false]")
    assert labeller.actor is student and labeller.codec.nvec == student.artifact.nvec
    spec = DeploymentSpec(pools={"fp16": 1, "fp8": 1})
    run(make_scenario("day", seed=0, duration_s=30.0), labeller, spec, drain_s=10.0)
    demos = labeller.take()
    assert len(demos) > 3 and demos.obs.shape[1] == student.artifact.obs_size
    per_bucket = copy_artifact("policies/two-pool", tmp_path / "pb",
                               {"action_kind": "per_bucket"})
    with pytest.raises(ValueError, match="only total/share"):
        student_labeller(PpoController(load_artifact(per_bucket), name="pb"), "mpc")
