"""PPO training, the safe artifact, and ``ppo:PATH`` serving."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import envs
from policies.artifact import ArtifactError, load_artifact
from policies.ppo import PpoController, ppo_factory
from policies.training.ppo_trainer import TrainConfig, train
from rlbatch.control.controllers import make_controller
from rlbatch.engine.config import parse_pools
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload.scenarios import make_scenario


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("ppo")
    cfg = TrainConfig(timesteps=256, n_envs=1, n_steps=128, batch_size=64, n_epochs=1,
                      scenario="night", episode_s=60.0, eval_freq=0, out=str(out))
    return out, train(cfg, progress_bar=False)


def test_tiny_run_writes_artifacts_and_logs(tiny_run: tuple[Path, object]) -> None:
    out, _ = tiny_run
    for name in ("final", "best", "latest"):
        assert (out / name / "policy.json").exists()
        assert (out / name / "policy.safetensors").exists()
    assert list((out / "tb").rglob("events.out.tfevents.*"))
    assert json.loads((out / "history.json").read_text())[0]["timesteps"] == 256
    assert not list(out.rglob("*.zip")) and not list(out.rglob("*.pkl"))
    meta = json.loads((out / "final" / "policy.json").read_text())
    assert meta["guard"]["ladder"] == meta["ladder"]


def test_caps_are_logged_per_workload_by_bucket_name(tiny_run: tuple[Path, object]) -> None:
    """Each evaluation workload's own median caps, buckets by name; no cap is drawn as 0 and
    no mean of caps over the envs' workloads is logged."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    out, _ = tiny_run
    board = EventMultiplexer()
    board.AddRunsFromDirectory(str(out / "tb"))
    board.Reload()
    ((name, tags),) = board.Runs().items()
    caps = [t for t in tags["scalars"] if "/batch_cap/" in t]
    buckets = {"0-1k", "1k-2k", "2k-4k", "4k+"}
    assert {t.rsplit("/", 1)[1] for t in caps} == buckets
    assert {f"eval/night/static:16/batch_cap/{b}" for b in buckets} <= set(caps)
    assert {f"eval/night/ppo/batch_cap/{b}" for b in buckets} <= set(caps)
    assert not any(t.startswith("decision/batch_cap/") for t in tags["scalars"])
    assert all(e.value > 0 for t in caps for e in board.Scalars(name, t))
    assert board.Scalars(name, "eval/night/static:16/batch_cap/4k+")[0].value == 16.0


def test_exported_artifact_acts_like_the_sb3_model(tmp_path: Path) -> None:
    from stable_baselines3 import PPO

    from policies.training.ppo_trainer import export_policy

    cfg = TrainConfig(timesteps=128, n_envs=1, scenario="night", episode_s=30.0)
    env = gym.make(envs.ENV_ID, **cfg.env_kwargs())
    model = PPO("MlpPolicy", env, n_steps=64, batch_size=32, n_epochs=1, seed=1,
                policy_kwargs={"net_arch": [64, 64]}, device="cpu")
    model.learn(128)
    artifact = load_artifact(export_policy(model, env.unwrapped, cfg, tmp_path / "p"))
    rng = np.random.default_rng(0)
    env.reset(seed=0)
    observations = [env.step(env.action_space.sample())[0] for _ in range(30)]
    observations += [rng.uniform(0, 10, size=env.observation_space.shape).astype(np.float32)
                     for _ in range(30)]
    for obs in observations:
        expected, _ = model.predict(obs, deterministic=True)
        np.testing.assert_array_equal(artifact.act(obs), expected)


def test_ppo_controller_runs_in_evaluation(tiny_run: tuple[Path, object]) -> None:
    out, _ = tiny_run
    controller = make_controller(f"ppo:{out / 'final'}")
    assert isinstance(controller, PpoController)
    workload = make_scenario("night", seed=1, duration_s=60)
    row = run(workload, controller, DeploymentSpec(), drain_s=60).row
    assert row["controller"] == f"ppo:{out / 'final'}"
    assert row["completed"] + row["rejected"] + row["unfinished"] == len(workload)
    assert row["kv_overflows"] == 0


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("policy.json", "policy.safetensors"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_corrupt_weights_fail_clearly(tiny_run: tuple[Path, object], tmp_path: Path) -> None:
    out, _ = tiny_run
    bad = _copy(out / "final", tmp_path / "bad")
    data = bytearray((bad / "policy.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (bad / "policy.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        load_artifact(bad)


@pytest.mark.parametrize("edit,message", [
    (lambda m: m.pop("nvec"), "'nvec' missing"),
    (lambda m: m.update(format="pickle"), "not an rlbatch policy"),
    (lambda m: m.update(format_version=99), "format_version 99"),
])
def test_bad_metadata_fails_clearly(tiny_run: tuple[Path, object], tmp_path: Path,
                                    edit: object, message: str) -> None:
    out, _ = tiny_run
    bad = _copy(out / "final", tmp_path / "bad")
    meta = json.loads((bad / "policy.json").read_text())
    edit(meta)  # type: ignore[operator]
    (bad / "policy.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match=message):
        load_artifact(bad)


def test_missing_artifact_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not found"):
        ppo_factory(str(tmp_path / "nope"), {})
    with pytest.raises(ValueError, match="needs an artifact path"):
        ppo_factory("", {})


def test_mismatched_deployment_is_refused(tiny_run: tuple[Path, object]) -> None:
    out, _ = tiny_run
    controller = ppo_factory(str(out / "final"), {})
    workload = make_scenario("night", seed=1, duration_s=30)
    with pytest.raises(ArtifactError, match="pools"):
        run(workload, controller, DeploymentSpec(pools=parse_pools("fp16:1,fp8:1")))


def test_eval_workloads_fit_any_trace_length(mooncake_trace: Path, azure_trace: Path) -> None:
    from policies.training.ppo_trainer import eval_workloads

    for trace in (mooncake_trace, azure_trace):
        workloads = eval_workloads(TrainConfig(traces=(str(trace),)))
        assert len(workloads) == 6 and all(len(w) > 0 for _, w in workloads)
