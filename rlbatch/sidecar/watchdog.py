"""Time limits of one upstream request that never cut a healthy stream.

A total time limit cuts a long stream that is making progress. :class:`ProgressWatchdog`
instead bounds the wait for the first byte of the answer (``first_byte_s``) and then each gap
between two pieces of it (``idle_s``): the stream may run for as long as it keeps sending.
It cancels the task it guards, like :func:`asyncio.timeout`, and turns that cancellation into
:class:`UpstreamTimeout` naming the phase; a cancellation from elsewhere (the client went
away) passes through untouched.

Progress costs one clock read per chunk: the timer is re-armed only when it fires early.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Literal

Phase = Literal["first_byte", "idle"]


class UpstreamTimeout(Exception):
    """The upstream sent nothing for too long.

    :param phase: ``first_byte`` (no answer yet) or ``idle`` (a stream stalled).
    :param limit_s: the limit that tripped.
    """

    def __init__(self, phase: Phase, limit_s: float) -> None:
        what = ("no answer within" if phase == "first_byte" else "no data for")
        super().__init__(f"{what} {limit_s:g} s")
        self.phase: Phase = phase
        self.limit_s = limit_s


class ProgressWatchdog:
    """``async with ProgressWatchdog(first_byte_s, idle_s) as dog: ... dog.progress()``.

    :param first_byte_s: longest wait before the first :meth:`progress`.
    :param idle_s: longest gap between two :meth:`progress` calls after that.
    """

    def __init__(self, first_byte_s: float, idle_s: float) -> None:
        self.first_byte_s = first_byte_s
        self.idle_s = idle_s
        self.phase: Phase = "first_byte"
        self._loop = asyncio.get_running_loop()
        self._last = 0.0
        self._task: asyncio.Task[object] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._fired = False

    async def __aenter__(self) -> ProgressWatchdog:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("ProgressWatchdog must be used inside a task")
        self._task = task
        self._last = self._loop.time()
        self._handle = self._loop.call_at(self._last + self.first_byte_s, self._check)
        return self

    def progress(self) -> None:
        """Something arrived: from now on the idle limit applies."""
        self._last = self._loop.time()
        if self.phase == "first_byte":
            self.phase = "idle"
            if self._handle is not None:
                self._handle.cancel()
                self._handle = self._loop.call_at(self._last + self.idle_s, self._check)

    def _check(self) -> None:
        self._handle = None
        limit = self.first_byte_s if self.phase == "first_byte" else self.idle_s
        due = self._last + limit
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self._fired = True
        assert self._task is not None
        self._task.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if not self._fired:
            return
        assert self._task is not None
        if self._task.uncancel() == 0 and exc_type is asyncio.CancelledError:
            limit = self.first_byte_s if self.phase == "first_byte" else self.idle_s
            raise UpstreamTimeout(self.phase, limit) from exc
