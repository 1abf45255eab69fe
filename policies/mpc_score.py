"""How the ``mpc`` planner scores a rollout: weighted requests that met the SLA minus those
that missed it or will (see :func:`rollout_score`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlbatch.control.types import SLA, meets_sla
from rlbatch.serving.twin import Rollout


@dataclass(frozen=True)
class RolloutScore:
    """A rollout's score and, per bucket, the requests behind it (unweighted).

    :param total: the weighted score (:func:`rollout_score`).
    :param met: per bucket, requests that met the SLA.
    :param missed: per bucket, requests that missed it or will (finished late, refused,
        doomed at the horizon, projected past the TTFT limit; the projected arrivals held up
        by the leftover queue are a fraction).
    """

    total: float
    met: tuple[float, ...]
    missed: tuple[float, ...]


def rollout_score(result: Rollout, sla: SLA, weights: list[float], backlog: float = 0.0,
                  weigh_misses: bool = True, project_s: float = 0.0,
                  fp8_cost: float = 0.0) -> float:
    """Weighted met - missed of a rollout (:func:`score_rollout`'s total)."""
    return score_rollout(result, sla, weights, backlog, weigh_misses, project_s,
                         fp8_cost).total


def score_rollout(result: Rollout, sla: SLA, weights: list[float], backlog: float = 0.0,
                  weigh_misses: bool = True, project_s: float = 0.0,
                  fp8_cost: float = 0.0) -> RolloutScore:
    """Weighted met - missed of a rollout, with the per-bucket counts behind it. Unfinished
    requests that can no longer meet the SLA at its end count as missed; with ``project_s``
    > 0 the queues left at the end are projected forward at the rate each bucket completed
    requests in the rollout: a queued request that will pass its TTFT limit before its turn
    counts as missed, and so do the arrivals of the next ``project_s`` seconds that the
    leftover queue will hold up past the TTFT limit (a cap that lets the backlog grow pays
    for it even when the horizon is short). Every unfinished request costs ``backlog`` more.

    :param result: the rollout.
    :param sla: the SLA.
    :param weights: per bucket weight.
    :param backlog: extra cost of each request left unfinished at the horizon.
    :param weigh_misses: the weights apply to misses and backlog too (else to met only: in
        a collapse every candidate misses a starving bucket's queue, and weighing those
        misses drowns the throughput differences that decide how fast it recovers).
    :param project_s: how far past the horizon the leftover queues are projected (0: off).
    :param fp8_cost: a request that met the SLA in the FP8 pool counts ``1 - fp8_cost`` (the
        reward's quality cost, :class:`~rlbatch.control.reward.RewardConfig` ``w_fp8``).
    """
    end = result.end_s
    n = len(weights)
    total = 0.0
    miss = weights if weigh_misses else [1.0] * n
    served = [0] * n
    arrived = [0] * n
    met = [0.0] * n
    missed = [0.0] * n
    for rec in result.finished:
        if meets_sla(rec, sla):
            total += weights[rec.bucket] * (1.0 - fp8_cost if rec.pool == "fp8" else 1.0)
            met[rec.bucket] += 1
        else:
            total -= miss[rec.bucket]
            missed[rec.bucket] += 1
        if not rec.rejected:
            served[rec.bucket] += 1
        arrived[rec.bucket] += rec.arrival_s > result.start_s
    for bucket, arrival, first_token, _num_output, max_output in result.pending:
        total -= backlog * miss[bucket]
        arrived[bucket] += arrival > result.start_s
        if first_token < 0:
            doomed = end - arrival > sla.ttft_s
        else:
            doomed = (first_token - arrival > sla.ttft_s
                      or (max_output > 1 and (end - first_token) / (max_output - 1) > sla.tpot_s))
        if doomed:
            total -= miss[bucket]
            missed[bucket] += 1
    queues: list[list[float]] = [[] for _ in range(n)]
    for bucket, arrival in result.queued:
        queues[bucket].append(arrival)
        arrived[bucket] += arrival > result.start_s
    span = max(end - result.start_s, 1e-9)
    for b, queue in enumerate(queues):
        if not queue:
            continue
        total -= backlog * miss[b] * len(queue)
        rate = served[b] / span
        queue.sort()
        for i, arrival in enumerate(queue):
            wait = (i + 1) / rate if project_s > 0 and rate > 0 else 0.0
            if end - arrival + wait > sla.ttft_s or (project_s > 0 and rate == 0):
                total -= miss[b]
                missed[b] += 1
        if project_s > 0:
            drain = len(queue) / rate if rate > 0 else math.inf
            held = min(project_s, max(0.0, drain - sla.ttft_s))
            total -= miss[b] * arrived[b] / span * held
            missed[b] += arrived[b] / span * held
    return RolloutScore(total, tuple(met), tuple(missed))
