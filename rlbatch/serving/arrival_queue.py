"""Admission's queues in arrival order: where the on-time requests start, and when a request
turns late (deadline order, :mod:`rlbatch.control.discipline`)."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque

from rlbatch.request import Request

QueueItem = tuple[Request, int, bool]
"""A queued request, the prompt tokens it is served with, and whether they were truncated."""


def add_by_arrival(queue: deque[QueueItem], item: QueueItem) -> None:
    """Append ``item``, or insert it in arrival order: the sidecar may submit out of arrival
    order (it sizes a prompt first), and :func:`first_on_time` needs the order.

    :param queue: a bucket's queue, in arrival order.
    :param item: the request to add.
    """
    if queue and queue[-1][0].arrival_s > item[0].arrival_s:
        queue.insert(bisect_right(queue, item[0].arrival_s, key=_arrival_s), item)
    else:
        queue.append(item)


def first_on_time(queue: deque[QueueItem], cutoff: float) -> int:
    """The index of the first request of ``queue`` (in arrival order) that arrived at or
    after ``cutoff``; ``len(queue)`` when none did.

    :param queue: a bucket's queue, in arrival order.
    :param cutoff: the earliest arrival still on time.
    """
    lo, hi = 0, len(queue)
    while lo < hi:
        mid = (lo + hi) // 2
        if queue[mid][0].arrival_s < cutoff:
            lo = mid + 1
        else:
            hi = mid
    return lo


def turns_late_at(arrival_s: float, late_after_s: float) -> float:
    """The first clock reading at which a request that arrived at ``arrival_s`` is late
    (``arrival_s < now - late_after_s`` in floating point, as admission tests it): a
    skipping engine stops at the first boundary from there, as stepping reorders.

    :param arrival_s: the request's arrival.
    :param late_after_s: the wait after which it is late.
    """
    turn = arrival_s + late_after_s
    while not arrival_s < turn - late_after_s:
        turn = math.nextafter(turn, math.inf)
    while arrival_s < math.nextafter(turn, -math.inf) - late_after_s:
        turn = math.nextafter(turn, -math.inf)
    return turn


def _arrival_s(item: QueueItem) -> float:
    return item[0].arrival_s
