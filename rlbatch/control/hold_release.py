"""Hold release: a policy may hold requests back only while they can still meet their SLA.

A ``total_share`` policy holds requests back in two ways: a bucket's trim (its share of the
engine-wide total, to keep its long prefills from inflating everyone's TPOT) and the total
itself (``max_num_seqs``, to keep every decode fast). Either pays only while the requests it
holds can still meet their TTFT. Once a queue's head has waited ``wait_s`` (a fraction of the
SLA's TTFT), holding it longer turns the hold into a miss the policy caused, and repeated it
starves the bucket, which the must-checks forbid. So, on every tick:

* **trims**: a bucket under the total whose queue head has waited ``wait_s`` gets its cap
  lifted to the total (``None``);
* **the total**: while any accepted request still without a first token has waited ``wait_s``,
  the total is lifted to ``max_total``, whatever TPOT is (``tpot_tolerance``,
  :data:`RELEASE_TPOT_TOLERANCE`; with a finite tolerance, unless TPOT P99 is over it: a
  window with no TPOT sample never holds the total). That request may wait in an admission
  queue or inside an engine: a bucket without a trim passes its requests straight to the
  engines, whose waiting queues the total (vLLM's ``max_num_seqs``) holds, so reading only the
  admission queues' heads let a total starve requests it held there
  (DeploymentStats.oldest_unserved_s; a loop that does not track deadlines reports 0 there,
  and the admission queues' heads stand alone). A replay counts a request mid-prefill too (it
  has no first token yet); the sidecar, which sees no first token of a non-streamed answer,
  counts the requests it has not forwarded (admission queues and what the total holds at each
  upstream), so behind the sidecar a long prefill alone does not release the total.

  Why not only while TPOT is within its SLA (an earlier rule): a total cut while TPOT P99 is a
  little over the SLA turns the requests it holds into certain TTFT misses, for a TPOT gain
  the 30 s window barely shows. On A100 / Llama-3.1-8B, held-back Azure at 1.28, seed 0 cut
  the total from 256 to 64-96 for 20 s while the window's TPOT P99 read 0.122-0.129 s (SLA
  0.1 s; ``static:256``'s over the same seconds: 0.125-0.129 s), and over the run 383
  requests missed their TTFT against ``static:256``'s 102 (BENCHMARKS.md).
  TPOT breaches belong to the guard's P99 rule, which applies after this release.

The policy's next proposal applies again once the queue heads are younger. Every rule of the
guard applies after this (its P99 trim of long prompts when TPOT breaches, the KV budget), so
what is released stays memory-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rlbatch.control.types import ControlAction, DeploymentStats

HOLD_RELEASE_FRACTION = 0.5
"""The default wait, as a fraction of the SLA's TTFT: a held request's queue head may wait half
of it (``ppo:PATH`` and the recipe's fine-tuning env). Set before it was measured
(BENCHMARKS.md)."""


RELEASE_TPOT_TOLERANCE = math.inf
"""The total is released unless the window's TPOT P99 is over this multiple of the SLA's TPOT:
``inf``, whatever it is; 1 holds the total while TPOT P99 is over its SLA (the earlier rule).
Chosen on the training traffic only (BENCHMARKS.md)."""


@dataclass(frozen=True)
class HoldRelease:
    """When held-back work is released, relative to the SLA in force (so one setting serves
    any SLA, in training and in serving alike).

    :param wait_fraction: a held queue head may wait this fraction of the SLA's TTFT (> 0).
    :param tpot_tolerance: the total is released unless the window's TPOT P99 is over this
        multiple of the SLA's TPOT (>= 1; ``math.inf``: whatever TPOT is).
    :param total: release the total too; off: only the trims (a policy that chooses its
        total for the traffic keeps it).
    """

    wait_fraction: float = HOLD_RELEASE_FRACTION
    tpot_tolerance: float = RELEASE_TPOT_TOLERANCE
    total: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.wait_fraction) and self.wait_fraction > 0):
            raise ValueError(f"hold release wait_fraction must be > 0 (a fraction of the SLA's "
                             f"TTFT), got {self.wait_fraction}")
        if not self.tpot_tolerance >= 1.0:
            raise ValueError(f"hold release tpot_tolerance must be >= 1 (a multiple of the "
                             f"SLA's TPOT), got {self.tpot_tolerance}")


DEFAULT_RELEASE = HoldRelease()
"""The release ``ppo:PATH`` serves with and the recipe fine-tunes with."""


def release_late_holds(action: ControlAction, stats: DeploymentStats | None, *,
                       wait_s: float, tpot_sla_s: float, max_total: int,
                       tpot_tolerance: float = RELEASE_TPOT_TOLERANCE,
                       release_total: bool = True) -> ControlAction:
    """``action`` with the holds the module docstring describes released.

    :param action: the policy's proposal.
    :param stats: the tick's snapshot (``None`` before the first tick: nothing waits).
    :param wait_s: how long a held queue head may wait, seconds (> 0).
    :param tpot_sla_s: the SLA's TPOT, seconds.
    :param max_total: the total a released total is set to (the policy's largest).
    :param tpot_tolerance: the total is released unless the window's TPOT P99 is over this
        multiple of the SLA's TPOT (``math.inf``: whatever TPOT is; a window with no TPOT
        sample never holds it).
    :param release_total: release the total as well as the trims.
    :raises ValueError: ``wait_s`` is not positive, or ``tpot_tolerance`` is under 1.
    """
    if not wait_s > 0:
        raise ValueError(f"hold release wait must be > 0 s, got {wait_s}")
    if not tpot_tolerance >= 1.0:
        raise ValueError(f"hold release TPOT tolerance must be >= 1, got {tpot_tolerance}")
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
    # not (over): a window with no TPOT sample (nan) does not hold the total, as the guard's
    # P99 rule reads no breach there
    if (release_total and total < max_total
            and max(stats.oldest_unserved_s, *stats.oldest_wait_s) >= wait_s
            and not stats.window.tpot_p99_all_s > tpot_sla_s * tpot_tolerance):
        total = max_total
        released = True
    return replace(action, caps=tuple(caps), max_num_seqs=total) if released else action
