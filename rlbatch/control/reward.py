"""Per-tick reward and episode objective: goodput and fairness, every request accounted.

    r = (met - w_miss * missed) / norm                     goodput, SLA misses
        - w_miss * unbooked_at_end / norm                  unfinished at the episode's end
        - w_wait * mean_b clip(oldest_wait_b / SLA_ttft - 1, 0, wait_cap)   late queue heads
        - w_preempt * preemptions / norm                   recompute storms
        - w_overflow * [kv_overflows > 0]                  KV cache overflow
        - w_guard * overrides / buckets                    guard had to step in
        - w_fp8 * met_fp8 / norm                           FP8 quality cost (guide: <= 1.5%)
        + w_fair * (worst bucket window attainment - 1)    no starving a bucket

``missed`` books each request that cannot meet the SLA exactly once, as soon as that is
known: when its TTFT deadline passes without a first token (``DeploymentStats.doomed``,
counted by the control loop whether it waits in admission or inside an engine), when it
completes within its TTFT but over the TPOT limit, or when it is refused. At the episode's
end (``unbooked``) every request still unfinished and not yet booked counts as missed too, so
over an episode ``met + missed`` is every arrival: leaving work undone is never cheaper than
doing it late. Stats without deadline tracking (``doomed == ()``) book a TTFT miss at
completion instead.

The fairness term takes, per bucket, the SLA attainment of its completions in the sliding
window; a bucket with no completions there but with doomed requests (waiting past their TTFT
deadline, or doomed in the tick) or a queue head past the deadline is starved: attainment 0.
Buckets with neither are skipped.

The late-queue term is kept on purpose: measured on 600 s Azure slices
(``experiments/reward_objective.py``), dropping it lets a cap set that starves a bucket outscore
every fair static on a contested slice even with the doomed accounting, and its old cap (5,
a head 12 s late) made starving cheap; ``wait_cap`` = 30 (a head about a minute late) ranks
the starving sets below the fair statics on every slice measured.

``norm`` = expected arrivals per tick of the episode, so a tick where every arrival meets
the SLA scores about 1. :func:`episode_objective` is the same objective for a whole run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rlbatch.control.types import SLA, DeploymentStats, meets_sla
from rlbatch.engine.stats import FinishedRequest


@dataclass(frozen=True)
class RewardConfig:
    """Weights of the reward terms (see module docstring).

    :param w_miss: weight of a request booked as missed (doomed, late, refused, or left
        unfinished at the episode's end).
    :param w_wait: weight of late queue heads (0 turns the term off).
    :param wait_cap: a queue head's lateness counts up to this many TTFT limits past its
        deadline.
    :param w_preempt: weight per preemption.
    :param w_overflow: penalty for a tick with KV overflow.
    :param w_guard: weight per guard override.
    :param w_fp8: quality cost of a completion served from the FP8 pool (0.015 = the guide's
        1.5% accuracy-loss budget).
    :param w_fair: weight of the worst bucket's SLA attainment shortfall.
    """

    w_miss: float = 0.5
    w_wait: float = 0.2
    wait_cap: float = 30.0
    w_preempt: float = 0.05
    w_overflow: float = 1.0
    w_guard: float = 0.02
    w_fp8: float = 0.015
    w_fair: float = 0.2


REWARD_PARTS = ("goodput", "sla_miss", "unfinished", "late_queue", "preemption",
                "kv_overflow", "guard", "fp8_quality", "fairness")
"""The keys of ``compute_reward``'s components, in order."""


def compute_reward(stats: DeploymentStats, overrides: int, norm: float, sla: SLA,
                   cfg: RewardConfig, *,
                   unbooked: Sequence[int] = ()) -> tuple[float, dict[str, float]]:
    """Reward of one tick and its components (logged separately).

    :param stats: the tick's stats.
    :param overrides: guard overrides of the tick's action.
    :param norm: expected arrivals per tick.
    :param sla: the SLA.
    :param cfg: the weights.
    :param unbooked: at the episode's last tick, per bucket, the requests still unfinished
        and not yet booked (:meth:`~rlbatch.serving.loop.ControlLoop.unbooked_by_bucket`);
        empty on every other tick.
    """
    tracked = stats.deadlines_tracked
    met = missed = met_fp8 = 0
    for rec in stats.finished:
        if meets_sla(rec, sla):
            met += 1
            if rec.pool == "fp8":
                met_fp8 += 1
        elif not tracked or rec.ttft_s <= sla.ttft_s:
            missed += 1  # tracked: over TPOT only (a TTFT miss was booked when doomed)
    missed += sum(stats.rejected) + sum(stats.doomed)
    n_b = max(len(stats.queued), 1)
    cap = cfg.wait_cap
    late = sum(min(max(w / sla.ttft_s - 1.0, 0.0), cap) for w in stats.oldest_wait_s) / n_b
    overflow = stats.kv_overflows > 0
    norm = max(norm, 1e-6)
    parts = {
        "goodput": met / norm,
        "sla_miss": -cfg.w_miss * missed / norm,
        "unfinished": -cfg.w_miss * sum(unbooked) / norm,
        "late_queue": -cfg.w_wait * late,
        "preemption": -cfg.w_preempt * stats.preemptions / norm,
        "kv_overflow": -cfg.w_overflow * float(overflow),
        "guard": -cfg.w_guard * overrides / n_b,
        "fp8_quality": -cfg.w_fp8 * met_fp8 / norm,
        "fairness": cfg.w_fair * (worst_window_attainment(stats, sla) - 1.0),
    }
    return sum(parts.values()), parts


def worst_window_attainment(stats: DeploymentStats, sla: SLA) -> float:
    """The lowest per-bucket SLA attainment over the sliding window, a starved bucket (no
    completions in the window, but doomed requests or a queue head past the TTFT deadline)
    counting 0; 1 when no bucket qualifies (see module docstring).

    :param stats: the tick's stats.
    :param sla: the SLA.
    """
    w = stats.window
    worst = 1.0
    for b, (met, done) in enumerate(zip(w.sla_met, w.completed, strict=True)):
        if done > 0:
            worst = min(worst, met / done)
        elif _starved(stats, b, sla):
            return 0.0
    return worst


def _starved(stats: DeploymentStats, b: int, sla: SLA) -> bool:
    if stats.doomed and (stats.doomed[b] > 0 or stats.doomed_pending[b] > 0):
        return True
    return b < len(stats.oldest_wait_s) and stats.oldest_wait_s[b] > sla.ttft_s


@dataclass(frozen=True)
class EpisodeObjective:
    """Goodput and fairness of a whole run (:func:`episode_objective`).

    :param requests: every request of the run: completed, refused and unfinished.
    :param met: completions that met the SLA.
    :param missed: the rest (``requests - met``).
    :param attainment: per bucket, ``met / requests`` of that bucket (NaN: no request).
    :param worst_attainment: the lowest of those (1 when no bucket had a request).
    :param score: ``(met - w_miss * missed) / requests + w_fair * (worst_attainment - 1)``,
        the per-tick reward's goodput, miss and fairness terms for the whole run (the
        episode return divided by its ticks, without the shaping and safety terms).
    """

    requests: int
    met: int
    missed: int
    attainment: tuple[float, ...]
    worst_attainment: float
    score: float

    @property
    def goodput(self) -> float:
        """Share of the run's requests that met the SLA (NaN without requests)."""
        return self.met / self.requests if self.requests else math.nan


def episode_objective(records: Iterable[FinishedRequest], unfinished: Sequence[int], sla: SLA,
                      cfg: RewardConfig | None = None) -> EpisodeObjective:
    """The objective of a whole run, for checkpoint selection and planners: goodput (every
    request counts: refused and unfinished ones missed) and fairness (the worst bucket's
    attainment over its requests, a starved bucket scoring 0).

    :param records: every request that left the run (finished or refused), e.g.
        ``ControlLoop.records``.
    :param unfinished: per bucket, requests still queued or running at the end
        (:meth:`~rlbatch.serving.loop.ControlLoop.unfinished_by_bucket`).
    :param sla: the SLA.
    :param cfg: weights (``w_miss``, ``w_fair``); default :class:`RewardConfig`.
    """
    cfg = cfg or RewardConfig()
    n_b = len(unfinished)
    total = list(unfinished)
    good = [0] * n_b
    for rec in records:
        total[rec.bucket] += 1
        if meets_sla(rec, sla):
            good[rec.bucket] += 1
    requests, met = sum(total), sum(good)
    attainment = tuple(g / n if n else math.nan for g, n in zip(good, total, strict=True))
    worst = min((a for a in attainment if not math.isnan(a)), default=1.0)
    missed = requests - met
    score = ((met - cfg.w_miss * missed) / requests if requests else 0.0) \
        + cfg.w_fair * (worst - 1.0)
    return EpisodeObjective(requests, met, missed, attainment, worst, score)
