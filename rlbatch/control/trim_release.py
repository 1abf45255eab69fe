"""Trim release: a policy's per-bucket trim may delay a bucket's requests, not make them late.

A ``total_share`` policy holds a bucket under the engine-wide total (its share of
``max_num_seqs``) to keep that bucket's long prefills from inflating everyone's TPOT. Such a
trim pays only while the trimmed requests can still meet their TTFT: once the head of the
bucket's admission queue has waited ``wait_s`` (a fraction of the SLA's TTFT), holding it
longer turns the trim into a miss the policy caused, and repeated it starves the bucket,
which the must-checks forbid. So while that holds, the bucket's cap is lifted to the total
(``None``); it returns with the policy's next proposal once the queue's head is younger.

Only trims are released: a cap below the proposal's ``max_num_seqs``. The total itself, and
every rule of the guard applied after (its P99 trim of long prompts, the KV budget), stay.
"""

from __future__ import annotations

from dataclasses import replace

from rlbatch.control.types import ControlAction, DeploymentStats

TRIM_RELEASE_FRACTION = 0.5
"""The default wait, as a fraction of the SLA's TTFT: a trimmed bucket's queue head may wait
half of it (``ppo:PATH`` and the recipe's fine-tuning env). Set before it was measured
(BENCHMARKS.md, issue 14, stop 24)."""


def release_late_trims(action: ControlAction, stats: DeploymentStats | None,
                       wait_s: float) -> ControlAction:
    """``action`` with the trim of every bucket whose oldest queued request has waited
    ``wait_s`` or more lifted (its cap ``None``: only the total limits it).

    :param action: the policy's proposal.
    :param stats: the tick's snapshot (``None`` before the first tick: nothing waits).
    :param wait_s: how long a trimmed bucket's queue head may wait, seconds (> 0).
    :raises ValueError: ``wait_s`` is not positive.
    """
    if not wait_s > 0:
        raise ValueError(f"trim release wait must be > 0 s, got {wait_s}")
    total = action.max_num_seqs
    if stats is None or total is None or not stats.oldest_wait_s:
        return action
    caps = list(action.caps)
    released = False
    for b, cap in enumerate(caps):
        if (cap is not None and cap < total and stats.queued[b] > 0
                and stats.oldest_wait_s[b] >= wait_s):
            caps[b] = None
            released = True
    return replace(action, caps=tuple(caps)) if released else action
