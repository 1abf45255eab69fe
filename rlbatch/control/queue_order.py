"""The order of admission's queues a controller asks for.

``fifo``: oldest first, as vLLM's own queue. ``deadline``: a request that has waited longer
than the SLA's TTFT (it can no longer meet it) goes after every request that still can,
oldest first within each class (:attr:`ControlAction.late_after_s
<rlbatch.control.types.ControlAction>`). Under overload FIFO serves every request late;
deadline order serves the ones that can still make it first and the late ones when there is
room. Nothing is dropped: a late request waits longer, and a client's timeout or the
sidecar's queue timeout still bounds how long.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal, get_args

from rlbatch.control.types import SLA, ControlAction

QueueOrder = Literal["fifo", "deadline"]
QUEUE_ORDERS: tuple[str, ...] = get_args(QueueOrder)

PPO_QUEUE_ORDER: QueueOrder = "fifo"
"""The order ``ppo:PATH`` serves in and the recipe fine-tunes in. Deadline order raised the
geo-mean on the Llama-2-7B deployments' unseen runs (1.12x -> 1.19x and 1.10x -> 1.30x the
best static) but lost up to 6% on a near-collapse run of H100 / Llama-3.1-8B, and missed the
rule written for it before those runs (BENCHMARKS.md, issue 14, stop 28): ``order=deadline``
asks for it."""


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
    late_after_s = sla.ttft_s if order == "deadline" else None
    if action.late_after_s == late_after_s:
        return action
    return replace(action, late_after_s=late_after_s)
