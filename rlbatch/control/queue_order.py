"""The order of admission's queues a controller asks for.

``fifo``: oldest first, as vLLM's own queue. ``deadline``: a request that has waited longer
than the SLA's TTFT (it can no longer meet it) goes after every request that still can,
oldest first within each class, and an engine is given no more requests than it runs at once
(its ``max_num_seqs``), so that requests wait in admission's queues, where the order applies,
rather than in the engine's own FIFO queue (:attr:`ControlAction.late_after_s
<rlbatch.control.types.ControlAction>`). Under overload FIFO serves every request late;
deadline order serves the ones that can still make it first and the late ones when there is
room. The order drops nothing: a late request waits longer, and a client's timeout or the
sidecar's queue timeout still bounds how long. What an engine's own queue held before waits
in admission's now, so a queue bound (``--max-queue-len``) counts it. Under sustained overload
a late request is always queued, so the hold release (:mod:`rlbatch.control.hold_release`),
which reads the oldest request without a first token, keeps a policy's total at the top of
its ladder there.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal, get_args

from rlbatch.control.types import SLA, ControlAction

QueueOrder = Literal["fifo", "deadline"]
QUEUE_ORDERS: tuple[str, ...] = get_args(QueueOrder)

PPO_QUEUE_ORDER: QueueOrder = "deadline"
"""The order ``ppo:PATH`` serves in and the recipe fine-tunes in (``order=fifo`` for FIFO,
stops 1-27). Chosen on training traffic and kept by a rule written before the unseen runs
(BENCHMARKS.md, issue 14, stop 28): every shipped seed meets the must-checks on every
deployment with it (13 of 18 pairs with FIFO)."""


def check_queue_order(order: str) -> QueueOrder:
    """``order`` as a :data:`QueueOrder`.

    :param order: ``fifo`` or ``deadline``.
    :raises ValueError: any other value.
    """
    if order not in QUEUE_ORDERS:
        raise ValueError(f"queue order must be one of {', '.join(QUEUE_ORDERS)}, got {order!r}")
    return order  # type: ignore[return-value]


def in_order(action: ControlAction, order: QueueOrder, sla: SLA) -> ControlAction:
    """``action`` with the queue order ``order`` (deadline order: late after the SLA's TTFT).

    :param action: a proposal.
    :param order: the order.
    :param sla: the deployment's SLA.
    """
    # an SLA without a TTFT limit has no late requests: FIFO
    late_after_s = sla.ttft_s if order == "deadline" and math.isfinite(sla.ttft_s) else None
    if action.late_after_s == late_after_s:
        return action
    return replace(action, late_after_s=late_after_s)
