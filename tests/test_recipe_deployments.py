"""Training over several GPU/model profiles: episodes, multipliers, validation, options."""

from __future__ import annotations

import numpy as np
import pytest

from policies.training.episodes import sample_episodes, sample_workloads
from policies.training.recipe import RecipeConfig, parse_deployment
from policies.training.selection import validation_workloads
from rlbatch.workload import Workload, load_trace

OTHERS = ("h100-80g/llama-2-7b", "a100-80g/llama-3.1-8b")


def _traces(cfg: RecipeConfig) -> list[Workload]:
    return [load_trace(t) for t in cfg.traces]


@pytest.mark.parametrize("text, message", [
    ("h100-80g", "gpu/model"), ("/llama-2-7b", "gpu/model"), ("a/b/c", "gpu/model"),
])
def test_parse_deployment_rejects_malformed(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_deployment(text)


def test_recipe_refuses_unknown_and_repeated_deployments() -> None:
    # the first deployment listed again is left out (the defaults name it for other --gpu)
    assert RecipeConfig(deployments=("a100-80g/llama-2-7b",)).train_deployments() == [
        ("a100-80g", "llama-2-7b")]
    assert RecipeConfig(gpu="h100-80g").train_deployments() == [
        ("h100-80g", "llama-2-7b"), ("a100-80g", "llama-3.1-8b")]
    with pytest.raises(ValueError, match="repeat"):
        RecipeConfig(deployments=(OTHERS[0], OTHERS[0]))
    with pytest.raises(ValueError, match="no-such-gpu"):
        RecipeConfig(deployments=("no-such-gpu/llama-2-7b",))


def test_multiplier_is_relative_to_the_first_deployment() -> None:
    cfg = RecipeConfig(deployments=OTHERS, rate_scale=1.5)
    two_pool = RecipeConfig(pools="fp16:1,fp8:1", rate_scale=2.5)
    assert [two_pool.multiplier(d) for d in range(3)] == pytest.approx([2.5, 5.0, 4.0])
    assert cfg.train_deployments() == [("a100-80g", "llama-2-7b"), ("h100-80g", "llama-2-7b"),
                                       ("a100-80g", "llama-3.1-8b")]
    assert [cfg.multiplier(d) for d in range(3)] == pytest.approx([1.5, 3.0, 2.4])
    assert cfg.spec(1).gpu == "h100-80g" and cfg.spec(2).model == "llama-3.1-8b"


def test_one_deployment_draws_exactly_as_before() -> None:
    # no deployment draw with one deployment: shipped seeds stay reproducible
    cfg = RecipeConfig(deployments=())
    traces = _traces(cfg)
    episodes = sample_episodes(cfg, np.random.default_rng(5), 6, traces)
    workloads = sample_workloads(cfg, np.random.default_rng(5), 6, traces)
    assert [d for d, _ in episodes] == [0] * 6
    assert [w.name for _, w in episodes] == [w.name for w in workloads]
    assert [len(w) for _, w in episodes] == [len(w) for w in workloads]


def test_episodes_cover_every_deployment_at_its_own_load() -> None:
    cfg = RecipeConfig(deployments=OTHERS, generated_share=0.0, knee_share=1.0,
                       knee_rates=(0.8, 0.8))
    episodes = sample_episodes(cfg, np.random.default_rng(1), 30, _traces(cfg))
    by_deployment: dict[int, list[float]] = {}
    for d, w in episodes:
        rate = len(w) / cfg.episode_s
        by_deployment.setdefault(d, []).append(rate)
    assert sorted(by_deployment) == [0, 1, 2]
    base = float(np.mean(by_deployment[0]))
    # H100 serves about twice the load, Llama-3.1-8B on A100 1.6x: their episodes carry more
    assert np.mean(by_deployment[1]) > 1.6 * base
    assert 1.2 * base < np.mean(by_deployment[2]) < np.mean(by_deployment[1])


def test_validation_adds_the_middle_rate_of_each_further_deployment() -> None:
    cfg = RecipeConfig(deployments=OTHERS[:1], selection_rates=(0.6, 0.7, 0.8))
    items = validation_workloads(cfg)
    assert [d for _, d, _ in items] == [0, 0, 0, 1]
    assert items[-1][0].endswith("@1.4 on h100-80g/llama-2-7b")
    assert len({name for name, _, _ in items}) == len(items)


def test_fine_tuning_rollouts_stay_whole_minibatches_over_deployments() -> None:
    from policies.training.finetune import FinetuneConfig, _steps_per_env

    cfg = FinetuneConfig()
    per_env = [_steps_per_env(cfg, n) for n in (1, 2, 3, 4)]
    assert per_env == [1024, 512, 384, 256]
    assert all(n * k % cfg.batch_size == 0 for n, k in zip((1, 2, 3, 4), per_env, strict=True))
