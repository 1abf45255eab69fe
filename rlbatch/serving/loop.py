"""The one control loop: turns a serving source into one DeploymentStats per tick.

Evaluation runs, the Gymnasium env, fidelity and calibration replays and the sidecar all tick
a :class:`ControlLoop`; nothing else builds :class:`~rlbatch.control.types.DeploymentStats`.
A source is anything that serves requests behind an :class:`~rlbatch.serving.admission.
Admission` (:class:`ServingSource`): a simulated or live :class:`~rlbatch.serving.deployment.
Deployment` replaying a request stream, or the sidecar's HTTP upstreams, whose requests
arrive by themselves. One ``tick()`` advances the source by one control interval under the
action in force and returns the tick's stats; the caller decides the next action and
``apply()``s it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, Protocol, runtime_checkable

from rlbatch.control.discipline import PLAIN, AdmissionDiscipline
from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats, meets_sla
from rlbatch.engine.stats import EngineStats, FinishedRequest
from rlbatch.request import Request
from rlbatch.serving.accounting import abandoned_by_bucket, overload_fields
from rlbatch.serving.admission import Admission
from rlbatch.serving.clients import ClientSession
from rlbatch.serving.deadlines import DeadlineTracker
from rlbatch.serving.metrics import RunTotals, SlidingWindow, summarize

MIN_INTERVAL_S = 1e-6
"""Shortest interval a wall-clock tick reports (rates divide by it)."""


class ServingSource(Protocol):
    """What the control loop needs of whatever serves the requests.

    ``info`` and ``admission`` are attributes; ``run_until`` advances engine time (a no-op
    where real time passes by itself); ``snapshot`` returns one EngineStats per engine
    (interval counters since the previous call); ``done`` says nothing is left to serve;
    ``unfinished`` counts requests queued or inside engines.
    """

    info: DeploymentInfo
    admission: Admission

    def apply(self, action: ControlAction) -> None: ...

    def run_until(self, t_s: float) -> None: ...

    def snapshot(self) -> tuple[EngineStats, ...]: ...

    def done(self) -> bool: ...

    def unfinished(self) -> int: ...


@runtime_checkable
class ReplaySource(ServingSource, Protocol):
    """A source that replays a preloaded, time-sorted request stream (the simulator, live
    in-process engines)."""

    def load(self, requests: Sequence[Request]) -> None: ...

    @property
    def last_arrival_s(self) -> float: ...


class ControlLoop:
    """Ticks a serving source; the only builder of DeploymentStats and the run's one
    accumulator of EngineStats (:class:`~rlbatch.serving.metrics.RunTotals`).

    :param source: a fresh source (a :class:`ReplaySource` when ``requests`` is given).
    :param requests: arrivals sorted by time, replayed by the source; ``None`` when requests
        reach admission by themselves (the sidecar's handlers submit them).
    :param initial_action: the action in force until the first decision.
    :param discipline: admission's discipline for the run (queue order, KV budget), put in
        force here (:attr:`Controller.discipline <rlbatch.control.controllers.Controller>`).
    :param window_s: sliding window of the latency percentiles in the stats.
    :param drain_s: how long after the last arrival a replay may go on.
    :param keep_records: keep every finished and rejected request for :meth:`summary`
        (``False`` for a service that runs for days: only the totals are kept).
    :param track_deadlines: count the requests that can no longer meet the TTFT SLA
        (``DeploymentStats.doomed``; :class:`~rlbatch.serving.deadlines.DeadlineTracker`).
        It needs engines that report every first token and completion
        (``EngineStats.first_tokens``: the simulator, in-process vLLM engines). ``None``:
        on for a replayed stream, off otherwise (the sidecar's HTTP upstreams).
    """

    def __init__(self, source: ServingSource, requests: Sequence[Request] | None,
                 initial_action: ControlAction, *,
                 discipline: AdmissionDiscipline = PLAIN, window_s: float = 30.0,
                 drain_s: float = 600.0, keep_records: bool = True,
                 track_deadlines: bool | None = None) -> None:
        self.source = source
        self.info = source.info
        self.tick_s = self.info.tick_s
        self.window = SlidingWindow(self.info.buckets, self.info.sla, window_s)
        self.totals = RunTotals()
        self.keep_records = keep_records
        self.records: list[FinishedRequest] = []
        self.arrived_total = 0
        self.rejected_total = 0
        self.cancelled_total = 0
        self.last_arrival_s = 0.0
        self.deadline_s = math.inf
        if requests is not None:
            if not isinstance(source, ReplaySource):
                raise TypeError(f"{type(source).__name__} cannot replay a request stream "
                                f"(no load / last_arrival_s)")
            source.load(requests)
            self.last_arrival_s = source.last_arrival_s
            self.deadline_s = self.last_arrival_s + drain_s
        self._planned = None if requests is None else len(requests)
        self._stream: Sequence[Request] = () if requests is None else requests
        if track_deadlines is None:
            track_deadlines = requests is not None
        self.deadlines: DeadlineTracker | None = None
        if track_deadlines:
            self.deadlines = DeadlineTracker(len(self.info.buckets), self.info.sla.ttft_s)
            source.admission.accepted = []
        source.admission.configure(discipline, self.info.sla.ttft_s, self.info.capacity_rps)
        self.action = initial_action
        source.apply(initial_action)
        self.ticks = 0
        self.time_s = 0.0

    @property
    def submitted(self) -> int:
        """Requests in the replayed stream, or arrivals counted so far without one."""
        return self.arrived_total if self._planned is None else self._planned

    def apply(self, action: ControlAction, *, enforce: bool = True) -> None:
        """Make ``action`` the one reported in the stats from now on.

        :param action: the (guarded) action.
        :param enforce: put it in force on the source; ``False`` only records it (the
            sidecar's shadow mode decides but never acts).
        """
        self.action = action
        if enforce:
            self.source.apply(action)

    def tick(self, now_s: float | None = None) -> DeploymentStats:
        """Advance one control interval; return its stats.

        :param now_s: the tick time; ``None`` = the next multiple of ``tick_s`` (engine
            time). A wall-clock source passes its clock; the interval is then the time since
            the previous tick (``tick_s`` for the first).
        """
        self.ticks += 1
        if now_s is None:
            t = self.ticks * self.tick_s
            interval = self.tick_s
        else:
            t = now_s
            interval = max(t - self.time_s, MIN_INTERVAL_S) if self.ticks > 1 else self.tick_s
        self.time_s = t
        source = self.source
        source.run_until(t)
        engine_stats = source.snapshot()
        keep = self.keep_records
        admission = source.admission
        for es in engine_stats:
            self.totals.add(es)
            if es.finished:
                if keep:
                    self.records.extend(es.finished)
                self.window.add(es.finished)
                admission.note_finished(r.finish_s for r in es.finished)
        rejected_records = admission.take_rejected()
        if keep and rejected_records:
            self.records.extend(rejected_records)
        counters = admission.take_counters()
        self.arrived_total += sum(counters.arrived)
        self.rejected_total += sum(counters.rejected)
        self.cancelled_total += sum(counters.cancelled)
        doomed: tuple[int, ...] = ()
        doomed_pending: tuple[int, ...] = ()
        oldest_unserved_s = 0.0
        if self.deadlines is not None:
            self.deadlines.accept(admission.take_accepted())
            departed = admission.take_departed()
            if departed:
                self.deadlines.forget(departed)
            doomed = self.deadlines.update(t, engine_stats)
            doomed_pending = tuple(self.deadlines.doomed_open)
            oldest_unserved_s = self.deadlines.oldest_unserved_s(t)
        return DeploymentStats(
            time_s=t, tick_s=interval, engines=engine_stats, queued=admission.queued(),
            arrived=counters.arrived, rejected=counters.rejected, window=self.window.stats(t),
            action=self.action, kv_budget_blocked=counters.kv_budget_blocked,
            oldest_wait_s=admission.oldest_wait_s(t), doomed=doomed,
            doomed_pending=doomed_pending, oldest_unserved_s=oldest_unserved_s)

    def unfinished_by_bucket(self) -> tuple[int, ...]:
        """Per bucket, requests that arrived by the last tick and neither finished nor were
        rejected (queued, inside an engine, or not yet handed to admission: a replay source
        submits its stream in order, so those are the next ones after ``arrived_total``).

        :raises ValueError: the loop does not track deadlines.
        """
        tracker = self._tracker()
        return tuple(o + u for o, u in zip(tracker.open_count, self._unsubmitted(),
                                           strict=True))

    def unbooked_by_bucket(self) -> tuple[int, ...]:
        """Per bucket, the unfinished requests (:meth:`unfinished_by_bucket`) not yet
        counted as doomed: what an episode's end books as missed on top of the doomed ones.

        :raises ValueError: the loop does not track deadlines.
        """
        tracker = self._tracker()
        return tuple(o - d + u for o, d, u in zip(tracker.open_count, tracker.doomed_open,
                                                  self._unsubmitted(), strict=True))

    def _tracker(self) -> DeadlineTracker:
        if self.deadlines is None:
            raise ValueError("this loop does not track deadlines (track_deadlines=False)")
        return self.deadlines

    def _unsubmitted(self) -> list[int]:
        out = [0] * len(self.info.buckets)
        stream = self._stream
        # the stream's next arrival (arrivals counted by admission include retries)
        i = getattr(self.source, "submitted", self.arrived_total)
        while i < len(stream) and stream[i].arrival_s <= self.time_s:
            out[self.info.buckets.index(stream[i].prompt_tokens)] += 1
            i += 1
        return out

    @property
    def finished(self) -> bool:
        """Every request finished or rejected, or the drain deadline passed."""
        return self.source.done() or self.time_s >= self.deadline_s

    def user_outcomes(self) -> list[tuple[float, bool]]:
        """Every request of the replayed stream as its user saw it: ``(arrival_s, met)``,
        ``met`` when it was served within the SLA (from its first attempt's arrival);
        refused, abandoned and unfinished requests did not meet it.

        :raises ValueError: the loop does not keep records.
        """
        if not self.keep_records:
            raise ValueError("user_outcomes() needs keep_records=True")
        session: ClientSession | None = getattr(self.source, "clients", None)
        users = self.records if session is None else session.users_records(self.records)
        sla = self.info.sla
        met = {r.request_id for r in users if meets_sla(r, sla)}
        return [(r.arrival_s, r.request_id in met) for r in self._stream]

    def summary(self) -> dict[str, Any]:
        """Metric fields of the run so far (see :func:`rlbatch.serving.metrics.summarize`).

        :raises ValueError: the loop does not keep records.
        """
        if not self.keep_records:
            raise ValueError("summary() needs keep_records=True")
        makespan = max(map(attrgetter("finish_s"), self.records), default=0.0)
        makespan = max(makespan, self.last_arrival_s)
        session: ClientSession | None = getattr(self.source, "clients", None)
        buckets = self.info.buckets
        users = self.records if session is None else session.users_records(self.records)
        row = summarize(users, buckets, self.info.sla,
                        makespan if makespan > 0 else math.nan, self.totals,
                        submitted=self.submitted, unfinished=self.source.unfinished(),
                        abandoned=abandoned_by_bucket(session, buckets))
        row["sim_seconds"] = makespan
        overload = overload_fields(users, buckets, self.totals, session=session,
                                   refusals=self.source.admission.refusals)
        for name, fields_b in overload.pop("per_bucket_overload").items():
            row["per_bucket"][name].update(fields_b)
        row.update(overload)
        return row
