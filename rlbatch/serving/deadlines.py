"""TTFT-deadline accounting: which accepted requests can no longer meet the TTFT SLA, and how
long the oldest one still without a first token has waited."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from typing import Any

from rlbatch.engine.stats import EngineStats

_PENDING, _SERVED, _DOOMED = 0, 1, 2


class DeadlineTracker:
    """Exact TTFT-deadline accounting of the requests admission accepted.

    A request is *doomed* once it can no longer meet the TTFT SLA: its deadline (arrival +
    ``ttft_s``) passed by the tick time without a first token, wherever it waits (admission
    queue or engine), or an engine reported its first token (or its completion) past the
    deadline; an engine's last iteration may end after the tick time, so the latter can come
    a tick early. Each request is doomed at most once. The deadline test is the one
    :func:`~rlbatch.control.types.meets_sla` applies (``first_token - arrival <= ttft_s``),
    so a completion that missed its TTFT was always counted here first.

    :param num_buckets: number of buckets.
    :param ttft_s: the SLA's TTFT limit.
    """

    def __init__(self, num_buckets: int, ttft_s: float) -> None:
        self.ttft_s = ttft_s
        # deadlines to sweep: in arrival order as accepted (a replay accepts in arrival
        # order), and a heap for any request accepted out of that order
        self._in_order: deque[tuple[float, int]] = deque()
        self._heap: list[tuple[float, int]] = []
        # doomed by the sweep with no first token yet: what :meth:`oldest_unserved_s` reads
        # once the sweep has dropped them; entries that since got one are dropped lazily
        self._late: list[tuple[float, int]] = []
        # request id -> [bucket, arrival_s, state, first token seen]; removed when the
        # request finishes
        self._open: dict[int, list[Any]] = {}
        self.open_count = [0] * num_buckets
        """Per bucket, accepted requests not finished yet."""
        self.doomed_open = [0] * num_buckets
        """Per bucket, doomed requests not finished yet."""

    def accept(self, entries: Iterable[tuple[int, float, int]]) -> None:
        """Track newly accepted requests.

        :param entries: ``(request_id, arrival_s, bucket)`` each.
        """
        in_order = self._in_order
        for rid, arrival, bucket in entries:
            self._open[rid] = [bucket, arrival, _PENDING, False]
            if not in_order or in_order[-1][0] <= arrival:
                in_order.append((arrival, rid))
            else:
                heapq.heappush(self._heap, (arrival, rid))
            self.open_count[bucket] += 1

    def update(self, now_s: float, engine_stats: Iterable[EngineStats]) -> tuple[int, ...]:
        """Fold one tick's first tokens and completions in, then sweep the deadlines passed
        by ``now_s``.

        :param now_s: the tick time.
        :param engine_stats: the tick's engine snapshots.
        :returns: per bucket, requests doomed in this tick.
        """
        doomed = [0] * len(self.open_count)
        ttft = self.ttft_s
        opened = self._open
        for es in engine_stats:
            for rid, first_s in es.first_tokens:
                entry = opened.get(rid)
                if entry is None:
                    continue
                entry[3] = True
                if entry[2] == _PENDING:
                    if first_s - entry[1] <= ttft:
                        entry[2] = _SERVED
                    else:
                        self._doom(entry, doomed)
            for rec in es.finished:
                entry = opened.pop(rec.request_id, None)
                if entry is None:
                    continue
                bucket = entry[0]
                self.open_count[bucket] -= 1
                if entry[2] == _DOOMED:
                    self.doomed_open[bucket] -= 1
                elif entry[2] == _PENDING and not rec.ttft_s <= ttft:
                    doomed[bucket] += 1  # finished late before any sweep saw it
        in_order = self._in_order
        while in_order and now_s - in_order[0][0] > ttft:
            arrival, rid = in_order.popleft()
            entry = opened.get(rid)
            if entry is not None and entry[2] == _PENDING:
                self._doom(entry, doomed)
                heapq.heappush(self._late, (arrival, rid))
        heap = self._heap
        while heap and now_s - heap[0][0] > ttft:
            arrival, rid = heapq.heappop(heap)
            entry = opened.get(rid)
            if entry is not None and entry[2] == _PENDING:
                self._doom(entry, doomed)
                heapq.heappush(self._late, (arrival, rid))
        return tuple(doomed)

    def forget(self, request_ids: Iterable[int]) -> None:
        """Requests that left without finishing (expired, cancelled, aborted): no longer
        open; their sweep entries are dropped lazily.

        :param request_ids: their ids.
        """
        for rid in request_ids:
            entry = self._open.pop(rid, None)
            if entry is None:
                continue
            self.open_count[entry[0]] -= 1
            if entry[2] == _DOOMED:
                self.doomed_open[entry[0]] -= 1

    def oldest_unserved_s(self, now_s: float) -> float:
        """How long the oldest accepted request still without a first token has waited,
        wherever it waits (admission queue, an engine's waiting queue, or mid-prefill), as of
        the last :meth:`update`; 0 when there is none. Exact when every :meth:`accept` is
        followed by an :meth:`update` before this call (as the control loop does): a request
        the sweep doomed is older than anything accepted before that sweep.

        :param now_s: the time to measure the wait to (the last update's tick time).
        """
        opened = self._open
        oldest = math.inf
        late = self._late
        while late:
            entry = opened.get(late[0][1])
            if entry is not None and not entry[3]:
                oldest = late[0][0]
                break
            heapq.heappop(late)
        if oldest == math.inf:
            in_order = self._in_order
            while in_order:
                entry = opened.get(in_order[0][1])
                if entry is not None and entry[2] == _PENDING:
                    oldest = in_order[0][0]
                    break
                # served or finished before its deadline: nothing left to sweep for it
                in_order.popleft()
            heap = self._heap
            while heap:
                entry = opened.get(heap[0][1])
                if entry is not None and entry[2] == _PENDING:
                    oldest = min(oldest, heap[0][0])
                    break
                heapq.heappop(heap)
        return max(now_s - oldest, 0.0) if oldest != math.inf else 0.0

    def _doom(self, entry: list[Any], doomed: list[int]) -> None:
        entry[2] = _DOOMED
        doomed[entry[0]] += 1
        self.doomed_open[entry[0]] += 1
