"""What overload cost the users: refusals by kind, abandoned requests, retries, wasted work and
the time to any answer, per run and per bucket.

The row's other fields (:func:`rlbatch.serving.metrics.summarize`) are computed over the
users' records (:meth:`~rlbatch.serving.clients.ClientSession.users_records`): one per user
request, its wait measured from its first attempt's arrival, so goodput and attainment count
user requests, not attempts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlbatch.buckets import Buckets
from rlbatch.engine.stats import FinishedRequest
from rlbatch.serving.admission import RejectReason
from rlbatch.serving.clients import ClientSession
from rlbatch.serving.metrics import RunTotals

AT_ARRIVAL = ("queue_full", "predicted_ttft", "queued_tokens")
"""Refusals answered when the request arrives (429)."""


def abandoned_by_bucket(session: ClientSession | None, buckets: Buckets) -> list[int]:
    """Per bucket, user requests whose client gave up.

    :param session: the run's clients (``None``: patient ones, who never give up).
    :param buckets: bucket definitions.
    """
    out = [0] * len(buckets)
    if session is not None:
        for entry in session.originals.values():
            if entry.outcome == "abandoned":
                out[buckets.index(entry.request.prompt_tokens)] += 1
    return out


def overload_fields(users: Sequence[FinishedRequest], buckets: Buckets, totals: RunTotals, *,
                    session: ClientSession | None,
                    refusals: Mapping[RejectReason, Sequence[int]]
                    ) -> dict[str, Any]:
    """The row's overload fields: ``clients``, ``abandoned``, ``retries``,
    ``retries_per_request``, ``rejected_at_arrival``, ``rejected_by_ttl``, ``wasted_tokens``
    (prefill and decode tokens the engines spent on requests whose client gave up),
    ``wasted_token_share`` (of every token the engines computed), ``any_answer_p99_s`` (first
    token or final refusal, from the first attempt's arrival; an abandoned request counts at
    the moment its client gave up) and ``per_bucket_overload``.

    :param users: the users' records (:meth:`ClientSession.users_records`, or the run's
        records with patient clients).
    :param buckets: bucket definitions.
    :param totals: the engines' counters over the run.
    :param session: the run's clients; ``None``: patient ones (refusals are then final).
    :param refusals: admission's refusals by reason, per bucket (read without a session).
    """
    n = len(buckets)
    abandoned = [0] * n
    retries = [0] * n
    at_arrival = [0] * n
    by_ttl = [0] * n
    wasted = [0] * n
    waits: list[float] = [r.finish_s - r.arrival_s if r.rejected else r.ttft_s for r in users]
    if session is None:  # every refusal is final
        for reason, counts in refusals.items():
            target = (at_arrival if reason in AT_ARRIVAL
                      else by_ttl if reason == "queue_ttl" else None)
            if target is not None:
                for b, c in enumerate(counts):
                    target[b] += c
        mix = "patient"
    else:
        for entry in session.originals.values():
            b = buckets.index(entry.request.prompt_tokens)
            retries[b] += entry.retries
            if entry.outcome == "abandoned":
                abandoned[b] += 1
                waits.append(entry.end_s - entry.request.arrival_s)
            elif entry.outcome == "rejected":
                if entry.reason in AT_ARRIVAL:
                    at_arrival[b] += 1
                elif entry.reason == "queue_ttl":
                    by_ttl[b] += 1
        for a in session.aborted:
            wasted[a.bucket] += a.prefill_tokens_computed + a.output_tokens
        mix = session.mix.name
    all_tokens = totals.prefill_tokens + totals.decode_tokens
    originals = len(session.originals) if session is not None else len(users)
    per_bucket = {name: {"abandoned": abandoned[b], "retries": retries[b],
                         "rejected_at_arrival": at_arrival[b], "rejected_by_ttl": by_ttl[b],
                         "wasted_tokens": wasted[b]}
                  for b, name in enumerate(buckets.names)}
    finite = np.asarray([w for w in waits if math.isfinite(w)], dtype=np.float64)
    return {
        "clients": mix,
        "abandoned": sum(abandoned),
        "retries": sum(retries),
        "retries_per_request": sum(retries) / originals if originals else 0.0,
        "rejected_at_arrival": sum(at_arrival),
        "rejected_by_ttl": sum(by_ttl),
        "wasted_tokens": sum(wasted),
        "wasted_token_share": sum(wasted) / all_tokens if all_tokens else 0.0,
        "any_answer_p99_s": float(np.percentile(finite, 99)) if len(finite) else math.nan,
        "per_bucket_overload": per_bucket,
    }
