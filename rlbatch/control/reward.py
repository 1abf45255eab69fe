"""Per-tick reward: goodput minus the costs an operator cares about.

    r = (met - w_miss * missed) / norm                    goodput, SLA misses
        - w_wait * mean_b clip(oldest_wait_b / SLA_ttft - 1, 0, 5)   queue heads already late
        - w_preempt * preemptions / norm                  recompute storms
        - w_overflow * [kv_overflows > 0]                 KV cache overflow
        - w_guard * overrides / buckets                   guard had to step in
        - w_fp8 * met_fp8 / norm                          FP8 quality cost (guide: <= 1.5%)
        + w_fair * (worst bucket window attainment - 1)   no starving a bucket

``norm`` = expected arrivals per tick of the episode, so a tick where every arrival meets
the SLA scores about 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.control.types import SLA, DeploymentStats, meets_sla


@dataclass(frozen=True)
class RewardConfig:
    """Weights of the reward terms (see module docstring).

    :param w_miss: weight of completions that missed the SLA.
    :param w_wait: weight of late queue heads.
    :param w_preempt: weight per preemption.
    :param w_overflow: penalty for a tick with KV overflow.
    :param w_guard: weight per guard override.
    :param w_fp8: quality cost of a completion served from the FP8 pool (0.015 = the guide's
        1.5% accuracy-loss budget).
    :param w_fair: weight of the worst bucket's SLA attainment shortfall.
    """

    w_miss: float = 0.5
    w_wait: float = 0.2
    w_preempt: float = 0.05
    w_overflow: float = 1.0
    w_guard: float = 0.02
    w_fp8: float = 0.015
    w_fair: float = 0.2


def compute_reward(stats: DeploymentStats, overrides: int, norm: float, sla: SLA,
                   cfg: RewardConfig) -> tuple[float, dict[str, float]]:
    """Reward of one tick and its components (logged separately)."""
    met = missed = met_fp8 = 0
    for rec in stats.finished:
        if meets_sla(rec, sla):
            met += 1
            if rec.pool == "fp8":
                met_fp8 += 1
        else:
            missed += 1
    missed += sum(stats.rejected)
    n_b = max(len(stats.queued), 1)
    late = sum(min(max(w / sla.ttft_s - 1.0, 0.0), 5.0) for w in stats.oldest_wait_s) / n_b
    preemptions = stats.preemptions
    overflow = stats.kv_overflows > 0
    w = stats.window
    attain = [m / c for m, c in zip(w.sla_met, w.completed, strict=True) if c > 0]
    worst = min(attain) if attain else 1.0
    norm = max(norm, 1e-6)
    parts = {
        "goodput": met / norm,
        "sla_miss": -cfg.w_miss * missed / norm,
        "late_queue": -cfg.w_wait * late,
        "preemption": -cfg.w_preempt * preemptions / norm,
        "kv_overflow": -cfg.w_overflow * float(overflow),
        "guard": -cfg.w_guard * overrides / n_b,
        "fp8_quality": -cfg.w_fp8 * met_fp8 / norm,
        "fairness": cfg.w_fair * (worst - 1.0),
    }
    return sum(parts.values()), parts
