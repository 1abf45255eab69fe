"""The sidecar's state and control loop: admission over HTTP upstreams, one tick per interval.

Request path (lean; no observation is built per request): a handler counts the prompt's
tokens, turns the request into a :class:`~rlbatch.request.Request` and submits it to
:class:`~rlbatch.serving.admission.Admission` (the simulator's per-bucket queues, caps, pool
routing, over-length policy and KV budget). Admission hands it to an :class:`HttpUpstream` when its
bucket is under the cap there; the handler, awaiting its :class:`Ticket`, then forwards it.
A request leaving an upstream frees its slot at once and the next queued one is admitted.

Control path, every ``tick_s``: scrape every upstream's ``/metrics``, build one
:class:`~rlbatch.engine.stats.EngineStats` per upstream and the tick's
:class:`~rlbatch.control.types.DeploymentStats` (queues, arrivals, rejections, sliding-window
latencies), ask the controller (policy + guard, exactly as in the simulator) and apply the
action. A failed scrape applies the guard's :meth:`~rlbatch.control.guard.Guard.fallback_action`
caps instead (logged). In shadow mode the controller decides and everything is logged, but
no cap is applied and every request goes to one pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.core import GaugeMetricFamily, Metric

from rlbatch.control.controllers import Controller
from rlbatch.control.guard import Guard, GuardConfig
from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats
from rlbatch.engine.base import Engine
from rlbatch.engine.stats import FinishedRequest
from rlbatch.engine.telemetry import MemoryTelemetry
from rlbatch.serving.admission import Admission, AdmissionConfig
from rlbatch.serving.metrics import SlidingWindow
from rlbatch.sidecar.prom import SidecarMetrics
from rlbatch.sidecar.settings import SidecarSettings
from rlbatch.sidecar.tensorboard import DecisionWriter
from rlbatch.sidecar.tokens import (
    ApproxCounter,
    LocalCounter,
    PromptCounter,
    UpstreamCounter,
)
from rlbatch.sidecar.upstream import DONE, QUEUED, HttpUpstream, Ticket
from rlbatch.sidecar.vllm_metrics import MetricsParseError, parse_vllm_metrics

_LOG = logging.getLogger("rlbatch.sidecar")

ControllerFactory = Callable[[str], Controller]

NO_LIMIT = 1 << 30
"""``max_model_len`` before the upstreams told theirs."""

DOWN_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
    aiohttp.ConnectionTimeoutError, ConnectionRefusedError, ConnectionResetError)
"""Errors that mean the upstream is not there (as opposed to slow or answering badly)."""


def controller_guard(controller: Controller) -> Guard | None:
    """The guard a controller carries (rule controllers and PPO do), if any.

    :param controller: any controller.
    """
    guard = getattr(controller, "guard", None)
    return guard if isinstance(guard, Guard) else None


def describe_action(action: ControlAction, bucket_names: tuple[str, ...]) -> str:
    """One line: ``0-1k=32@fp16 1k-2k=8@fp8 ...``.

    :param action: the action.
    :param bucket_names: bucket labels.
    """
    parts = [f"{name}={'-' if cap is None else cap}@{pool}"
             for name, cap, pool in zip(bucket_names, action.caps, action.pools, strict=True)]
    if action.max_num_seqs is not None:
        parts.append(f"max_num_seqs={action.max_num_seqs}")
    return " ".join(parts)


class Sidecar:
    """State of one sidecar: upstreams, admission, controller, metrics. No I/O here: the
    HTTP session, the tokenizer, TensorBoard and the control task start in :meth:`lifespan`.

    :param settings: validated settings.
    :param controller: the controller (policy + guard); ``reset`` is called here once with
        what the settings tell of the deployment, so a policy that does not fit (buckets,
        pools, observation size) fails before anything starts.
    :param controller_factory: builds a controller from its name for ``/admin/controller``
        (``None``: switching by name is disabled).
    """

    def __init__(self, settings: SidecarSettings, controller: Controller,
                 controller_factory: ControllerFactory | None = None) -> None:
        self.settings = settings
        self.buckets = settings.buckets
        self.bucket_names = settings.buckets.names
        self.pools = settings.pools
        self._factory = controller_factory
        self._origin = time.monotonic()
        self.tickets: dict[int, Ticket] = {}
        self._next_id = 0
        n = len(self.buckets)
        self._arrived = [0] * n  # refusals before admission saw the request, this tick
        self._rejected = [0] * n
        self.upstreams = [HttpUpstream(i, spec, n, self.tickets, self.now,
                                       settings.max_num_seqs)
                          for i, spec in enumerate(settings.upstreams)]
        self.by_pool = {p: [u for u in self.upstreams if u.pool == p] for p in self.pools}
        guard_config = self._guard_config(controller)
        self.over_length = settings.over_length or guard_config.over_length
        self._seq_len_limit = settings.max_seq_len or guard_config.max_seq_len
        engines: list[Engine] = [*self.upstreams]
        self.admission = Admission(engines, self.buckets, self._seq_len_limit or NO_LIMIT,
                                   AdmissionConfig(self.over_length, settings.max_queue_len))
        self.window = SlidingWindow(self.buckets, settings.sla, settings.window_s)
        self.metrics = SidecarMetrics(self.bucket_names, self.pools,
                                      tuple(u.name for u in self.upstreams), self._live_metrics)
        self.controller = controller
        self.info = self._deployment_info()
        self.decided = controller.reset(self.info)
        self.in_force = self._shadow_action() if settings.shadow else self.decided
        self._guard_seen: dict[str, int] = {}
        self._fallback_guard = controller_guard(controller) or Guard(guard_config)
        if controller_guard(controller) is None:
            self._fallback_guard.reset(self.info)
        self.ready = False
        self.not_ready_reason = "waiting for the upstreams"
        self.fallback_active = False
        self.ticks = 0
        self.last_tick_s = 0.0
        self.last_decision_s = math.nan
        self.counter: PromptCounter = ApproxCounter(settings.approx_bytes_per_token)
        self.session: aiohttp.ClientSession | None = None
        self.writer = DecisionWriter(settings.logdir) if settings.logdir else None
        self._telemetry: MemoryTelemetry | None = None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ basics
    def now(self) -> float:
        """Sidecar clock: seconds since the upstreams first answered (since it was built,
        before that)."""
        return time.monotonic() - self._origin

    def new_request_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    @property
    def max_model_len(self) -> int:
        return self.admission.max_model_len

    def _guard_config(self, controller: Controller) -> GuardConfig:
        guard = controller_guard(controller)
        return guard.config if guard is not None else GuardConfig()

    def _shadow_action(self) -> ControlAction:
        n = len(self.buckets)
        return ControlAction((None,) * n, (self.settings.effective_shadow_pool,) * n)

    def _deployment_info(self) -> DeploymentInfo:
        s = self.settings
        blocks: dict[str, int] = {}
        block_size = 16
        for pool, ups in self.by_pool.items():
            known = [u.metrics for u in ups if u.metrics is not None]
            blocks[pool] = next((m.num_gpu_blocks for m in known if m.num_gpu_blocks), 0)
            block_size = next((m.block_size for m in known if m.block_size), block_size)
        return DeploymentInfo(
            buckets=self.buckets, pools=s.pool_sizes, gpu=s.gpu, model=s.model,
            default_max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            num_kv_blocks=blocks, block_size=block_size, max_model_len=self.max_model_len,
            tick_s=s.tick_s, sla=s.sla, cold_start=s.cold_start)

    def pool_available(self, pool: str) -> bool:
        return any(u.healthy for u in self.by_pool[pool])

    # ------------------------------------------------------------------ admission
    def submit(self, ticket: Ticket) -> str | None:
        """Hand a new request to admission.

        :param ticket: the request (state ``QUEUED``).
        :returns: ``None`` when queued or admitted, else the outcome that refused it
            (``unavailable``, ``rejected_queue_full``, ``rejected_too_long``).
        """
        req = ticket.request
        b = ticket.bucket
        pool = self.admission.routes[b]
        if not self.pool_available(pool):
            self._arrived[b] += 1
            self._rejected[b] += 1
            return "unavailable"
        if self.admission.caps[b] is None and self.waiting_in_pool(b, pool) >= (
                self.settings.max_queue_len):
            # No cap: the request would wait in its upstream's engine-wide FIFO, which the
            # queue bound covers too (vLLM's own queue is unbounded; this one is not).
            self._arrived[b] += 1
            self._rejected[b] += 1
            return "rejected_queue_full"
        rejected_before = len(self.admission.rejected)
        self.tickets[req.request_id] = ticket
        self.admission.submit(req)
        if len(self.admission.rejected) > rejected_before:
            del self.tickets[req.request_id]
            ticket.state = DONE
            if req.prompt_tokens + req.max_output_tokens > self.admission.max_model_len:
                return "rejected_too_long"
            return "rejected_queue_full"
        if ticket.state == QUEUED:
            self.admit_pool(pool)
        return None

    def waiting_in_pool(self, bucket: int, pool: str) -> int:
        """Requests of ``bucket`` admitted to ``pool``'s upstreams but waiting for their
        engine-wide cap.

        :param bucket: bucket index.
        :param pool: pool name.
        """
        return sum(u.unfinished[bucket] - u.running[bucket] for u in self.by_pool[pool])

    def admit_pool(self, pool: str) -> None:
        """Let queued requests routed to ``pool`` into its reachable upstreams, least loaded
        first.

        :param pool: the pool.
        """
        ups = [u for u in self.by_pool[pool] if u.healthy]
        if len(ups) > 1:
            ups.sort(key=lambda u: u.num_unfinished_total())
        for u in ups:
            self.admission.admit(u)

    def admit_all(self) -> None:
        for pool in self.pools:
            self.admit_pool(pool)

    def finish(self, ticket: Ticket, record: FinishedRequest | None) -> None:
        """A forwarded request is done (``record`` when it completed); its slot goes to the
        next queued request.

        :param ticket: the request.
        :param record: its timings, or ``None`` when it failed.
        """
        upstream = ticket.upstream
        self.tickets.pop(ticket.request.request_id, None)
        if upstream is None:
            ticket.state = DONE
            return
        upstream.release(ticket, record)
        if upstream.healthy:
            self.admission.admit(upstream)

    def abandon(self, ticket: Ticket) -> None:
        """The request leaves wherever it is (client gone, queue timeout, failure).

        :param ticket: the request.
        """
        if ticket.state == DONE:
            return
        if ticket.state == QUEUED:
            queue = self.admission.queues[ticket.bucket]
            for item in queue:
                if item[0] is ticket.request:
                    queue.remove(item)
                    break
            self.tickets.pop(ticket.request.request_id, None)
            ticket.state = DONE
            return
        self.finish(ticket, None)

    def retry_target(self, ticket: Ticket) -> HttpUpstream | None:
        """Move a request that failed on its upstream (nothing sent to the client yet) to
        another reachable replica of the same pool that has room for its bucket under the
        cap in force; ``None`` when there is none (the caller answers 503).

        :param ticket: the failed request (still held by its upstream).
        """
        failed = ticket.upstream
        if failed is None:
            return None
        ticket.tried.add(failed.engine_id)
        cap = self.admission.caps[ticket.bucket]
        candidates = [u for u in self.by_pool[failed.pool]
                      if u.healthy and u.engine_id not in ticket.tried
                      and (cap is None or u.num_unfinished(ticket.bucket) < cap)]
        if not candidates:
            return None
        target = min(candidates, key=lambda u: u.num_unfinished_total())
        prompt, truncated = ticket.prompt_tokens, ticket.truncated
        self.finish(ticket, None)
        self.tickets[ticket.request.request_id] = ticket
        ticket.future = asyncio.get_running_loop().create_future()
        target.add_request(ticket.request, ticket.bucket, prompt, truncated)
        self.metrics.retries[failed.pool].inc()
        return target

    # ------------------------------------------------------------------ control
    def apply(self, action: ControlAction) -> None:
        """Put an action in force (caps, routes, KV budget, engine-wide cap).

        :param action: a guarded action.
        """
        if action.max_num_seqs is None:
            for u in self.upstreams:
                u.clear_max_num_seqs()
        self.admission.apply(action)
        self.in_force = action
        self.admit_all()

    def fallback_action(self) -> ControlAction:
        """The guard's safe caps; buckets routed to a pool with no reachable upstream go to
        one that has one."""
        safe = self._fallback_guard.fallback_action()
        usable = [p for p in self.pools if self.pool_available(p)]
        pools = tuple(p if p in usable or not usable else
                      (cur if cur in usable else usable[0])
                      for p, cur in zip(safe.pools, self.in_force.pools, strict=True))
        return replace(safe, pools=pools)

    async def tick(self) -> DeploymentStats:
        """One control tick: scrape, snapshot, decide, apply. Never raises on a bad upstream
        or a failing policy (both fall back to the guard's safe caps, logged)."""
        started = time.perf_counter()
        failures = await asyncio.gather(*(self.scrape(u) for u in self.upstreams))
        now = self.now()
        interval = now - self.last_tick_s if self.ticks else self.settings.tick_s
        self.last_tick_s = now
        self.ticks += 1
        self.metrics.control_ticks.inc()
        if any(u.healthy for u in self.upstreams):
            self.admit_all()  # an upstream may be back
        stats = self._stats(now, max(interval, 1e-6))
        failed = [f for f in failures if f]
        decision_s = math.nan
        if failed:
            action = self.fallback_action()
            if not self.fallback_active:
                _LOG.warning("metrics scrape failed (%s): applying the guard's fallback caps "
                             "%s", "; ".join(failed),
                             describe_action(action, self.bucket_names))
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
            self._count_overrides()
        changed = action != self.decided
        self.decided = action
        if self.settings.shadow:
            if changed:
                _LOG.info("shadow decision (not applied) at tick %d: %s", self.ticks,
                          describe_action(action, self.bucket_names))
        else:
            if action != self.in_force:
                _LOG.info("tick %d: %s", self.ticks, describe_action(action, self.bucket_names))
            self.apply(action)
        self._log_tensorboard(stats, decision_s)
        self.metrics.tick_seconds.observe(time.perf_counter() - started)
        return stats

    def _stats(self, now: float, interval: float) -> DeploymentStats:
        used = total = 0
        if self._telemetry is not None:
            reading = self._telemetry.read()
            if reading.source == "nvml":
                used, total = reading.used_bytes, reading.total_bytes
        engines = tuple(u.snapshot_with_memory(used, total) for u in self.upstreams)
        for es in engines:
            if es.finished:
                self.window.add(es.finished)
        self.admission.rejected.clear()
        arrived, rejected, blocked = self.admission.take_tick_counters()
        arrived = tuple(a + x for a, x in zip(arrived, self._arrived, strict=True))
        rejected = tuple(r + x for r, x in zip(rejected, self._rejected, strict=True))
        self._arrived = [0] * len(self.buckets)
        self._rejected = [0] * len(self.buckets)
        return DeploymentStats(
            time_s=now, tick_s=interval, engines=engines, queued=self.admission.queued(),
            arrived=arrived, rejected=rejected, window=self.window.stats(now),
            action=self.decided if self.settings.shadow else self.in_force,
            kv_budget_blocked=blocked, oldest_wait_s=self.admission.oldest_wait_s(now))

    def _count_overrides(self) -> None:
        guard = controller_guard(self.controller)
        if guard is None:
            return
        for rule, count in guard.state.counts.items():
            seen = self._guard_seen.get(rule, 0)
            if count > seen:
                self.metrics.guard_overrides.labels(rule).inc(count - seen)
            self._guard_seen[rule] = count

    async def scrape(self, upstream: HttpUpstream) -> str:
        """Read one upstream's ``/metrics``; returns ``""`` or why it failed.

        :param upstream: the upstream.
        """
        assert self.session is not None, "scrape() before the sidecar started"
        timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
        try:
            async with self.session.get(upstream.url + "/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    raise MetricsParseError(f"/metrics answered {resp.status}")
                text = await resp.text()
            metrics = parse_vllm_metrics(text)
            if upstream.max_model_len is None:
                await self._discover(upstream)
        except DOWN_ERRORS as exc:
            reason = f"{upstream.name} ({upstream.url}) unreachable: {exc or type(exc).__name__}"
            upstream.mark_down(reason)
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError,
                TypeError) as exc:
            reason = (f"{upstream.name} ({upstream.url}) scrape failed: "
                      f"{exc or type(exc).__name__}")
        else:
            upstream.observe(metrics)
            return ""
        self.metrics.scrape_failures[upstream.name].inc()
        return reason

    async def _discover(self, upstream: HttpUpstream) -> None:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
        async with self.session.get(upstream.url + "/v1/models", timeout=timeout) as resp:
            if resp.status != 200:
                raise MetricsParseError(f"/v1/models answered {resp.status}")
            data = await resp.json()
        model = data["data"][0]
        upstream.max_model_len = int(model.get("max_model_len") or NO_LIMIT)
        upstream.served_model = str(model.get("id"))
        upstream.model_root = model.get("root")

    # ------------------------------------------------------------------ lifecycle
    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Start the HTTP client, TensorBoard and the control task; stop them on exit."""
        s = self.settings
        # Idle connections are dropped before uvicorn's (vLLM's) 5 s keep-alive ends them.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4.0)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=s.request_timeout_s,
                                          sock_connect=s.connect_timeout_s))
        if self.writer is not None:
            await asyncio.to_thread(self.writer.open, self._settings_text())
        if s.gpu_telemetry:
            self._telemetry = await asyncio.to_thread(self._start_telemetry)
        self._task = asyncio.create_task(self._run(), name="rlbatch-sidecar-control")
        try:
            yield
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            await self.session.close()
            if self.writer is not None:
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
        fields["controller"] = self.controller.name
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
                    _LOG.exception("control tick %d failed", self.ticks)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.ready = False
            self.not_ready_reason = f"sidecar failed to start: {exc}"
            _LOG.exception("sidecar failed to start")

    async def _wait_for_upstreams(self) -> None:
        last_log = -math.inf
        while True:
            await asyncio.gather(*(self.scrape(u) for u in self.upstreams))
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
        if self._seq_len_limit is not None:
            limit = min(limit, self._seq_len_limit)
        self.admission.max_model_len = limit
        self.counter = await self._make_counter()
        self.info = self._deployment_info()
        self.decided = self.controller.reset(self.info)
        if controller_guard(self.controller) is None:
            self._fallback_guard.reset(self.info)
        self._guard_seen = {}
        self.apply(self._shadow_action() if self.settings.shadow else self.decided)
        self.ready = True
        self.not_ready_reason = ""
        _LOG.info("sidecar ready: controller %s%s, upstreams %s, max_model_len %d, prompt "
                  "tokens counted by %s; in force: %s", self.controller.name,
                  " (shadow)" if self.settings.shadow else "",
                  ", ".join(f"{u.name}={u.url}" for u in self.upstreams), limit,
                  self.counter.name, describe_action(self.in_force, self.bucket_names))

    async def _make_counter(self) -> PromptCounter:
        s = self.settings
        approx = ApproxCounter(s.approx_bytes_per_token)
        mode = s.tokenizer
        if mode == "approx":
            return approx
        if mode == "upstream":
            return UpstreamCounter(self.post_any, approx)
        if mode == "auto":
            roots = [u.model_root for u in self.upstreams if u.model_root]
            local = next((Path(r) for r in roots if (Path(r) / "tokenizer.json").is_file()),
                         None)
            if local is None:
                return UpstreamCounter(self.post_any, approx)
            return await asyncio.to_thread(LocalCounter.load, local, s.tokenizer_thread_chars)
        return await asyncio.to_thread(LocalCounter.load, Path(mode), s.tokenizer_thread_chars)

    async def post_any(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST to a reachable upstream (any pool: they serve the same model).

        :param path: URL path.
        :param body: JSON bytes.
        """
        assert self.session is not None
        target = next((u for u in self.upstreams if u.healthy), self.upstreams[0])
        async with self.session.post(target.url + path, data=body,
                                     headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.read()

    # ------------------------------------------------------------------ controller switch
    async def switch_controller(self, spec: str) -> Controller:
        """Replace the controller by name (``static:8``, ``playbook``, ``ppo:PATH``); the
        new one is reset with the deployment and in force from now on.

        :param spec: controller name.
        :raises ValueError: no factory, unknown name, or a policy that does not fit.
        """
        if self._factory is None:
            raise ValueError("this sidecar was started without a controller factory")
        factory = self._factory
        controller = await asyncio.to_thread(factory, spec)
        self.use_controller(controller)
        return controller

    def use_controller(self, controller: Controller) -> None:
        """Put ``controller`` in charge (reset with the deployment first).

        :param controller: the new controller.
        :raises ValueError: it does not fit the deployment (e.g. ``ArtifactError``).
        """
        self.info = self._deployment_info()
        action = controller.reset(self.info)
        old = self.controller.name
        self.controller = controller
        self._guard_seen = {}
        guard = controller_guard(controller)
        if guard is not None:
            self._fallback_guard = guard
        self.decided = action
        if not self.settings.shadow and self.ready:
            self.apply(action)
        _LOG.info("controller switched: %s -> %s; in force: %s", old, controller.name,
                  describe_action(self.in_force, self.bucket_names))

    # ------------------------------------------------------------------ observability
    def _log_tensorboard(self, stats: DeploymentStats, decision_s: float) -> None:
        if self.writer is None:
            return
        scalars: dict[str, float] = {
            "decision/fallback": float(self.fallback_active),
            "rollout/ttft_p99_s": stats.window.ttft_p99_all_s,
            "rollout/tpot_p99_s": stats.window.tpot_p99_all_s,
        }
        if math.isfinite(decision_s):
            scalars["decision/seconds"] = decision_s
        for b, name in enumerate(self.bucket_names):
            cap = self.decided.caps[b]
            scalars[f"decision/cap/{name}"] = -1.0 if cap is None else float(cap)
            scalars[f"decision/pool/{name}"] = float(self.pools.index(self.decided.pools[b]))
            scalars[f"rollout/queue/{name}"] = float(stats.queued[b])
            scalars[f"rollout/arrived/{name}"] = float(stats.arrived[b])
        guard = controller_guard(self.controller)
        if guard is not None:
            for rule, count in guard.state.counts.items():
                scalars[f"guard/overrides/{rule}"] = float(count)
        for es, u in zip(stats.engines, self.upstreams, strict=True):
            scalars[f"engine/kv_cache_usage/{u.name}"] = es.kv_cache_usage
            scalars[f"engine/running/{u.name}"] = float(sum(es.running))
        self.writer.write(self.ticks, {k: v for k, v in scalars.items() if math.isfinite(v)})

    def _live_metrics(self) -> Iterator[Metric]:
        names = self.bucket_names
        for metric_name, action, doc in (
                ("rlbatch:batch_cap", self.in_force, "Batch cap in force per bucket and pool "
                 "(0: bucket not routed to the pool; +Inf: no cap)"),
                ("rlbatch:decided_batch_cap", self.decided, "The controller's last decision "
                 "per bucket and pool (0: not routed there; +Inf: no cap)")):
            fam = GaugeMetricFamily(metric_name, doc, labels=["bucket", "pool"])
            for b, name in enumerate(names):
                for pool in self.pools:
                    cap = action.caps[b]
                    value = 0.0 if action.pools[b] != pool else (
                        math.inf if cap is None else float(cap))
                    fam.add_metric([name, pool], value)
            yield fam
        queue = GaugeMetricFamily("rlbatch:queue_length", "Requests in the admission queue",
                                  labels=["bucket"])
        for b, length in enumerate(self.admission.queued()):
            queue.add_metric([names[b]], float(length))
        yield queue
        running = GaugeMetricFamily("rlbatch:requests_running", "Requests forwarded and not "
                                    "finished", labels=["bucket", "pool"])
        waiting = GaugeMetricFamily("rlbatch:requests_waiting", "Requests admitted to an "
                                    "upstream, waiting for its engine-wide cap",
                                    labels=["bucket", "pool"])
        for pool, ups in self.by_pool.items():
            for b, name in enumerate(names):
                r = sum(u.running[b] for u in ups)
                running.add_metric([name, pool], float(r))
                waiting.add_metric([name, pool], float(sum(u.unfinished[b] for u in ups) - r))
        yield running
        yield waiting
        up = GaugeMetricFamily("rlbatch:upstream_up", "Upstream reachable (1) or not (0)",
                               labels=["upstream", "pool"])
        kv = GaugeMetricFamily("rlbatch:upstream_kv_cache_usage", "Upstream KV cache usage "
                               "(fraction) at the last scrape", labels=["upstream"])
        seqs = GaugeMetricFamily("rlbatch:max_num_seqs", "Engine-wide cap applied by the "
                                 "sidecar", labels=["upstream"])
        for u in self.upstreams:
            up.add_metric([u.name, u.pool], float(u.healthy))
            if u.metrics is not None:
                kv.add_metric([u.name], u.metrics.kv_cache_usage)
            seqs.add_metric([u.name], float(u.max_num_seqs))
        yield up
        yield kv
        yield seqs
        yield GaugeMetricFamily("rlbatch:shadow_mode", "1 in shadow mode (decide, never act)",
                                value=float(self.settings.shadow))
        ctl = GaugeMetricFamily("rlbatch:controller_info", "The controller in charge",
                                labels=["controller"])
        ctl.add_metric([self.controller.name], 1.0)
        yield ctl

    def state(self) -> dict[str, Any]:
        """What ``/admin/state`` shows."""
        def action_dict(action: ControlAction) -> dict[str, Any]:
            return {"caps": dict(zip(self.bucket_names, action.caps, strict=True)),
                    "pools": dict(zip(self.bucket_names, action.pools, strict=True)),
                    "max_num_seqs": action.max_num_seqs,
                    "kv_budget_fraction": action.kv_budget_fraction}

        return {
            "ready": self.ready, "not_ready_reason": self.not_ready_reason,
            "controller": self.controller.name, "shadow": self.settings.shadow,
            "ticks": self.ticks, "fallback_active": self.fallback_active,
            "last_decision_s": None if math.isnan(self.last_decision_s)
            else self.last_decision_s,
            "tokenizer": self.counter.name, "max_model_len": self.max_model_len,
            "over_length": self.over_length,
            "in_force": action_dict(self.in_force), "decided": action_dict(self.decided),
            "queued": dict(zip(self.bucket_names, self.admission.queued(), strict=True)),
            "upstreams": [{"name": u.name, "pool": u.pool, "url": u.url, "healthy": u.healthy,
                           "down_reason": u.down_reason, "running": u.running_total,
                           "waiting": u.waiting_total, "max_num_seqs": u.max_num_seqs,
                           "kv_cache_usage": None if u.metrics is None
                           else u.metrics.kv_cache_usage}
                          for u in self.upstreams],
        }
