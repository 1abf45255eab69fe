"""PPO fine-tuning of a behaviour-cloned student on the env's objective.

The student (an SB3 ``ActorCriticPolicy`` fitted by :func:`policies.training.distill.fit_policy`) is
loaded into a PPO model on ``rlbatch/BatchSize-v0`` with the student's action space
(``total_share``), observation version and decision interval, and trained on the recipe's
workloads (training windows only, most near the knee,
:func:`policies.training.episodes.sample_workloads`) with the env's reward (goodput and
fairness, :mod:`rlbatch.control.reward`).

Rewards are scaled by the running standard deviation of the return (``VecNormalize``), and
two things keep PPO from undoing the teacher's work: the value head, which behaviour cloning
never trained, is fitted alone first (``value_warmup_rollouts``: the actor's parameters are
left out of the optimiser, so the first advantages are not noise), and the step size and clip
range are small. Whether the result is better is not assumed: the fine-tuned network is one
more checkpoint for the recipe's selection on full-length validation windows.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from tqdm import tqdm

from rlbatch.control.action_codec import SHARE_LADDER
from rlbatch.control.discipline import PPO_QUEUE_ORDER
from rlbatch.control.guard import GuardConfig
from rlbatch.control.hold_release import HoldRelease
from rlbatch.serving.run import tick_fields
from rlbatch.workload import Workload

EpisodeLog = Callable[[dict[str, Any], int], None]
"""``on_episode(row, decisions)``: a finished fine-tuning episode's run row and the
decisions taken so far (all envs)."""


@dataclass(frozen=True)
class FinetuneConfig:
    """PPO settings of the fine-tuning phase.

    :param steps: environment steps (decisions); 0 skips the phase.
    :param n_steps: rollout length.
    :param batch_size: minibatch.
    :param n_epochs: passes per rollout.
    :param learning_rate: Adam step size (small: the student is already good).
    :param clip_range: PPO clip range.
    :param ent_coef: entropy bonus (0: the student's entropy only shrinks).
    :param gamma: discount per decision.
    :param value_warmup_rollouts: rollouts that fit only the value head first.
    """

    steps: int = 8192
    n_steps: int = 1024
    batch_size: int = 128
    n_epochs: int = 4
    learning_rate: float = 1e-4
    clip_range: float = 0.1
    ent_coef: float = 0.0
    gamma: float = 0.97
    value_warmup_rollouts: int = 2

    def __post_init__(self) -> None:
        if self.steps < 0 or self.n_steps < 1 or self.batch_size < 1:
            raise ValueError(f"fine-tuning needs steps >= 0, n_steps >= 1, batch_size >= 1; "
                             f"got {self.steps}, {self.n_steps}, {self.batch_size}")


class WorkloadSource(gym.Wrapper[Any, Any, Any, Any]):
    """Feeds each episode a workload from ``draw`` (the recipe's sampler) instead of the env's
    own scenario.

    :param env: the env.
    :param draw: returns the next episode's workload.
    """

    def __init__(self, env: gym.Env[Any, Any], draw: Callable[[], Workload]) -> None:
        super().__init__(env)
        self.draw = draw

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        return self.env.reset(seed=seed, options={**(options or {}), "workload": self.draw()})


class ClipObservation(gym.ObservationWrapper[Any, Any, Any]):
    """Clips each observation into ``[low, high]`` per feature, as a student artifact with an
    ``obs_range`` does when it serves (so fine-tuning sees what serving will)."""

    def __init__(self, env: gym.Env[Any, Any], low: Sequence[float],
                 high: Sequence[float]) -> None:
        super().__init__(env)
        self.low = np.asarray(low, dtype=np.float32)
        self.high = np.asarray(high, dtype=np.float32)

    def observation(self, observation: Any) -> Any:
        return np.clip(observation, self.low, self.high).astype(np.float32)


def finetune(policy: Any, env_kwargs: dict[str, Any], draw: Callable[[], Workload],
             cfg: FinetuneConfig, seed: int,
             log: Callable[[str, float, int], None] | None = None) -> Any:
    """Fine-tune ``policy`` in place with PPO on one deployment; returns it.

    :param policy: the student (SB3 ``ActorCriticPolicy`` matching the env's spaces).
    :param env_kwargs: ``rlbatch/BatchSize-v0`` arguments (the student's action kind,
        observation version, decision interval, deployment).
    :param draw: the workload of each episode.
    :param cfg: PPO settings.
    :param seed: seed of PPO and the env.
    :param log: TensorBoard scalars ``callable(tag, value, step)`` under ``finetune/``.
    """
    return finetune_many(policy, [(env_kwargs, draw)], cfg, seed, log)


def finetune_many(policy: Any,
                  sources: Sequence[tuple[dict[str, Any], Callable[[], Workload]]],
                  cfg: FinetuneConfig, seed: int,
                  log: Callable[[str, float, int], None] | None = None,
                  obs_range: tuple[Sequence[float], Sequence[float]] | None = None, *,
                  on_episode: EpisodeLog | None = None, progress: bool = False) -> Any:
    """:func:`finetune` over several deployments at once: one env per ``(env_kwargs, draw)``
    source, stepped together; each rollout keeps about ``cfg.n_steps`` decisions in all.

    :param sources: env arguments and workload drawer of each deployment (same spaces).
    :param obs_range: ``(low, high)`` to clip every observation into (:class:`ClipObservation`).
    :param on_episode: called with each finished episode's row (:class:`EpisodeRows`).
    :param progress: a progress bar over the decisions.
    """
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    import envs

    say = log or (lambda tag, value, step: None)
    if cfg.steps == 0:
        return policy

    if not sources:
        raise ValueError("fine-tuning needs at least one deployment")

    def maker(env_kwargs: dict[str, Any], draw: Callable[[], Workload]
              ) -> Callable[[], gym.Env[Any, Any]]:
        def make() -> gym.Env[Any, Any]:
            env: gym.Env[Any, Any] = WorkloadSource(gym.make(envs.ENV_ID, **env_kwargs), draw)
            if obs_range is not None:
                env = ClipObservation(env, *obs_range)
            return Monitor(env)

        return make

    # Returns of hundreds per decision would swamp a fresh value head: scale rewards by
    # their running return std (observations are already normalised by the env).
    vec = VecNormalize(DummyVecEnv([maker(k, d) for k, d in sources]), norm_obs=False,
                       norm_reward=True, gamma=cfg.gamma)
    arch = [layer.out_features for layer in policy.mlp_extractor.policy_net
            if isinstance(layer, torch.nn.Linear)]
    model = PPO("MlpPolicy", vec, learning_rate=cfg.learning_rate,
                n_steps=_steps_per_env(cfg, len(sources)),
                batch_size=cfg.batch_size, n_epochs=cfg.n_epochs, gamma=cfg.gamma,
                clip_range=cfg.clip_range, ent_coef=cfg.ent_coef, seed=seed, verbose=0,
                policy_kwargs={"net_arch": arch}, device="cpu")
    model.policy.load_state_dict(policy.state_dict())
    rows = EpisodeRows([k.get("decision_ticks", 1) for k, _ in sources], on_episode)
    bar = tqdm(total=cfg.steps, desc="fine-tuning", unit="decision", disable=not progress,
               leave=False)
    callback = _callback(model, cfg, say, rows, bar)
    try:
        model.learn(total_timesteps=cfg.steps, callback=callback, progress_bar=False)
    finally:
        bar.close()
    vec.close()
    policy.load_state_dict(model.policy.state_dict())
    return policy


def _callback(model: Any, cfg: FinetuneConfig, say: Callable[[str, float, int], None],
              rows: EpisodeRows, bar: Any) -> Any:
    """The SB3 callback of fine-tuning: PPO's figures under ``finetune/`` after each
    rollout, the value-head warm-up, each finished episode's row and the progress bar."""
    import torch
    from stable_baselines3.common.callbacks import BaseCallback

    full_optimizer = model.policy.optimizer
    # The actor's parameters left out: the value head alone learns during the warm-up.
    value_params = [*model.policy.mlp_extractor.value_net.parameters(),
                    *model.policy.value_net.parameters()]
    rollouts = [0]

    class Logger(BaseCallback):
        def _on_rollout_end(self) -> None:
            step = self.num_timesteps
            episodes = [e["r"] for e in self.model.ep_info_buffer or ()]
            if episodes:
                say("finetune/episode_reward", float(np.mean(episodes)), step)
            for key in ("train/value_loss", "train/approx_kl", "train/clip_fraction",
                        "train/entropy_loss"):
                value = self.model.logger.name_to_value.get(key)
                if value is not None:
                    say(f"finetune/{key.split('/')[1]}", float(value), step)
            rollouts[0] += 1
            warm = rollouts[0] <= cfg.value_warmup_rollouts
            say("finetune/actor_frozen", float(warm), step)
            # called after each rollout, before PPO's update on it; a warm-up update gets a
            # fresh optimiser over the value head (what the shipped seeds were trained with)
            self.model.policy.optimizer = (
                torch.optim.Adam(value_params, lr=cfg.learning_rate) if warm
                else full_optimizer)

        def _on_step(self) -> bool:
            rows.step(self.locals.get("infos", ()), self.num_timesteps)
            bar.update(self.training_env.num_envs)
            return True

    return Logger()


class EpisodeRows:
    """Run rows of the fine-tuning episodes, as :func:`rlbatch.serving.run.run` writes them
    for the other phases: the env's episode summary plus the totals and caps in force and
    the guard's overrides, gathered step by step (each step's action counted for its
    decision's ticks).

    :param decision_ticks: ticks per decision of each env.
    :param on_episode: called with each finished episode's row (``None``: nothing kept).
    """

    def __init__(self, decision_ticks: Sequence[int], on_episode: EpisodeLog | None) -> None:
        self.decision_ticks = list(decision_ticks)
        self.on_episode = on_episode
        self.actions: list[Counter[tuple[int | None, tuple[int | None, ...]]]] = [
            Counter() for _ in decision_ticks]
        self.overrides = [0] * len(decision_ticks)

    def step(self, infos: Sequence[dict[str, Any]], decisions: int) -> None:
        """One vectorised step's infos (one per env, in env order)."""
        if self.on_episode is None:
            return
        for i, info in enumerate(infos):
            stats = info.get("stats")
            if stats is not None:
                self.actions[i][stats.action.max_num_seqs, stats.action.caps] += (
                    self.decision_ticks[i])
            self.overrides[i] += len(info.get("overrides", ()))
            summary = info.get("episode_summary")
            if summary is not None:
                row = {**summary, "guard_overrides": self.overrides[i],
                       **tick_fields(self.actions[i], list(summary["per_bucket"]))}
                self.actions[i], self.overrides[i] = Counter(), 0
                self.on_episode(row, decisions)


def _steps_per_env(cfg: FinetuneConfig, n_envs: int) -> int:
    """Rollout length per env: about ``cfg.n_steps`` in all, the whole rollout a multiple
    of the minibatch (no truncated minibatch)."""
    unit = cfg.batch_size // math.gcd(n_envs, cfg.batch_size)
    return max(1, round(cfg.n_steps / n_envs / unit)) * unit


def recipe_env_kwargs(gpu: str, model: str, pools: str, episode_s: float, obs_version: int,
                      decision_ticks: int, shares: tuple[float, ...] = SHARE_LADDER,
                      hold_release: bool = True,
                      guard: GuardConfig | None = None) -> dict[str, Any]:
    """The env arguments that give a recipe student's spaces and deployment, and the hold
    release (none with ``hold_release`` off), queue order and guard (``None``: the env's
    default on the total ladder) it is served with (``ppo:PATH``'s defaults for its
    artifact)."""
    return {"gpu": gpu, "model": model, "pools": pools, "episode_s": episode_s, "guard": guard,
            "action_kind": "total_share", "obs_version": obs_version,
            "decision_ticks": decision_ticks, "shares": tuple(shares),
            "release": HoldRelease() if hold_release else None,
            "queue_order": PPO_QUEUE_ORDER}
