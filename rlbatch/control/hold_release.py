"""Hold release: a policy may hold requests back only while they can still meet their SLA.

A ``total_share`` policy holds requests back in two ways: a bucket's trim (its share of the
engine-wide total, to keep its long prefills from inflating everyone's TPOT) and the total
itself (``max_num_seqs``, to keep every decode fast). Either pays only while the requests it
holds can still meet their TTFT. Once a queue's head has waited ``wait_s`` (a fraction of the
SLA's TTFT), holding it longer turns the hold into a miss the policy caused, and repeated it
starves the bucket, which the must-checks forbid. So, on every tick:

* **trims**: a bucket under the total whose queue head has waited ``wait_s`` gets its cap
  lifted to the total (``None``);
* **the total**: while any accepted request still without a first token has waited
  ``wait_s`` and the all-bucket TPOT P99 of the window is within the SLA (the total is not
  what keeps decodes fast then), the total is lifted to ``max_total``. That request may wait
  in an admission queue or inside an engine: a bucket without a trim passes its requests
  straight to the engines, whose waiting queues the total (vLLM's ``max_num_seqs``) holds,
  so reading only the admission queues' heads let a total starve requests it held there
  (DeploymentStats.oldest_unserved_s; a loop that does not track deadlines reports 0 there,
  and the admission queues' heads stand alone). A replay counts a request mid-prefill too (it
  has no first token yet); the sidecar, which sees no first token of a non-streamed answer,
  counts the requests it has not forwarded (admission queues and what the total holds at each
  upstream), so behind the sidecar a long prefill alone does not release the total.

The policy's next proposal applies again once the queue heads are younger (or TPOT is over
its SLA). Every rule of the guard applies after this (its P99 trim of long prompts when TPOT
breaches, the KV budget), so what is released stays memory-safe.
"""

from __future__ import annotations

from dataclasses import replace

from rlbatch.control.types import ControlAction, DeploymentStats

HOLD_RELEASE_FRACTION = 0.5
"""The default wait, as a fraction of the SLA's TTFT: a held request's queue head may wait half
of it (``ppo:PATH`` and the recipe's fine-tuning env). Set before it was measured
(BENCHMARKS.md, issue 14, stop 24)."""


def release_late_holds(action: ControlAction, stats: DeploymentStats | None, *,
                       wait_s: float, tpot_sla_s: float, max_total: int) -> ControlAction:
    """``action`` with the holds the module docstring describes released.

    :param action: the policy's proposal.
    :param stats: the tick's snapshot (``None`` before the first tick: nothing waits).
    :param wait_s: how long a held queue head may wait, seconds (> 0).
    :param tpot_sla_s: the SLA's TPOT, seconds.
    :param max_total: the total a released total is set to (the policy's largest).
    :raises ValueError: ``wait_s`` is not positive.
    """
    if not wait_s > 0:
        raise ValueError(f"hold release wait must be > 0 s, got {wait_s}")
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
    if (total < max_total
            and max(stats.oldest_unserved_s, *stats.oldest_wait_s) >= wait_s
            and stats.window.tpot_p99_all_s <= tpot_sla_s):
        total = max_total
        released = True
    return replace(action, caps=tuple(caps), max_num_seqs=total) if released else action
