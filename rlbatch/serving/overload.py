"""Overload at arrival: the deployment's drain rate and an arrival's predicted TTFT.

A request that cannot get its first token within the SLA is better answered at once (429 with
a ``Retry-After``) than served late: the client learns it in milliseconds, and the work spent
on it goes to requests that can still be served. The prediction is the queueing estimate
Mooncake's early rejection and Scorpio's deadline admission make: the requests that will be
served before the arrival, divided by the rate the deployment drains requests at.

* **Ahead of it**, in the order admission serves: every request still waiting to start (in
  admission's queues or in an engine's waiting queue) under FIFO; under deadline order only
  the waiting requests that are still on time (arrived within the SLA's TTFT), since the late
  ones go after any on-time arrival.
* **Drain rate**: completions per second over the last ``drain_window_s`` (the rate slots
  free up when the deployment is saturated, which it is whenever requests wait). Until
  :data:`MIN_COMPLETIONS` completions have been seen in the window (a cold start) the
  deployment's reference capacity stands in for it (:mod:`rlbatch.profiles.capacity`;
  without one no wait is predicted): at a cold start under overload nothing completes for
  seconds while hundreds of requests are let in, and those handed to an engine whose KV cache
  is full wait in its own queue, where no TTL reaches them (H200 / Llama-3.1-70B at 1.5x its
  knee answered its last percent after 6.4 s; with the capacity, 1.9 s).
* **Its own prefill**, added to the wait: the time its prompt, minus the prefix the
  engine's caches hold, takes to compute behind the prefills already running on the engine
  of its pool where that is least (:meth:`~rlbatch.engine.base.Engine.prefill_time_s`, from
  the engine's step-time model; decodes left out, so a floor). A prompt of tens of thousands
  of tokens can miss the TTFT on an empty deployment, and a long prefill running delays
  every newcomer by seconds; without this term such requests were served and answered after
  20-40 s. One whose prefill alone, on an empty engine, misses the TTFT is told not to
  retry. The wait is compared with
  ``slack x TTFT``, the wait plus the prefill with the TTFT itself (``slack x TTFT`` for
  a slack over 1): a floor needs no margin, and comparing it with a slack under 1 would
  shed long prompts first whenever anything waits (more requests served, by refusing the
  long ones). Engines without a latency model (a live engine, the sidecar's upstreams)
  give none, and only the wait is predicted.

Both the simulator and the sidecar feed the same :class:`DrainRate` through
:meth:`~rlbatch.serving.admission.Admission.note_finished`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

MIN_COMPLETIONS = 8
"""Completions the window must hold before a TTFT is predicted."""


class DrainRate:
    """Completions per second over a sliding window.

    :param window_s: the window.
    :param prior_rps: the rate assumed until it is measured (``None``: unknown).
    """

    def __init__(self, window_s: float, prior_rps: float | None = None) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be > 0 and finite, got {window_s}")
        self.window_s = window_s
        self.prior_rps = prior_rps
        self._times: deque[float] = deque()

    @property
    def prior_rps(self) -> float | None:
        return self._prior_rps

    @prior_rps.setter
    def prior_rps(self, rps: float | None) -> None:
        if rps is not None and not (rps > 0 and math.isfinite(rps)):
            raise ValueError(f"prior_rps must be > 0 and finite or None, got {rps}")
        self._prior_rps = rps

    def note(self, finish_times_s: Iterable[float]) -> None:
        """Count completions (their finish times, in any order within one call).

        :param finish_times_s: when each finished.
        """
        times = self._times
        for t in sorted(finish_times_s):
            if not times or t >= times[-1]:
                times.append(t)
            else:  # a late report of an earlier finish: keep the window ordered
                times.insert(_insert_at(times, t), t)

    def rate(self, now_s: float) -> float | None:
        """Completions per second over ``(now_s - window_s, now_s]``; :attr:`prior_rps`
        while fewer than :data:`MIN_COMPLETIONS` fall in it. Within a window of a cold start
        the measured rate is underestimated (the deployment has not had a whole window to
        drain in), so the prediction errs toward refusing.

        :param now_s: the time.
        """
        times = self._times
        start = now_s - self.window_s
        while times and times[0] <= start:
            times.popleft()
        count = len(times) - _after(times, now_s)
        if count < MIN_COMPLETIONS:
            return self._prior_rps
        return count / self.window_s

    def copy(self) -> DrainRate:
        """An independent copy (a forked deployment's)."""
        new = DrainRate(self.window_s, self._prior_rps)
        new._times = deque(self._times)
        return new


def predicted_wait_s(ahead: int, rate_rps: float | None) -> float:
    """How long an arrival waits to start with ``ahead`` requests before it at ``rate_rps``:
    0 with nothing ahead, ``ahead / rate`` otherwise, 0 while the rate is unknown.

    :param ahead: requests served before it.
    :param rate_rps: the drain rate (``None``: unknown).
    """
    if ahead <= 0 or rate_rps is None or rate_rps <= 0:
        return 0.0
    return ahead / rate_rps


def _insert_at(times: deque[float], t: float) -> int:
    lo, hi = 0, len(times)
    while lo < hi:
        mid = (lo + hi) // 2
        if times[mid] <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _after(times: deque[float], now_s: float) -> int:
    """How many of ``times`` (ascending) lie after ``now_s`` (a sidecar may note a finish
    a little after the clock it predicts at)."""
    n = 0
    for t in reversed(times):
        if t <= now_s:
            break
        n += 1
    return n
