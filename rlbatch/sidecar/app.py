"""The sidecar's HTTP application: its routes, the service endpoints, and the server loop.

Routes
======

``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``
    the OpenAI proxy (:mod:`rlbatch.sidecar.proxy`).
``GET /v1/models``
    the first reachable upstream's answer.
``GET /metrics``
    the sidecar's Prometheus metrics (:mod:`rlbatch.sidecar.prom`).
``GET /health``
    200 while the process serves (liveness); ``GET /ready``: 200 once every pool has a
    healthy upstream and the controller is in charge (with ``out``: the replicas out and
    why, when some are), else 503 with the reason.
``POST /tokenize``, ``POST /detokenize``, ``GET /version``
    passed through to a reachable upstream (they carry no generation load).
``GET /admin/state``, ``POST /admin/controller`` (``{"controller": "static:8"}``)
    state, and switching the controller at run time; off (403) unless ``admin_token`` is
    set, then only with ``Authorization: Bearer TOKEN``. ``ppo:PATH`` must resolve under one
    of ``policy_dirs`` and its files be regular and at most ``max_policy_bytes``, checked
    before anything reads them (:mod:`rlbatch.sidecar.policy_files`).

Any other path answers vLLM's (FastAPI's) JSON 404 ``{"detail": "Not Found"}`` (405
``{"detail": "Method Not Allowed"}`` for a known path asked with another method).
Background responses, stored-response retrieval and vLLM's other generation endpoints are not
served (docs/sidecar.md).

With ``metrics_port`` set, ``/metrics`` and ``/admin/*`` move to that port (with ``/health``
and ``/ready``), so the Service that exposes the API port exposes neither.

The server bounds its clients (:mod:`rlbatch.sidecar.connections`): keep-alive idle
``keepalive_timeout_s``, request head ``header_timeout_s``, ``max_connections``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import logging
import signal
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rlbatch.control.controllers import Controller
from rlbatch.control.specs import spec_preset, spec_settings_text
from rlbatch.sidecar.bodies import Refused, json_error
from rlbatch.sidecar.connections import (
    ConnectionGuard,
    GuardedSite,
    Handler,
    default_max_connections,
    quiet_bad_requests,
)
from rlbatch.sidecar.control_tick import ControllerBuilder
from rlbatch.sidecar.policy_files import (
    PolicyPathError,
    check_policy_path,
    confined_policy,
    policy_path_of,
)
from rlbatch.sidecar.proxy import UPSTREAM_FAILURES, CompletionProxy
from rlbatch.sidecar.relay import failure_text, read_lead, relay_body
from rlbatch.sidecar.service import Sidecar
from rlbatch.sidecar.settings import SidecarSettings

_LOG = logging.getLogger("rlbatch.sidecar")

SIDECAR = web.AppKey("rlbatch_sidecar", Sidecar)
GUARD = web.AppKey("rlbatch_connection_guard", ConnectionGuard)
CONTROL_APP = web.AppKey("rlbatch_control_app", web.Application)
"""The app of the metrics port (``/metrics``, ``/health``, ``/ready``, ``/admin/*``), when
``metrics_port`` is set."""

CATCH_ALL = "/{tail:.*}"
"""The last route's path: everything no other route serves."""

CONTROL_CONNECTIONS = 64
"""Connections the metrics port holds at once (scrapers, probes, an operator)."""

PASS_THROUGH: tuple[tuple[str, str], ...] = (("POST", "/tokenize"), ("POST", "/detokenize"),
                                             ("GET", "/version"))
"""vLLM endpoints without generation load, passed to a reachable upstream as they are."""


class ServiceRoutes:
    """The non-proxy routes of one sidecar: models, metrics, health, readiness, admin.

    :param sidecar: the state.
    :param proxy: the completion proxy (for the headers it passes on).
    """

    def __init__(self, sidecar: Sidecar, proxy: CompletionProxy) -> None:
        self.sc = sidecar
        self.proxy = proxy
        self.retry_after = proxy.retry_after

    async def models(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models``: the first reachable upstream's answer.

        :param request: the request.
        """
        return await self.pass_through(request)

    async def pass_through(self, request: web.Request) -> web.StreamResponse:
        """The request as it is to the first reachable upstream, its answer back as it
        arrives (body within the sidecar's body limits; the upstream's answer within the
        idle limit).

        :param request: the request.
        """
        sc = self.sc
        assert sc.session is not None
        held = 0
        body = b""
        if request.method == "POST":
            try:
                body, held = await self.proxy.read_body(request)
            except Refused as refused:
                return refused.response
        try:
            target = next((u for u in sc.upstreams if u.healthy), None)
            if target is None:
                return json_error(503, "no reachable upstream", "service_unavailable",
                                  headers=self.retry_after)
            timeout = aiohttp.ClientTimeout(sock_read=sc.settings.idle_timeout_s,
                                            connect=sc.settings.connect_timeout_s)
            try:
                async with sc.session.request(request.method, target.url + request.path,
                                              data=body or None, timeout=timeout,
                                              headers=self.proxy.headers(request)) as resp:
                    lead, whole = await read_lead(resp)
                    if whole:
                        return web.Response(status=resp.status, body=lead, content_type=(
                            resp.content_type or "application/json"))
                    relayed = await relay_body(request, resp, lead, sc.settings.idle_timeout_s)
                    return relayed.out
            except UPSTREAM_FAILURES as exc:
                _LOG.warning("upstream %s (%s) failed a pass-through %s %s: %s", target.name,
                             target.url, request.method, request.path, exc)
                return json_error(503, f"upstream {target.name} failed: "
                                  f"{failure_text(exc)}", "service_unavailable",
                                  headers=self.retry_after)
        finally:
            self.proxy.release(held)

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
        out = {u.name: u.down_reason for u in sc.upstreams if not u.healthy}
        if sc.ready and not missing:
            answer: dict[str, Any] = {"status": "ready",
                                      "controller": sc.control.controller.name}
            if out:
                answer["out"] = out
            return web.json_response(answer)
        reason = sc.not_ready_reason or (f"no healthy upstream in pool(s) {', '.join(missing)}: "
                                         + "; ".join(out.values()))
        return web.json_response({"status": "not ready", "reason": reason}, status=503)

    def _admin_refusal(self, request: web.Request) -> web.Response | None:
        token = self.sc.settings.admin_token
        if token is None:
            return json_error(403, "admin endpoints are off: start the sidecar with "
                              "--admin-token (or $RLBATCH_ADMIN_TOKEN) to use them",
                              "permission_error")
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            # who tried, never what they sent (a near miss of the token is a secret too)
            _LOG.warning("admin request %s %s refused: %s bearer token from %s",
                         request.method, request.path, "wrong" if given else "no",
                         request.remote)
            return json_error(401, "admin endpoints need 'Authorization: Bearer TOKEN'",
                              "authentication_error")
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
            raw, held = await self.proxy.read_body(request)
        except Refused as refused:
            return refused.response
        try:
            body: Any = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            return json_error(400, f"body is not valid JSON: {exc}", "invalid_request_error")
        finally:
            self.proxy.release(held)
        spec = body.get("controller") if isinstance(body, dict) else None
        if not isinstance(spec, str) or not spec:
            return json_error(400, "field 'controller' (e.g. \"static:8\", \"playbook\", "
                              "\"ppo:PATH\") is required", "invalid_request_error",
                              param="controller")
        try:
            spec = self._checked_spec(spec)
        except ValueError as exc:  # a refused path, or brackets out of place
            return json_error(400, f"cannot switch to {spec!r}: {exc}", "invalid_request_error",
                              param="controller")
        try:
            controller = await self.sc.control.switch_controller(spec)
        except (ValueError, OSError) as exc:
            return json_error(400, f"cannot switch to {spec!r}: {exc}", "invalid_request_error",
                              param="controller")
        return web.json_response({"controller": controller.name,
                                  "in_force": self.sc.state()["in_force"]})

    def _checked_spec(self, spec: str) -> str:
        """``spec`` with a ``ppo:PATH`` confined to the policy folders and checked before
        anything reads it; other controllers may not name files.

        :param spec: the controller name sent.
        :raises PolicyPathError: refused.
        """
        settings = self.sc.settings
        preset = spec_preset(spec)
        path = policy_path_of(spec)
        if path is None:
            _, _, arg = preset.partition(":")
            if "/" in arg or "\\" in arg or preset.endswith(".toml"):
                raise PolicyPathError("only ppo:PATH controllers may name files")
            return spec
        resolved = confined_policy(path, settings.policy_dirs)
        check_policy_path(resolved, settings.max_policy_bytes)
        return f"ppo:{resolved}{spec_settings_text(spec)}"


def not_found(served: web.Application) -> Handler:
    """The last route of ``served``: vLLM's (FastAPI's) JSON answer to an unknown path (404)
    or to a known path asked with another method (405).

    :param served: the application whose routes are known.
    """
    async def answer(request: web.Request) -> web.Response:
        known = any(r.canonical == request.path for r in served.router.resources()
                    if r.canonical != CATCH_ALL)
        if known:
            return web.json_response({"detail": "Method Not Allowed"}, status=405)
        return web.json_response({"detail": "Not Found"}, status=404)

    return answer


def create_app(settings: SidecarSettings, controller: Controller, *,
               controller_factory: ControllerBuilder | None = None) -> web.Application:
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
    upstream_connections = settings.max_num_seqs * len(settings.upstreams) + 2 * len(
        settings.upstreams)
    guard = ConnectionGuard(settings.max_connections
                            or default_max_connections(upstream_connections),
                            settings.header_timeout_s, sidecar.metrics,
                            keepalive_timeout_s=settings.keepalive_timeout_s,
                            max_header_bytes=settings.max_header_bytes)
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[SIDECAR] = sidecar
    app[GUARD] = guard
    control = app
    if settings.metrics_port is not None:
        # /metrics and /admin/* on their own port, which the Service does not expose
        control = web.Application(client_max_size=64 * 1024)
        control[GUARD] = ConnectionGuard(CONTROL_CONNECTIONS, settings.header_timeout_s,
                                         sidecar.metrics,
                                         keepalive_timeout_s=settings.keepalive_timeout_s,
                                         max_header_bytes=settings.max_header_bytes)
        app[CONTROL_APP] = control

    def add(target: web.Application, method: str, path: str, handler: Handler) -> None:
        # each handler marks its connection busy for the connection guard
        target.router.add_route(method, path, target[GUARD].tracked(handler))

    add(app, "POST", "/v1/completions", proxy.completions)
    add(app, "POST", "/v1/chat/completions", proxy.chat)
    add(app, "POST", "/v1/responses", proxy.responses)
    add(app, "GET", "/v1/models", routes.models)
    for method, path in PASS_THROUGH:
        add(app, method, path, routes.pass_through)
    for served in {id(app): app, id(control): control}.values():
        add(served, "GET", "/health", routes.health)
        add(served, "GET", "/ready", routes.ready)
    add(control, "GET", "/metrics", routes.metrics)
    add(control, "GET", "/admin/state", routes.admin_state)
    add(control, "POST", "/admin/controller", routes.admin_controller)
    for served in {id(app): app, id(control): control}.values():
        # last: any other path answers vLLM's JSON 404 (a route, not a middleware: no
        # cost on the request path)
        add(served, "*", CATCH_ALL, not_found(served))
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
    log = logging.getLogger("aiohttp.access") if access_log else None
    # After an answer that left the body unread (413, 408), read and drop the rest for at
    # most lingering_time, then close. The connection guard keeps the keep-alive, header and
    # head-size bounds: aiohttp's keep-alive timer would close a head still arriving, so it
    # only backs the guard's up, and its per-line limits are no tighter than the guard's.
    server_args: dict[str, Any] = {
        "keepalive_timeout": settings.keepalive_timeout_s + settings.header_timeout_s,
        "lingering_time": 1.0, "access_log": log, "max_line_size": settings.max_header_bytes,
        "max_field_size": settings.max_header_bytes}
    runner = web.AppRunner(app, handler_cancellation=True, **server_args)
    control = app.get(CONTROL_APP)
    control_runner = None if control is None else web.AppRunner(control, **server_args)
    undo_quiet = quiet_bad_requests(app[SIDECAR].metrics)
    await runner.setup()
    if control_runner is not None:
        await control_runner.setup()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        _LOG.info("%s received", sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)
    try:
        site = GuardedSite(runner, settings.host, settings.port, app[GUARD], backlog=2048)
        await site.start()
        if control_runner is not None and control is not None:
            assert settings.metrics_port is not None
            await GuardedSite(control_runner, settings.host, settings.metrics_port,
                              control[GUARD], backlog=128).start()
            _LOG.info("metrics and admin on http://%s:%d", settings.host,
                      settings.metrics_port)
        # Everything built so far lives as long as the server: keep it out of the garbage
        # collector's generations, so collections stay short on the request path.
        gc.freeze()
        _LOG.info("sidecar listening on http://%s:%d", settings.host, settings.port)
        await stop.wait()
    finally:
        _LOG.info("sidecar stopping")
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
        if control_runner is not None:
            await control_runner.cleanup()
        await runner.cleanup()
        undo_quiet()
        _LOG.info("sidecar stopped")
