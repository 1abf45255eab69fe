"""The wall clock that the live engines of one deployment share (engine time = wall time).

An engine's ``now_s`` is this clock at the end of its last action, so
:meth:`rlbatch.serving.deployment.Deployment.run_until` picks the engine that is furthest
behind and several engines on one clock take turns; an idle engine sleeps only when every
engine on the clock is idle (:meth:`LiveClock.all_idle`).
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["ClockedEngine", "LiveClock"]

_SPIN_S = 0.001
"""An idle wait sleeps until this long before its target and spins the rest."""


class ClockedEngine(Protocol):
    """What the clock needs of an engine that runs on it."""

    def is_idle(self) -> bool:
        """No request inside the engine."""

    def rebase(self) -> None:
        """Follow a :meth:`LiveClock.reset` (the clock restarts at 0)."""


class LiveClock:
    """Wall clock shared by the live engines of one deployment.

    :param origin: ``time.monotonic()`` value that is engine time 0 (default: now).
    """

    def __init__(self, origin: float | None = None) -> None:
        self.origin = time.monotonic() if origin is None else origin
        self.engines: list[ClockedEngine] = []

    def now(self) -> float:
        """Seconds since the origin."""
        return time.monotonic() - self.origin

    def sleep_until(self, t_s: float) -> None:
        """Sleep until engine time ``t_s`` (returns at once if it has passed).

        :param t_s: engine time to wake at.
        """
        delay = t_s - self.now()
        if delay > _SPIN_S:
            time.sleep(delay - _SPIN_S)
        while self.now() < t_s:  # the last stretch spins: sleep() overshoots by ~0.1 ms
            pass

    def all_idle(self) -> bool:
        """No engine on this clock holds a request."""
        return all(e.is_idle() for e in self.engines)

    def reset(self) -> None:
        """Make now engine time 0 (before a run; engines must be idle)."""
        if not self.all_idle():
            raise RuntimeError("LiveClock.reset() with requests inside an engine")
        self.origin = time.monotonic()
        for eng in self.engines:
            eng.rebase()
