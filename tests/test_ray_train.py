"""Issue 11: the recipe's teacher step and multi-seed training on a real local Ray cluster give
exactly what they give without Ray; the summary over seeds."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from policies.training.episodes import sample_episodes
from policies.training.multiseed import run_seeds, seed_runs, summary_table
from policies.training.recipe import Recipe, RecipeConfig
from rlbatch.scale import LOCAL, connect
from rlbatch.scale.cluster import shutdown
from rlbatch.tools.evaluate import comparable_rows


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    connect(LOCAL, num_cpus=2)
    yield
    shutdown()


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory, azure_trace: Path) -> Path:
    # The first ~10 minutes of the Azure trace: a training window the selection phase
    # replays in seconds.
    path = tmp_path_factory.mktemp("trace") / "azure_head.csv"
    path.write_text("".join(azure_trace.read_text().splitlines(keepends=True)[:301]))
    return path


def _cfg(trace: Path, out: Path) -> RecipeConfig:
    # a short fine-tuning: the runs must agree whatever its length
    return RecipeConfig(traces=(str(trace),), episodes=2, episode_s=30.0, dagger_rounds=0,
                        epochs=2, finetune_steps=256, selection_rates=(0.8,), out=str(out))


def test_teacher_episodes_on_ray_equal_serial(cluster: None, small_trace: Path,
                                              tmp_path: Path) -> None:
    cfg = _cfg(small_trace, tmp_path)
    serial, on_ray = Recipe(cfg), Recipe(cfg, ray=LOCAL)
    episodes = sample_episodes(cfg, np.random.default_rng(3), 4, serial.traces)
    assert len({d for d, _ in episodes}) > 1  # several deployments, each served on its own
    demos_s, rows_s = serial.collect(episodes)
    demos_r, rows_r = on_ray.collect(episodes)
    assert len(demos_s) > 0
    assert [r["gpu"] + "/" + r["model"] for r in rows_s] == [
        "/".join(cfg.train_deployments()[d]) for d, _ in episodes]
    np.testing.assert_array_equal(demos_r.obs, demos_s.obs)
    np.testing.assert_array_equal(demos_r.actions, demos_s.actions)
    assert comparable_rows(rows_r) == comparable_rows(rows_s)


@pytest.mark.parametrize("quiet", [True, False])
def test_teacher_tasks_progress_bar_follows_quiet(cluster: None, small_trace: Path,
                                                 tmp_path: Path, quiet: bool,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # train.py --no-progress passes quiet down: the main job's log had Ray's bars without it
    cfg = _cfg(small_trace, tmp_path)
    recipe = Recipe(cfg, ray=LOCAL, quiet=quiet)
    recipe.collect(sample_episodes(cfg, np.random.default_rng(3), 1, recipe.traces))
    assert ("teacher:" in capsys.readouterr().err) is not quiet


@pytest.mark.live
def test_seeds_on_ray_equal_serial_seeds(cluster: None, small_trace: Path,
                                         tmp_path: Path) -> None:
    base = _cfg(small_trace, tmp_path)
    spec = base.spec()
    runs_r = seed_runs("distill", base, [0, 1], tmp_path / "ray")
    runs_s = seed_runs("distill", base, [0, 1], tmp_path / "serial")
    text = run_seeds(runs_r, spec, tmp_path / "ray", ray=LOCAL, compare=False, quiet=True)
    run_seeds(runs_s, spec, tmp_path / "serial", compare=False, quiet=True)
    for seed in (0, 1):
        weights = [(tmp_path / kind / f"seed{seed}" / "best" / "policy.safetensors").read_bytes()
                   for kind in ("ray", "serial")]
        assert weights[0] == weights[1]
        assert (tmp_path / "ray" / f"seed{seed}" / "tb" / "recipe").is_dir()
    a = (tmp_path / "ray" / "seed0" / "best" / "policy.safetensors").read_bytes()
    assert a != (tmp_path / "ray" / "seed1" / "best" / "policy.safetensors").read_bytes()
    assert (tmp_path / "ray" / "seeds.md").read_text() == text
    assert f"tensorboard --logdir {tmp_path / 'ray'}" in text


def test_summary_table_over_seeds() -> None:
    def summary(a: float, b: float, c: float, d: float, met: bool) -> dict[str, object]:
        return {"vs_best_static_gmean": a, "vs_best_static_min": b, "vs_user_pick_gmean": c,
                "vs_playbook_gmean": d, "kv_overflows": 0, "must_met": met}

    table = summary_table({0: summary(1.1, 1.0, 1.2, 3.0, True),
                           1: summary(0.9, 0.8, 1.0, 2.0, False),
                           2: summary(1.0, math.nan, 1.1, 4.0, True)})
    lines = table.splitlines()
    assert lines[0] == ("| seed | vs best static (geo-mean) | worst run vs best static | "
                        "vs user's pick | vs playbook | KV overflows | must-checks |")
    assert lines[2] == "| 0 | 1.100x | 1.000x | 1.200x | 3.000x | 0 | met |"
    assert lines[4] == "| 2 | 1.000x | - | 1.100x | 4.000x | 0 | met |"
    assert lines[5] == "| **mean** | 1.000x | 0.900x | 1.100x | 3.000x | | |"
    assert lines[6] == "| **min** | 0.900x | 0.800x | 1.000x | 2.000x | | |"
    assert lines[7] == "| **max** | 1.100x | 1.000x | 1.200x | 4.000x | | |"


def test_seed_runs_folders_and_bad_seeds(tmp_path: Path) -> None:
    runs = seed_runs("distill", RecipeConfig(), [0, 2], tmp_path)
    assert [(r.seed, r.config.seed, r.config.out) for r in runs] == \
        [(0, 0, str(tmp_path / "seed0")), (2, 2, str(tmp_path / "seed2"))]
    with pytest.raises(ValueError, match="distinct"):
        seed_runs("distill", RecipeConfig(), [1, 1], tmp_path)


@pytest.mark.live
def test_tune_two_trials(cluster: None, small_trace: Path, tmp_path: Path) -> None:
    import train

    out = tmp_path / "out"
    assert train.main(["--tune", "2", "--trace", str(small_trace), "--episodes", "1",
                       "--recipe-episode-s", "30", "--dagger-rounds", "0", "--epochs", "2",
                       "--finetune-steps", "256", "--out", str(out), "--ray"]) == 0
    best = json.loads((out / "tune.json").read_text())
    assert set(best["best"]) == {"learning_rate", "epochs", "net_arch", "decision_ticks",
                                 "dagger_rounds", "knee_share"}
    assert 0.0 < best["score"] <= 1.5
    assert len(list((out / "tune" / "tune").glob("trial*/run/best/policy.json"))) == 2
