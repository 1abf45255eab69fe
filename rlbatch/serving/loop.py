"""The control loop shared by evaluation runs, the Gymnasium env and (later) the sidecar.

One ``tick()`` advances the deployment by one control interval under the action in force and
returns the tick's DeploymentStats; the caller decides the next action and ``apply()``s it.
"""

from __future__ import annotations

import math
from typing import Any

from rlbatch.control.types import ControlAction, DeploymentStats
from rlbatch.engine.stats import FinishedRequest
from rlbatch.request import Request
from rlbatch.serving.deployment import Deployment
from rlbatch.serving.metrics import RunTotals, SlidingWindow, summarize


class ControlLoop:
    """Ticks a deployment over a stream of requests.

    :param deployment: a freshly built deployment.
    :param requests: arrivals, sorted by time.
    :param initial_action: the action in force until the first decision.
    :param window_s: sliding window of the latency percentiles in the stats.
    :param drain_s: how long after the last arrival the run may go on.
    """

    def __init__(self, deployment: Deployment, requests: list[Request],
                 initial_action: ControlAction, *, window_s: float = 30.0,
                 drain_s: float = 600.0) -> None:
        self.deployment = deployment
        self.info = deployment.info
        self.tick_s = self.info.tick_s
        self.window = SlidingWindow(self.info.buckets, self.info.sla, window_s)
        self.totals = RunTotals()
        self.records: list[FinishedRequest] = []
        self.submitted = len(requests)
        deployment.load(requests)
        self.action = initial_action
        deployment.apply(initial_action)
        self.deadline_s = deployment.last_arrival_s + drain_s
        self.ticks = 0
        self.time_s = 0.0

    def apply(self, action: ControlAction) -> None:
        """Put ``action`` in force from now on."""
        self.action = action
        self.deployment.apply(action)

    def tick(self) -> DeploymentStats:
        """Advance one control interval; return its stats."""
        self.ticks += 1
        t = self.ticks * self.tick_s
        self.time_s = t
        deployment = self.deployment
        deployment.run_until(t)
        engine_stats = deployment.snapshot()
        for es in engine_stats:
            self.totals.add(es)
            if es.finished:
                self.records.extend(es.finished)
                self.window.add(es.finished)
        admission = deployment.admission
        if admission.rejected:
            self.records.extend(admission.rejected)
            admission.rejected.clear()
        arrived, rejected, budget_blocked = admission.take_tick_counters()
        return DeploymentStats(
            time_s=t, tick_s=self.tick_s, engines=engine_stats, queued=admission.queued(),
            arrived=arrived, rejected=rejected, window=self.window.stats(t),
            action=self.action, kv_budget_blocked=budget_blocked,
            oldest_wait_s=admission.oldest_wait_s(t))

    @property
    def finished(self) -> bool:
        """Every request finished or rejected, or the drain deadline passed."""
        return self.deployment.done() or self.time_s >= self.deadline_s

    def summary(self) -> dict[str, Any]:
        """Metric fields of the run so far (see :func:`rlbatch.serving.metrics.summarize`)."""
        makespan = max((r.finish_s for r in self.records), default=0.0)
        makespan = max(makespan, self.deployment.last_arrival_s)
        row = summarize(self.records, self.info.buckets, self.info.sla,
                        makespan if makespan > 0 else math.nan, self.totals,
                        submitted=self.submitted, unfinished=self.deployment.unfinished())
        row["sim_seconds"] = makespan
        return row
