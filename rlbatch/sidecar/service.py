"""One sidecar: builds its parts from the settings and runs their lifecycle.

The parts: the upstreams (:mod:`~rlbatch.sidecar.upstream`), the request path through
admission (:mod:`~rlbatch.sidecar.dispatch`), the control tick (:mod:`~rlbatch.sidecar.
control_tick`) over the upstreams as a control-loop source (:mod:`~rlbatch.sidecar.source`),
the metrics (:mod:`~rlbatch.sidecar.prom`). Nothing does I/O when built: the HTTP client, the
prompt counter, TensorBoard, GPU telemetry and the control task start in :meth:`Sidecar.running`,
and the controller takes charge once every pool has an upstream that answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from rlbatch.control.controllers import Controller
from rlbatch.control.discipline import AdmissionDiscipline
from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats
from rlbatch.engine.base import Engine
from rlbatch.engine.telemetry import MemoryTelemetry
from rlbatch.serving.admission import Admission
from rlbatch.sidecar.control_tick import (
    ControllerBuilder,
    SidecarControl,
    fallback_guard_config,
)
from rlbatch.sidecar.dispatch import Dispatcher
from rlbatch.sidecar.prom import ControlState, SidecarMetrics
from rlbatch.sidecar.relay import read_head
from rlbatch.sidecar.scrape import NO_LIMIT, check_health, scrape
from rlbatch.sidecar.settings import SidecarSettings
from rlbatch.sidecar.source import UpstreamSource, describe_upstreams
from rlbatch.sidecar.tensorboard import DecisionWriter
from rlbatch.sidecar.tokens import (
    ANSWER_HEAD_BYTES,
    ApproxCounter,
    LocalCounter,
    PromptCounter,
    UpstreamCounter,
)
from rlbatch.sidecar.upstream import HttpUpstream, Ticket

_LOG = logging.getLogger("rlbatch.sidecar")

DEFAULT_MAX_CHARS_PER_TOKEN = 64
"""Characters one token may span when no local tokenizer tells (``max_chars_per_token``)."""


class Sidecar:
    """State of one sidecar: upstreams, admission, controller, metrics.

    :param settings: validated settings.
    :param controller: the controller (policy + guard); ``reset`` is called here once with
        what the settings tell of the deployment, so a policy that does not fit (buckets,
        pools, observation size) fails before anything starts.
    :param controller_factory: builds a controller from its name for ``/admin/controller``
        (``None``: switching by name is disabled).
    """

    def __init__(self, settings: SidecarSettings, controller: Controller,
                 controller_factory: ControllerBuilder | None = None) -> None:
        self.settings = settings
        self.buckets = settings.buckets
        self.bucket_names = settings.buckets.names
        self.pools = settings.pools
        self._origin = time.monotonic()
        self.tickets: dict[int, Ticket] = {}
        self._next_id = 0
        self.upstreams = [HttpUpstream(i, spec, len(self.buckets), self.tickets, self.now,
                                       settings.max_num_seqs, kv_reserve=settings.kv_reserve,
                                       kv_reserve_quantile=settings.kv_reserve_quantile)
                          for i, spec in enumerate(settings.upstreams)]
        guard = fallback_guard_config(controller)
        # vLLM's own rule unless the operator chose the sidecar's: the default must not change
        # what the model sees where vLLM would not.
        self.over_length: str = settings.over_length or "vllm"
        self._max_model_len = settings.max_model_len or guard.max_seq_len
        engines: list[Engine] = [*self.upstreams]
        # the overload rules are admission's, as in the simulator: the sidecar's queue
        # timeout is the queue TTL
        admission = Admission(engines, self.buckets, self._max_model_len or NO_LIMIT,
                              settings.admission_config())
        self.metrics = SidecarMetrics(self.bucket_names, self.pools,
                                      tuple(u.name for u in self.upstreams), self.control_state,
                                      settings.sla)
        self.dispatch = Dispatcher(self.upstreams, self.pools, admission, self.tickets,
                                   eject_after_failures=settings.eject_after_failures,
                                   eject_s=settings.eject_s,
                                   on_eject=lambda u: self.metrics.ejections[u.name].inc(),
                                   clock=self.now)
        self.admission = admission
        n = len(self.buckets)
        self.source = UpstreamSource(self.dispatch, self.describe(),
                                     ControlAction((None,) * n, (self.pools[0],) * n))
        self.control = SidecarControl(settings, controller, controller_factory, self.source,
                                      self.metrics, self.describe)
        self.ready = False
        self.not_ready_reason = "waiting for the upstreams"
        self.counter: PromptCounter = ApproxCounter(settings.approx_bytes_per_token)
        self.max_chars_per_token = settings.max_chars_per_token or DEFAULT_MAX_CHARS_PER_TOKEN
        self.session: aiohttp.ClientSession | None = None
        self.writer = DecisionWriter(settings.logdir) if settings.logdir else None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ basics
    def now(self) -> float:
        """Sidecar clock: seconds since the upstreams first answered (since it was built,
        before that)."""
        return time.monotonic() - self._origin

    def new_request_id(self) -> int:
        """A fresh request id."""
        rid = self._next_id
        self._next_id += 1
        return rid

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output admitted."""
        return self.admission.max_model_len

    @property
    def by_pool(self) -> dict[str, list[HttpUpstream]]:
        """The upstreams of each pool."""
        return self.dispatch.by_pool

    def describe(self) -> DeploymentInfo:
        """The deployment as the upstreams describe it now."""
        return describe_upstreams(self.settings, self.by_pool, self.max_model_len)

    async def tick(self) -> DeploymentStats:
        """One control tick: scrape every upstream, then snapshot, decide, apply."""
        started = time.perf_counter()
        self.dispatch.expire_due()  # the timer does it on time; this is a safety net
        failures = [f for f in await self._scrape_all() if f]
        stats = self.control.tick(self.now(), failures)
        self.metrics.tick_seconds.observe(time.perf_counter() - started)
        return stats

    async def _scrape_all(self) -> list[str]:
        """Scrape every upstream's ``/metrics`` and check its ``/health``; the scrape
        failures."""
        assert self.session is not None, "scrape before the sidecar started"
        session = self.session
        timeout_s = self.settings.scrape_timeout_s
        scrapes = asyncio.gather(*(scrape(session, u, timeout_s) for u in self.upstreams))
        checks = asyncio.gather(*(check_health(session, u, timeout_s) for u in self.upstreams))
        failures, _ = await asyncio.gather(scrapes, checks)
        for u, failure in zip(self.upstreams, failures, strict=True):
            if failure:
                self.metrics.scrape_failures[u.name].inc()
        return failures

    # ------------------------------------------------------------------ lifecycle
    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Start the HTTP client, TensorBoard and the control task; stop them on exit."""
        s = self.settings
        # Idle connections are dropped before uvicorn's (vLLM's) 5 s keep-alive ends them.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4.0)
        # Connect and total limits here; the first-byte and idle limits are the proxy's
        # watchdogs (a total limit would cut healthy long streams, so it is off by default).
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=s.request_timeout_s,
                                          connect=s.connect_timeout_s,
                                          sock_connect=s.connect_timeout_s))
        if self.writer is not None:
            await asyncio.to_thread(self.writer.open, self._settings_text())
            self.control.writer = self.writer
        if s.gpu_telemetry:
            self.source.telemetry = await asyncio.to_thread(self._start_telemetry)
        self._task = asyncio.create_task(self._run(), name="rlbatch-sidecar-control")
        try:
            yield
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self.dispatch.close()
            await self.session.close()
            if self.writer is not None:
                self.control.writer = None
                await asyncio.to_thread(self.writer.close)

    async def lifespan(self, app: object) -> AsyncIterator[None]:
        """aiohttp ``cleanup_ctx`` hook around :meth:`running`.

        :param app: the application (unused).
        """
        async with self.running():
            yield

    @staticmethod
    def _start_telemetry() -> MemoryTelemetry | None:
        telemetry = MemoryTelemetry(logger=logging.getLogger("rlbatch.sidecar.telemetry"))
        telemetry.read()
        return telemetry if telemetry.source == "nvml" else None

    def _settings_text(self) -> str:
        fields = asdict(self.settings)
        fields["admin_token"] = "***" if self.settings.admin_token else None
        fields["max_chars_per_token"] = self.max_chars_per_token
        fields["controller"] = self.control.controller.name
        return "```\n" + json.dumps(fields, indent=2, default=str) + "\n```"

    async def _run(self) -> None:
        try:
            await self._wait_for_upstreams()
            await self._become_ready()
            next_at = self.now() + self.settings.tick_s
            while True:
                await asyncio.sleep(max(0.0, next_at - self.now()))
                next_at = max(next_at + self.settings.tick_s, self.now())
                try:
                    await self.tick()
                except Exception:  # the loop must survive anything a tick meets
                    _LOG.exception("control tick %d failed", self.control.ticks)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.ready = False
            self.not_ready_reason = f"sidecar failed to start: {exc}"
            _LOG.exception("sidecar failed to start")

    async def _wait_for_upstreams(self) -> None:
        last_log = -math.inf
        while True:
            await self._scrape_all()
            missing = [p for p in self.pools if not any(
                u.healthy and u.max_model_len is not None for u in self.by_pool[p])]
            if not missing:
                return
            self.not_ready_reason = (
                f"waiting for upstreams of pool(s) {', '.join(missing)}: " + "; ".join(
                    u.down_reason for u in self.upstreams if u.pool in missing))
            if self.now() - last_log >= 10.0:
                _LOG.info("%s", self.not_ready_reason)
                last_log = self.now()
            await asyncio.sleep(min(1.0, self.settings.tick_s))

    async def _become_ready(self) -> None:
        # The clock (and with it the guard's warm-up ramp) starts when the upstreams answer,
        # not when the sidecar process started: vLLM may take minutes to load a model.
        self._origin = time.monotonic()
        lens = [u.max_model_len for u in self.upstreams if u.max_model_len is not None]
        limit = min(lens) if lens else NO_LIMIT
        if self._max_model_len is not None:
            limit = min(limit, self._max_model_len)
        self.admission.max_model_len = limit
        self.counter = await self._make_counter()
        self.control.start(self.describe())
        self.ready = True
        self.not_ready_reason = ""
        _LOG.info("sidecar ready: controller %s%s, upstreams %s, max_model_len %d, prompt "
                  "tokens counted by %s; in force: %s", self.control.controller.name,
                  " (shadow)" if self.settings.shadow else "",
                  ", ".join(f"{u.name}={u.url}" for u in self.upstreams), limit,
                  self.counter.name, self.control.describe(self.control.in_force))

    async def _make_counter(self) -> PromptCounter:
        s = self.settings
        approx = ApproxCounter(s.approx_bytes_per_token)
        mode = s.tokenizer
        if mode == "approx":
            return approx
        upstream = UpstreamCounter(self.post_any, approx, s.tokenize_timeout_s,
                                   self.metrics.trip, breaker_failures=s.tokenize_breaker_failures,
                                   breaker_s=s.tokenize_breaker_s)
        if mode == "upstream":
            return upstream
        path = Path(mode)
        if mode == "auto":
            roots = [u.model_root for u in self.upstreams if u.model_root]
            local = next((Path(r) for r in roots if (Path(r) / "tokenizer.json").is_file()),
                         None)
            if local is None:
                return upstream
            path = local
        counter = await asyncio.to_thread(LocalCounter.load, path, s.tokenizer_thread_chars)
        if s.max_chars_per_token is None:
            self.max_chars_per_token = counter.max_chars_per_token
        return counter

    async def post_any(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST to a reachable upstream (any pool: they serve the same model); the status and
        the first :data:`~rlbatch.sidecar.tokens.ANSWER_HEAD_BYTES` of the answer (vLLM's
        ``/tokenize`` puts the count first and then every token id: the rest is not read).

        :param path: URL path.
        :param body: JSON bytes.
        """
        assert self.session is not None
        target = next((u for u in self.upstreams if u.healthy), self.upstreams[0])
        async with self.session.post(target.url + path, data=body,
                                     headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await read_head(resp, ANSWER_HEAD_BYTES)

    # ------------------------------------------------------------------ observability
    def control_state(self) -> ControlState:
        """The control state ``/metrics`` shows besides the last tick's snapshot."""
        c = self.control
        return ControlState(
            in_force=c.in_force, decided=c.decided, bucket_names=self.bucket_names,
            pools=self.pools, upstreams=tuple((u.name, u.pool, u.healthy)
                                              for u in self.upstreams),
            shadow=self.settings.shadow, controller=c.controller.name, sla=self.settings.sla)

    def state(self) -> dict[str, Any]:
        """What ``/admin/state`` shows."""
        def action_dict(action: ControlAction) -> dict[str, Any]:
            return {"caps": dict(zip(self.bucket_names, action.caps, strict=True)),
                    "pools": dict(zip(self.bucket_names, action.pools, strict=True)),
                    "max_num_seqs": action.max_num_seqs,
                    "pool_max_num_seqs": dict(action.pool_max_num_seqs)}

        def discipline_dict(discipline: AdmissionDiscipline) -> dict[str, Any]:
            budget = discipline.kv_budget
            return {"order": discipline.order,
                    "kv_budget_fraction": None if budget is None else budget.fraction,
                    "kv_commit": None if budget is None else budget.commit}

        c = self.control
        return {
            "ready": self.ready, "not_ready_reason": self.not_ready_reason,
            "controller": c.controller.name, "shadow": self.settings.shadow,
            "ticks": c.ticks, "fallback_active": c.fallback_active,
            "last_decision_s": None if math.isnan(c.last_decision_s)
            else c.last_decision_s,
            "tokenizer": self.counter.name, "max_model_len": self.max_model_len,
            "over_length": self.over_length, "max_chars_per_token": self.max_chars_per_token,
            "in_force": action_dict(c.in_force), "decided": action_dict(c.decided),
            "admission": discipline_dict(self.admission.discipline),
            "controller_admission": discipline_dict(c.controller.discipline),
            "queued": dict(zip(self.bucket_names, self.admission.queued(), strict=True)),
            "upstreams": [{"name": u.name, "pool": u.pool, "url": u.url, "healthy": u.healthy,
                           "down_reason": u.down_reason, "running": u.running_total,
                           "waiting": u.waiting_total, "max_num_seqs": u.max_num_seqs,
                           "kv_cache_usage": None if u.metrics is None
                           else u.metrics.kv_cache_usage}
                          for u in self.upstreams],
        }
