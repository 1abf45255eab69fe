"""The sidecar's control tick: snapshot through the ControlLoop, decide, guard fallback, apply.

Every ``tick_s`` (after the upstreams' ``/metrics`` were scraped) the
:class:`~rlbatch.serving.loop.ControlLoop` over the upstreams builds the tick's
:class:`~rlbatch.control.types.DeploymentStats`, the controller (policy + guard, exactly as
in the simulator) decides, and the action is applied. A failed scrape or a failing controller
applies the guard's :meth:`~rlbatch.control.guard.Guard.fallback_action` caps instead
(logged). In shadow mode the controller decides and the stats report its decision, but no cap
is applied and every request goes to one pool. The tick's stats then go to Prometheus and
TensorBoard, named by the snapshot table.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace

from rlbatch.control.controllers import Controller
from rlbatch.control.discipline import PLAIN, AdmissionDiscipline
from rlbatch.control.guard import GuardConfig
from rlbatch.control.pipeline import DecisionPipeline
from rlbatch.control.stats_metrics import MetricContext, guard_readings
from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats
from rlbatch.serving.loop import ControlLoop
from rlbatch.sidecar.prom import SidecarMetrics
from rlbatch.sidecar.settings import SidecarSettings
from rlbatch.sidecar.source import UpstreamSource
from rlbatch.sidecar.tensorboard import DecisionWriter, tick_scalars

_LOG = logging.getLogger("rlbatch.sidecar")

ControllerBuilder = Callable[[str], Controller]
"""Builds a controller from its whole spec (:func:`rlbatch.control.controllers.make_controller`)."""


def fallback_guard_config(controller: Controller) -> GuardConfig:
    """The guard configuration behind ``controller`` (the default one when it has none).

    :param controller: any controller.
    """
    pipeline = controller.pipeline
    return pipeline.config if pipeline is not None else GuardConfig()


def describe_action(action: ControlAction, bucket_names: tuple[str, ...],
                    discipline: AdmissionDiscipline = PLAIN) -> str:
    """One line: ``0-1k=32@fp16 1k-2k=8@fp8 ...`` (``max_num_seqs@fp16=40`` for a pool's lower
    cap, ``order=deadline`` under deadline order).

    :param action: the action.
    :param bucket_names: bucket labels.
    :param discipline: admission's discipline in force.
    """
    parts = [f"{name}={'-' if cap is None else cap}@{pool}"
             for name, cap, pool in zip(bucket_names, action.caps, action.pools, strict=True)]
    if action.max_num_seqs is not None:
        parts.append(f"max_num_seqs={action.max_num_seqs}")
    parts += [f"max_num_seqs@{pool}={cap}" for pool, cap in action.pool_max_num_seqs]
    if discipline.order != "fifo":
        parts.append(f"order={discipline.order}")
    return " ".join(parts)


class SidecarControl:
    """The controller in charge, its decisions and the control loop over the upstreams.

    :param settings: the sidecar's settings.
    :param controller: the controller; reset here with ``source.info``, so a policy that
        does not fit (buckets, pools, observation size) fails before anything starts.
    :param factory: builds a controller from its name (``None``: switching by name is off).
    :param source: the upstreams as a control-loop source.
    :param metrics: the sidecar's Prometheus metrics.
    :param describe: the deployment as the upstreams describe it now.
    """

    def __init__(self, settings: SidecarSettings, controller: Controller,
                 factory: ControllerBuilder | None, source: UpstreamSource,
                 metrics: SidecarMetrics, describe: Callable[[], DeploymentInfo]) -> None:
        self.settings = settings
        self.bucket_names = settings.buckets.names
        self.source = source
        self.metrics = metrics
        self._factory = factory
        self._describe = describe
        self.controller = controller
        self.decided = controller.reset(source.info)
        source.in_force = self._shadow_action() if settings.shadow else self.decided
        self._fallback = controller.pipeline or DecisionPipeline(fallback_guard_config(controller))
        if controller.pipeline is None:
            self._fallback.reset(source.info)
        self._guard_seen: dict[str, int] = {}
        self.loop: ControlLoop | None = None
        self.writer: DecisionWriter | None = None
        self.fallback_active = False
        self.last_decision_s = math.nan

    @property
    def in_force(self) -> ControlAction:
        """The action in force on the upstreams."""
        return self.source.in_force

    @property
    def ticks(self) -> int:
        """Control ticks run."""
        return 0 if self.loop is None else self.loop.ticks

    def _shadow_action(self) -> ControlAction:
        n = len(self.bucket_names)
        return ControlAction((None,) * n, (self.settings.effective_shadow_pool,) * n)

    def start(self, info: DeploymentInfo) -> None:
        """The upstreams answered: reset the controller with what they told, start the
        control loop and put the first action in force.

        :param info: the deployment, described from the upstreams.
        """
        self.source.info = info
        self.decided = self.controller.reset(info)
        if self.controller.pipeline is None:
            self._fallback.reset(info)
        self._guard_seen = {}
        shadow = self.settings.shadow
        self.loop = ControlLoop(self.source, None,
                                self._shadow_action() if shadow else self.decided,
                                discipline=self.discipline, window_s=self.settings.window_s,
                                keep_records=False)
        if shadow:
            self.loop.apply(self.decided, enforce=False)

    @property
    def discipline(self) -> AdmissionDiscipline:
        """Admission's discipline: the controller's (shadow mode: a plain vLLM server's,
        as nothing the controller decides is applied)."""
        return PLAIN if self.settings.shadow else self.controller.discipline

    def describe(self, action: ControlAction) -> str:
        """``action`` in one line, with the discipline in force (:func:`describe_action`)."""
        return describe_action(action, self.bucket_names, self.discipline)

    def fallback_action(self) -> ControlAction:
        """The guard's safe caps; buckets routed to a pool with no reachable upstream go to
        one that has one. Admission's discipline (order, KV budget) stays the controller's."""
        safe = self._fallback.fallback_action()
        pool_available = self.source.dispatch.pool_available
        usable = [p for p in self.source.dispatch.pools if pool_available(p)]
        pools = tuple(p if p in usable or not usable else
                      (cur if cur in usable else usable[0])
                      for p, cur in zip(safe.pools, self.in_force.pools, strict=True))
        return replace(safe, pools=pools)

    def tick(self, now_s: float, failures: list[str]) -> DeploymentStats:
        """One control tick after the scrapes: snapshot, decide, apply, export. Never raises
        on a failing policy (the guard's safe caps apply, logged).

        :param now_s: the sidecar clock.
        :param failures: why scrapes failed this tick (empty: all succeeded).
        """
        assert self.loop is not None, "tick() before start()"
        self.metrics.control_ticks.inc()
        stats = self.loop.tick(now_s)
        if not stats.deadlines_tracked:
            # The loop sees no first tokens here (a non-streamed answer shows none), so it
            # tracks no deadlines; what a hold release must see is what waits unforwarded:
            # the admission queues and what the engine-wide cap holds at each upstream.
            held = max((u.oldest_waiting_s(now_s) for u in self.source.upstreams),
                       default=0.0)
            stats = replace(stats, oldest_unserved_s=max(held, *stats.oldest_wait_s, 0.0))
        decision_s = math.nan
        overrides: dict[str, int] = {}
        if failures:
            action = self.fallback_action()
            if not self.fallback_active:
                _LOG.warning("metrics scrape failed (%s): applying the guard's fallback caps "
                             "%s", "; ".join(failures),
                             self.describe(action))
            self.fallback_active = True
            self.metrics.fallback_ticks.inc()
        else:
            if self.fallback_active:
                _LOG.info("metrics scrapes succeed again: the controller is back in charge")
            self.fallback_active = False
            t0 = time.perf_counter()
            try:
                action = self.controller.decide(stats)
            except Exception:
                _LOG.exception("controller %s failed to decide; applying the guard's fallback "
                               "caps", self.controller.name)
                action = self.fallback_action()
                self.metrics.fallback_ticks.inc()
            decision_s = time.perf_counter() - t0
            self.metrics.decision_seconds.observe(decision_s)
            self.last_decision_s = decision_s
            overrides = self._new_overrides()
        changed = action != self.decided
        self.decided = action
        if self.settings.shadow:
            if changed:
                _LOG.info("shadow decision (not applied) at tick %d: %s", self.ticks,
                          describe_action(action, self.bucket_names,
                                          self.controller.discipline))
        elif action != self.in_force:
            _LOG.info("tick %d: %s", self.ticks, self.describe(action))
        self.loop.apply(action, enforce=not self.settings.shadow)
        pipeline = self.controller.pipeline
        ctx = MetricContext(self.bucket_names, self.source.info.pool_names, overrides,
                            **guard_readings(None if pipeline is None else pipeline.guard))
        self.metrics.snapshot.record(stats, ctx)
        if self.writer is not None:
            self.writer.write(self.ticks, tick_scalars(
                stats, ctx, fallback=self.fallback_active, decision_s=decision_s))
        return stats

    def _new_overrides(self) -> dict[str, int]:
        """The guard's overrides since the previous call, by rule."""
        pipeline = self.controller.pipeline
        if pipeline is None:
            return {}
        new: dict[str, int] = {}
        for rule, count in pipeline.guard.state.counts.items():
            seen = self._guard_seen.get(rule, 0)
            if count > seen:
                new[rule] = count - seen
            self._guard_seen[rule] = count
        return new

    async def switch_controller(self, spec: str) -> Controller:
        """Replace the controller by name (``static:8``, ``playbook``, ``ppo:PATH``); the
        new one is reset with the deployment and in force from now on.

        :param spec: controller name.
        :raises ValueError: no factory, unknown name, or a policy that does not fit.
        """
        if self._factory is None:
            raise ValueError("this sidecar was started without a controller factory")
        controller = await asyncio.to_thread(self._factory, spec)
        self.use_controller(controller)
        return controller

    def use_controller(self, controller: Controller) -> None:
        """Put ``controller`` in charge (reset with the deployment first).

        :param controller: the new controller.
        :raises ValueError: it does not fit the deployment (e.g. ``ArtifactError``).
        """
        info = self._describe()
        action = controller.reset(info)
        self.source.info = info
        old = self.controller.name
        self.controller = controller
        self._guard_seen = {}
        if controller.pipeline is not None:
            self._fallback = controller.pipeline
        self.decided = action
        if self.loop is not None:
            if not self.settings.shadow:
                self.source.admission.configure(self.discipline, info.sla.ttft_s,
                                                  info.capacity_rps)
            self.loop.apply(action, enforce=not self.settings.shadow)
        _LOG.info("controller switched: %s -> %s; in force: %s", old, controller.name,
                  self.describe(self.in_force))
