"""The sidecar's HTTP application: its routes, the service endpoints, and the server loop.

Routes
======

``POST /v1/completions``, ``POST /v1/chat/completions``
    the OpenAI proxy (:mod:`rlbatch.sidecar.proxy`).
``GET /v1/models``
    the first reachable upstream's answer.
``GET /metrics``
    the sidecar's Prometheus metrics (:mod:`rlbatch.sidecar.prom`).
``GET /health``
    200 while the process serves (liveness); ``GET /ready``: 200 once every pool has a
    reachable upstream and the controller is in charge, else 503 with the reason.
``GET /admin/state``, ``POST /admin/controller`` (``{"controller": "static:8"}``)
    state, and switching the controller at run time; open on a loopback bind, else only
    with ``admin_token``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rlbatch.control.controllers import Controller
from rlbatch.sidecar.control_tick import ControllerFactory
from rlbatch.sidecar.proxy import UPSTREAM_FAILURES, CompletionProxy, json_error
from rlbatch.sidecar.service import Sidecar
from rlbatch.sidecar.settings import SidecarSettings

_LOG = logging.getLogger("rlbatch.sidecar")

SIDECAR = web.AppKey("rlbatch_sidecar", Sidecar)


class ServiceRoutes:
    """The non-proxy routes of one sidecar: models, metrics, health, readiness, admin.

    :param sidecar: the state.
    :param proxy: the completion proxy (for the headers it passes on).
    """

    def __init__(self, sidecar: Sidecar, proxy: CompletionProxy) -> None:
        self.sc = sidecar
        self.proxy = proxy
        self.retry_after = proxy.retry_after

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the first reachable upstream's answer.

        :param request: the request.
        """
        sc = self.sc
        assert sc.session is not None
        target = next((u for u in sc.upstreams if u.healthy), None)
        if target is None:
            return json_error(503, "no reachable upstream", "service_unavailable",
                              headers=self.retry_after)
        try:
            async with sc.session.get(target.url + "/v1/models",
                                      headers=self.proxy.headers(request)) as resp:
                data = await resp.read()
                return web.Response(status=resp.status, body=data,
                                    content_type=resp.content_type or "application/json")
        except UPSTREAM_FAILURES as exc:
            return json_error(503, f"upstream {target.name} failed: {exc}",
                              "service_unavailable", headers=self.retry_after)

    async def metrics(self, request: web.Request) -> web.Response:
        """``GET /metrics``: the sidecar's Prometheus metrics.

        :param request: the request.
        """
        body = generate_latest(self.sc.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``: 200 while the process serves (liveness).

        :param request: the request.
        """
        return web.json_response({"status": "ok", "ready": self.sc.ready})

    async def ready(self, request: web.Request) -> web.Response:
        """``GET /ready``: 200 once every pool is reachable and the controller is in
        charge, else 503 with the reason.

        :param request: the request.
        """
        sc = self.sc
        missing = [p for p in sc.pools if not sc.dispatch.pool_available(p)]
        if sc.ready and not missing:
            return web.json_response({"status": "ready",
                                      "controller": sc.control.controller.name})
        reason = sc.not_ready_reason or f"no reachable upstream in pool(s) {', '.join(missing)}"
        return web.json_response({"status": "not ready", "reason": reason}, status=503)

    def _admin_refusal(self, request: web.Request) -> web.Response | None:
        settings = self.sc.settings
        if settings.admin_token is not None:
            if request.headers.get("Authorization") != f"Bearer {settings.admin_token}":
                return json_error(401, "admin endpoints need 'Authorization: Bearer TOKEN'",
                                  "authentication_error")
            return None
        if not settings.binds_loopback:
            return json_error(403, "admin endpoints are off on a non-loopback bind without "
                              "--admin-token", "permission_error")
        return None

    async def admin_state(self, request: web.Request) -> web.Response:
        """``GET /admin/state``: the sidecar's state.

        :param request: the request.
        """
        refusal = self._admin_refusal(request)
        return refusal or web.json_response(self.sc.state())

    async def admin_controller(self, request: web.Request) -> web.Response:
        """``POST /admin/controller``: switch the controller by name.

        :param request: the request.
        """
        refusal = self._admin_refusal(request)
        if refusal is not None:
            return refusal
        try:
            body: Any = await request.json()
        except ValueError as exc:
            return json_error(400, f"body is not valid JSON: {exc}", "invalid_request_error")
        spec = body.get("controller") if isinstance(body, dict) else None
        if not isinstance(spec, str) or not spec:
            return json_error(400, "field 'controller' (e.g. \"static:8\", \"playbook\", "
                              "\"ppo:PATH\") is required", "invalid_request_error",
                              param="controller")
        try:
            controller = await self.sc.control.switch_controller(spec)
        except (ValueError, OSError) as exc:
            return json_error(400, f"cannot switch to {spec!r}: {exc}", "invalid_request_error",
                              param="controller")
        return web.json_response({"controller": controller.name,
                                  "in_force": self.sc.state()["in_force"]})


def create_app(settings: SidecarSettings, controller: Controller, *,
               controller_factory: ControllerFactory | None = None) -> web.Application:
    """Build the sidecar application (no I/O: the HTTP client, tokenizer, TensorBoard writer
    and control task start with the app).

    :param settings: validated settings.
    :param controller: the controller in charge at start (built by the caller, e.g. with
        :func:`rlbatch.control.controllers.make_controller`).
    :param controller_factory: builds controllers by name for ``POST /admin/controller``.
    :raises ValueError: the controller does not fit the deployment the settings describe
        (a policy artifact's buckets, pools or observation size).
    """
    sidecar = Sidecar(settings, controller, controller_factory)
    proxy = CompletionProxy(sidecar)
    routes = ServiceRoutes(sidecar, proxy)
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[SIDECAR] = sidecar
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/ready", routes.ready)
    app.router.add_get("/admin/state", routes.admin_state)
    app.router.add_post("/admin/controller", routes.admin_controller)
    app.cleanup_ctx.append(sidecar.lifespan)
    return app


async def serve(app: web.Application, settings: SidecarSettings, *,
                stop: asyncio.Event | None = None, access_log: bool = False) -> None:
    """Run ``app`` on ``settings.host:port`` until SIGINT/SIGTERM (or ``stop`` is set).

    Handlers are cancelled when their client disconnects (aiohttp ``handler_cancellation``),
    which is what cancels the upstream request.

    :param app: from :func:`create_app`.
    :param settings: where to bind.
    :param stop: set it to stop serving (default: a new event set by the signals).
    :param access_log: log every request (off by default: it costs latency).
    """
    stop = stop or asyncio.Event()
    runner = web.AppRunner(app, handler_cancellation=True,
                           access_log=logging.getLogger("aiohttp.access") if access_log
                           else None)
    await runner.setup()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, settings.host, settings.port, backlog=2048,
                           reuse_address=True)
        await site.start()
        # Everything built so far lives as long as the server: keep it out of the garbage
        # collector's generations, so collections stay short on the request path.
        gc.freeze()
        _LOG.info("sidecar listening on http://%s:%d", settings.host, settings.port)
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
        await runner.cleanup()
