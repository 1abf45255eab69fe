"""The recipe's training episodes: slices of the training windows (mostly near the knee),
generated traffic and, when asked, slices with a redrawn prompt-length mix; never the
held-back window."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from policies.evaluation.protocol import training_window
from rlbatch.buckets import DEFAULT_EDGES
from rlbatch.control.types import SLA
from rlbatch.workload import Workload
from rlbatch.workload.families import FAMILIES, drift, family_workload
from rlbatch.workload.remix import remix_at_random
from rlbatch.workload.scenarios import make_scenario, slice_trace

Episode = tuple[int, Workload]
"""A training workload and the index of the deployment that serves it."""


class EpisodeConfig(Protocol):
    """What the draws read of :class:`policies.training.recipe.RecipeConfig`."""

    traces: tuple[str, ...]
    episode_s: float
    knee_rates: tuple[float, float]
    broad_rates: tuple[float, float]
    knee_share: float
    generated_share: float
    mix_share: float
    mix_load: tuple[float, float]
    family_share: float
    family_loads: tuple[float, float]
    sla_ttft_s: tuple[float, float]
    sla_tpot_s: tuple[float, float]

    def train_deployments(self) -> list[tuple[str, str]]: ...

    def multiplier(self, deployment: int = 0) -> float: ...


def sample_workloads(cfg: EpisodeConfig, rng: np.random.Generator, n: int,
                     traces: Sequence[Workload]) -> list[Workload]:
    """Training workloads of the first deployment (:func:`sample_episodes` without the
    deployments)."""
    return [w for _, w in sample_episodes(cfg, rng, n, traces)]


def sample_episodes(cfg: EpisodeConfig, rng: np.random.Generator, n: int,
                    traces: Sequence[Workload],
                    family_weights: Mapping[str, float] | None = None) -> list[Episode]:
    """Training episodes: slices of the training windows (mostly near the knee) and
    generated traffic, never the held-back window, each on a deployment drawn uniformly
    from ``cfg.train_deployments()`` (no draw with one deployment) and scaled to its knee.
    A share ``cfg.mix_share`` of the slices gets a redrawn length mix
    (:func:`rlbatch.workload.remix.remix_at_random`) at ``cfg.mix_load`` times the slice's
    token rate (log-uniform; drawn only when the range is not one value). A share
    ``cfg.family_share`` of all episodes is a traffic family instead
    (:func:`family_episode`).

    :param traces: ``cfg.traces`` loaded, in order.
    :param family_weights: relative odds of each of :data:`TRAINING_FAMILIES` (``None``:
        uniform).
    """
    return [episode for _, episode in sample_tagged_episodes(cfg, rng, n, traces,
                                                             family_weights)]


def sample_tagged_episodes(cfg: EpisodeConfig, rng: np.random.Generator, n: int,
                           traces: Sequence[Workload],
                           family_weights: Mapping[str, float] | None = None
                           ) -> list[tuple[str, Episode]]:
    """:func:`sample_episodes`, each with its kind: a family's name (one of
    :data:`TRAINING_FAMILIES`), ``generated`` or ``trace`` (the same draws)."""
    out: list[tuple[str, Episode]] = []
    n_dep = len(cfg.train_deployments())
    for _ in range(n):
        deployment = int(rng.integers(n_dep)) if n_dep > 1 else 0
        multiplier = cfg.multiplier(deployment)
        # drawn only when asked, so that recipes without families keep their draws
        if cfg.family_share > 0 and rng.random() < cfg.family_share:
            family = draw_family(rng, family_weights)
            out.append((family, (deployment, family_episode(cfg, rng, multiplier, family,
                                                            family_weights))))
            continue
        if not traces or rng.random() < cfg.generated_share:
            kind = ("bursty", "diurnal", "night", "day")[int(rng.integers(4))]
            load = float(np.exp(rng.uniform(np.log(0.8), np.log(2.0))))
            out.append(("generated", (deployment, make_scenario(
                kind, seed=int(rng.integers(2**31)), duration_s=cfg.episode_s,
                rate_scale=load * multiplier))))
            continue
        out.append(("trace", (deployment, _trace_slice(cfg, rng, traces, multiplier))))
    return out


def _trace_slice(cfg: EpisodeConfig, rng: np.random.Generator, traces: Sequence[Workload],
                 multiplier: float) -> Workload:
    i = int(rng.integers(len(traces)))
    trace = traces[i]
    lo, hi = cfg.knee_rates if rng.random() < cfg.knee_share else cfg.broad_rates
    scale = float(rng.uniform(lo, hi)) * multiplier
    _, end = training_window(cfg.traces[i])
    span = cfg.episode_s * scale
    start = float(rng.uniform(0.0, max(end - span, 0.0)))
    workload = slice_trace(trace, start, cfg.episode_s, scale)
    # drawn only when asked, so that recipes without them keep their draws
    if cfg.mix_share > 0 and rng.random() < cfg.mix_share:
        low, high = cfg.mix_load
        load = float(np.exp(rng.uniform(np.log(low), np.log(high)))) if high > low else low
        workload = remix_at_random(workload, trace, end, DEFAULT_EDGES, rng,
                                   token_scale=load)
    return workload


def draws_slas(cfg: EpisodeConfig) -> bool:
    """Whether the recipe draws an SLA per workload (either range is not one value)."""
    return cfg.sla_ttft_s[0] < cfg.sla_ttft_s[1] or cfg.sla_tpot_s[0] < cfg.sla_tpot_s[1]


def sample_slas(cfg: EpisodeConfig, rng: np.random.Generator, n: int) -> list[SLA]:
    """One SLA per workload, TTFT and TPOT log-uniform in their ranges (nothing drawn when
    both ranges are one value, so that recipes with one SLA keep their draws)."""
    if not draws_slas(cfg):
        return [SLA(cfg.sla_ttft_s[0], cfg.sla_tpot_s[0])] * n

    def draw(lo: float, hi: float) -> float:
        return float(np.exp(rng.uniform(np.log(lo), np.log(hi)))) if hi > lo else lo

    return [SLA(draw(*cfg.sla_ttft_s), draw(*cfg.sla_tpot_s)) for _ in range(n)]


TRAINING_FAMILIES = (*FAMILIES, "drift")


def draw_family(rng: np.random.Generator,
                family_weights: Mapping[str, float] | None = None) -> str:
    """One of :data:`TRAINING_FAMILIES`, uniformly or at ``family_weights``' relative odds
    (families it leaves out are never drawn).

    :raises ValueError: weights that are negative, not finite, or all 0.
    """
    if family_weights is None:
        return TRAINING_FAMILIES[int(rng.integers(len(TRAINING_FAMILIES)))]
    odds = np.array([float(family_weights.get(f, 0.0)) for f in TRAINING_FAMILIES])
    if not (np.all(np.isfinite(odds)) and np.all(odds >= 0) and odds.sum() > 0):
        raise ValueError(f"family weights must be finite, >= 0 and not all 0, got "
                         f"{dict(family_weights)}")
    return TRAINING_FAMILIES[int(rng.choice(len(TRAINING_FAMILIES), p=odds / odds.sum()))]


def family_episode(cfg: EpisodeConfig, rng: np.random.Generator, multiplier: float,
                   family: str, family_weights: Mapping[str, float] | None = None
                   ) -> Workload:
    """A traffic family (:mod:`rlbatch.workload.families`) or ``drift`` (two distinct
    families in turn, half the episode each), at a load log-uniform in
    ``cfg.family_loads`` (units of the family's knee on the first deployment) times the
    deployment's multiplier; its seed is drawn from ``rng``.

    :param family_weights: relative odds of the families a drift passes through (those of
        :data:`TRAINING_FAMILIES` other than ``drift``; ``None`` or all 0: uniform), so that
        a drift leaves and enters the families the student imitates worst as often as they
        are drawn alone.
    """
    low, high = cfg.family_loads
    load = float(np.exp(rng.uniform(np.log(low), np.log(high)))) * multiplier
    seed = int(rng.integers(2**31))
    if family == "drift":
        first, second = _drift_pair(rng, family_weights)
        return drift((first, second), load, cfg.episode_s, cfg.episode_s / 2, seed)
    return family_workload(family, load, cfg.episode_s, seed)


def _drift_pair(rng: np.random.Generator, family_weights: Mapping[str, float] | None
                ) -> tuple[str, str]:
    names = list(FAMILIES)
    odds = np.array([float((family_weights or {}).get(f, 0.0)) for f in names])
    if family_weights is None or not odds.sum() > 0:
        # uniform draws as before, so that recipes without focus keep their episodes
        first = names.pop(int(rng.integers(len(names))))
        return first, names[int(rng.integers(len(names)))]
    i = int(rng.choice(len(names), p=odds / odds.sum()))
    rest = np.delete(odds, i)
    others = names[:i] + names[i + 1:]
    if not rest.sum() > 0:
        return names[i], others[int(rng.integers(len(others)))]
    return names[i], others[int(rng.choice(len(others), p=rest / rest.sum()))]


def drawer(cfg: EpisodeConfig, rng: np.random.Generator,
           traces: Sequence[Workload]) -> Callable[[], Workload]:
    """One workload per call, as :func:`sample_workloads` draws them (fine-tuning)."""
    def draw() -> Workload:
        return sample_workloads(cfg, rng, 1, traces)[0]
    return draw
