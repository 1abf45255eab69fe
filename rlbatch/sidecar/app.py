"""The sidecar's HTTP face: an OpenAI-compatible proxy with admission control (aiohttp).

Routes
======

``POST /v1/completions``, ``POST /v1/chat/completions``
    validated (400 with a reason), counted, bucketed, queued (429 + ``Retry-After`` when the
    bucket's queue is full or the request waited ``queue_timeout_s``), forwarded to the pool
    its bucket is routed to when the bucket is under its cap there; streamed responses are
    passed through chunk by chunk. An upstream that cannot be reached or answers 5xx before
    anything was sent to the client is retried on another replica of the same pool, else
    the client gets 503 with the reason; an upstream dying mid-stream ends the stream with
    an OpenAI-style error event. A client that disconnects cancels its upstream request
    (the upstream connection is closed; vLLM aborts the request).
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

Wall-clock times are the sidecar's: TTFT is the arrival at the sidecar to the first
streamed chunk (vLLM sends the first token in the first chunk); TPOT comes from the token
count in the response's usage (requested from the upstream for streams, and stripped from
the stream again unless the client asked for it). A non-streamed response shows no first
token, so its TPOT is the upstream's mean inter-token latency over the last tick and its
TTFT the rest of its time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import signal
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Histogram, generate_latest
from yarl import URL

from rlbatch.control.controllers import Controller
from rlbatch.engine.stats import FinishedRequest
from rlbatch.request import Request
from rlbatch.sidecar.core import ControllerFactory, Sidecar
from rlbatch.sidecar.openai import (
    BadRequest,
    Kind,
    ParsedRequest,
    completion_tokens,
    error_body,
    parse_request,
)
from rlbatch.sidecar.settings import SidecarSettings
from rlbatch.sidecar.upstream import QUEUED, HttpUpstream, Ticket

_LOG = logging.getLogger("rlbatch.sidecar")

SIDECAR = web.AppKey("rlbatch_sidecar", Sidecar)

PASS_HEADERS: tuple[str, ...] = ("Authorization", "X-Request-Id")
"""Client headers passed on to the upstream."""

_UPSTREAM_FAILURES: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError,
                                                       OSError)
CONNECT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,
                                                   aiohttp.ConnectionTimeoutError)
"""Failures that mean the upstream is not there: it is marked down until a scrape succeeds."""


def json_error(status: int, message: str, kind: str, *, param: str | None = None,
               headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style JSON error response.

    :param status: HTTP status.
    :param message: the reason.
    :param kind: error type.
    :param param: offending field.
    :param headers: extra headers (``Retry-After``).
    """
    return web.Response(status=status, body=error_body(message, kind, status, param),
                        content_type="application/json", headers=headers)


class _Upstream503(Exception):
    """The request could not be served by any replica; answered 503."""


class Proxy:
    """Request handlers of one sidecar.

    :param sidecar: the state.
    """

    def __init__(self, sidecar: Sidecar) -> None:
        self.sc = sidecar
        self.retry_after = {"Retry-After": str(sidecar.settings.retry_after_s)}
        self._tokenize_timers: dict[str, Histogram] = {}
        self._urls: dict[tuple[int, str], URL] = {}

    def _url(self, upstream: HttpUpstream, path: str) -> URL:
        """The parsed URL of ``path`` on ``upstream`` (parsed once, not per request)."""
        key = (upstream.engine_id, path)
        url = self._urls.get(key)
        if url is None:
            url = self._urls[key] = URL(upstream.url + path)
        return url

    # ------------------------------------------------------------------ OpenAI routes
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, "completions", "/v1/completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, "chat", "/v1/chat/completions")

    async def handle(self, request: web.Request, kind: Kind, path: str) -> web.StreamResponse:
        sc = self.sc
        raw = await request.read()
        try:
            parsed = parse_request(raw, kind)
        except BadRequest as exc:
            sc.metrics.bad_requests.inc()
            return json_error(400, exc.message, "invalid_request_error", param=exc.param)
        if not sc.ready:
            return json_error(503, f"sidecar not ready: {sc.not_ready_reason}",
                              "service_unavailable", headers=self.retry_after)
        arrival = sc.now()
        t0 = time.perf_counter()
        counter = sc.counter
        prompt_tokens = await counter.count(parsed.prompt)
        timer = self._tokenize_timers.get(counter.name)
        if timer is None:
            timer = self._tokenize_timers[counter.name] = (
                sc.metrics.tokenize_seconds.labels(counter.name))
        timer.observe(time.perf_counter() - t0)
        max_out = parsed.max_output_tokens(prompt_tokens, sc.max_model_len)
        req = Request(sc.new_request_id(), arrival, prompt_tokens, max_out)
        bucket = sc.buckets.index(prompt_tokens)
        ticket = Ticket(req, bucket, asyncio.get_running_loop().create_future())
        refused = sc.submit(ticket)
        if refused is not None:
            sc.metrics.requests[bucket, refused].inc()
            return self._refusal(refused, ticket)
        try:
            if ticket.state == QUEUED or not ticket.future.done():
                try:
                    async with asyncio.timeout(sc.settings.queue_timeout_s):
                        await ticket.future
                except TimeoutError:
                    sc.abandon(ticket)
                    sc.metrics.requests[bucket, "queue_timeout"].inc()
                    return json_error(
                        429, f"request waited {sc.settings.queue_timeout_s:g} s in the "
                        f"{sc.bucket_names[bucket]} queue without being admitted",
                        "rate_limit_exceeded", headers=self.retry_after)
            sc.metrics.queue_time[bucket].observe(sc.now() - arrival)
            if ticket.truncated:
                sc.metrics.truncated[bucket].inc()
            return await self._forward(request, parsed, ticket, path)
        except asyncio.CancelledError:
            sc.metrics.requests[bucket, "cancelled"].inc()
            raise
        finally:
            sc.abandon(ticket)

    def _refusal(self, outcome: str, ticket: Ticket) -> web.Response:
        sc = self.sc
        name = sc.bucket_names[ticket.bucket]
        req = ticket.request
        if outcome == "rejected_queue_full":
            return json_error(429, f"admission queue of bucket {name} is full "
                              f"({sc.settings.max_queue_len} requests)", "rate_limit_exceeded",
                              headers=self.retry_after)
        if outcome == "rejected_too_long":
            return json_error(400, f"prompt ({req.prompt_tokens} tokens) + max_tokens "
                              f"({req.max_output_tokens}) exceeds max_seq_len "
                              f"{sc.max_model_len} (over-length policy: reject)",
                              "invalid_request_error", param="prompt")
        pool = sc.admission.routes[ticket.bucket]
        reasons = "; ".join(u.down_reason for u in sc.by_pool[pool])
        return json_error(503, f"no reachable upstream in pool {pool} for bucket {name}: "
                          f"{reasons}", "service_unavailable", headers=self.retry_after)

    # ------------------------------------------------------------------ forwarding
    def _headers(self, request: web.Request) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        for name in PASS_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        return headers

    async def _forward(self, request: web.Request, parsed: ParsedRequest, ticket: Ticket,
                       path: str) -> web.StreamResponse:
        sc = self.sc
        assert sc.session is not None
        headers = self._headers(request)
        body = parsed.forward_body(ticket.prompt_tokens if ticket.truncated else None)
        while True:
            upstream = ticket.upstream
            assert upstream is not None, "forwarding a request no upstream holds"
            try:
                return await self._attempt(request, parsed, ticket, upstream, path, body,
                                           headers)
            except _Upstream503 as exc:
                message = str(exc)
            if ticket.upstream is upstream and sc.retry_target(ticket) is not None:
                if not ticket.future.done():  # the new replica's engine-wide cap is full
                    await ticket.future
                continue
            sc.metrics.requests[ticket.bucket, "upstream_error"].inc()
            return json_error(503, message, "service_unavailable", headers=self.retry_after)

    async def _attempt(self, request: web.Request, parsed: ParsedRequest, ticket: Ticket,
                       upstream: HttpUpstream, path: str, body: bytes,
                       headers: dict[str, str]) -> web.StreamResponse:
        """One try on one upstream; raises :class:`_Upstream503` when it failed before the
        client got anything (the caller may retry elsewhere)."""
        sc = self.sc
        assert sc.session is not None
        resp: aiohttp.ClientResponse | None = None
        for attempt in (0, 1):
            try:
                resp = await sc.session.post(self._url(upstream, path), data=body,
                                             headers=headers)
                break
            except aiohttp.ServerDisconnectedError:
                if attempt == 0:
                    continue  # a pooled keep-alive connection the server had just closed
                raise _Upstream503(f"upstream {upstream.name} ({upstream.url}) closed the "
                                   f"connection without answering") from None
            except _UPSTREAM_FAILURES as exc:
                reason = (f"upstream {upstream.name} ({upstream.url}) unreachable: "
                          f"{exc or type(exc).__name__}")
                if isinstance(exc, CONNECT_ERRORS):
                    upstream.mark_down(reason)
                raise _Upstream503(reason) from None
        assert resp is not None
        try:
            if resp.status >= 500:
                detail = await resp.read()
                raise _Upstream503(f"upstream {upstream.name} answered {resp.status}: "
                                   f"{detail[:300].decode(errors='replace')}")
            if resp.status == 200 and parsed.stream:
                return await self._stream(request, resp, parsed, ticket, upstream)
            data = await resp.read()
        except _UPSTREAM_FAILURES as exc:
            resp.close()
            raise _Upstream503(f"upstream {upstream.name} failed: "
                               f"{exc or type(exc).__name__}") from None
        except BaseException:
            resp.close()  # cancelled (client gone): closing makes vLLM abort the request
            raise
        resp.release()
        if resp.status == 200:
            self._completed(ticket, upstream, completion_tokens(data), None)
        else:
            sc.metrics.requests[ticket.bucket, "upstream_client_error"].inc()
        return web.Response(status=resp.status, body=data,
                            content_type=resp.content_type or "application/json")

    async def _stream(self, request: web.Request, resp: aiohttp.ClientResponse,
                      parsed: ParsedRequest, ticket: Ticket,
                      upstream: HttpUpstream) -> web.StreamResponse:
        sc = self.sc
        out = web.StreamResponse(status=200, headers={
            "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache"})
        strip_usage = not parsed.wants_usage
        first_s: float | None = None
        tokens: int | None = None
        events = 0
        done = errored = False
        pending = b""
        try:
            if not await _send(out, None, request):
                return self._client_gone(resp, ticket, out)
            async for chunk in resp.content.iter_any():
                if first_s is None:
                    first_s = sc.now()
                pending += chunk
                end = pending.rfind(b"\n\n")
                if end < 0:
                    continue
                complete, pending = pending[:end + 2], pending[end + 2:]
                events += complete.count(b"data: ")
                if b'"usage"' in complete:
                    complete, found = _take_usage(complete, strip_usage)
                    tokens = found if found is not None else tokens
                if b"data: [DONE]" in complete:
                    done = True
                if b'data: {"error"' in complete:
                    errored = True
                if complete and not await _send(out, complete):
                    return self._client_gone(resp, ticket, out)
            if pending and not await _send(out, pending):
                return self._client_gone(resp, ticket, out)
        except _UPSTREAM_FAILURES as exc:
            resp.close()
            reason = f"upstream {upstream.name} failed mid-stream: {exc or type(exc).__name__}"
            await self._stream_error(out, reason, ticket)
            return out
        except BaseException:
            resp.close()  # cancelled (client gone): closing makes vLLM abort the request
            raise
        resp.release()
        if not done:
            await self._stream_error(out, f"upstream {upstream.name} ended the stream "
                                     f"without [DONE]", ticket)
            return out
        if errored:
            sc.metrics.requests[ticket.bucket, "upstream_error"].inc()
        else:
            self._completed(ticket, upstream,
                            tokens if tokens is not None else max(events - 1, 0), first_s)
        await _send(out, b"", eof=True)
        return out

    def _client_gone(self, resp: aiohttp.ClientResponse, ticket: Ticket,
                     out: web.StreamResponse) -> web.StreamResponse:
        resp.close()  # closing the upstream connection makes vLLM abort the request
        self.sc.metrics.requests[ticket.bucket, "cancelled"].inc()
        return out

    async def _stream_error(self, out: web.StreamResponse, message: str,
                            ticket: Ticket) -> None:
        self.sc.metrics.requests[ticket.bucket, "upstream_error"].inc()
        if await _send(out, b"data: " + error_body(message, "upstream_error", 503) + b"\n\n"
                       + b"data: [DONE]\n\n"):
            await _send(out, b"", eof=True)

    def _completed(self, ticket: Ticket, upstream: HttpUpstream, tokens: int | None,
                   first_s: float | None) -> None:
        sc = self.sc
        now = sc.now()
        req = ticket.request
        e2e = now - req.arrival_s
        out_tokens = tokens if tokens is not None else 0
        if first_s is not None:
            ttft = first_s - req.arrival_s
            tpot = (now - first_s) / (out_tokens - 1) if out_tokens > 1 else 0.0
            sc.metrics.ttft[ticket.bucket].observe(ttft)
        else:
            itl = upstream.itl_mean_s
            tpot = itl if math.isfinite(itl) and out_tokens > 1 else 0.0
            ttft = max(0.0, e2e - tpot * max(out_tokens - 1, 0))
        sc.metrics.e2e[ticket.bucket].observe(e2e)
        sc.metrics.requests[ticket.bucket, "ok"].inc()
        sc.finish(ticket, FinishedRequest(
            request_id=req.request_id, bucket=ticket.bucket, pool=upstream.pool,
            arrival_s=req.arrival_s, prompt_tokens=ticket.prompt_tokens,
            output_tokens=out_tokens, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, finish_s=now,
            truncated=ticket.truncated))

    # ------------------------------------------------------------------ other routes
    async def models(self, request: web.Request) -> web.Response:
        sc = self.sc
        assert sc.session is not None
        target = next((u for u in sc.upstreams if u.healthy), None)
        if target is None:
            return json_error(503, "no reachable upstream", "service_unavailable",
                              headers=self.retry_after)
        try:
            async with sc.session.get(target.url + "/v1/models",
                                      headers=self._headers(request)) as resp:
                data = await resp.read()
                return web.Response(status=resp.status, body=data,
                                    content_type=resp.content_type or "application/json")
        except _UPSTREAM_FAILURES as exc:
            return json_error(503, f"upstream {target.name} failed: {exc}",
                              "service_unavailable", headers=self.retry_after)

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.sc.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "ready": self.sc.ready})

    async def ready(self, request: web.Request) -> web.Response:
        sc = self.sc
        missing = [p for p in sc.pools if not sc.pool_available(p)]
        if sc.ready and not missing:
            return web.json_response({"status": "ready", "controller": sc.controller.name})
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
        refusal = self._admin_refusal(request)
        return refusal or web.json_response(self.sc.state())

    async def admin_controller(self, request: web.Request) -> web.Response:
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
            controller = await self.sc.switch_controller(spec)
        except (ValueError, OSError) as exc:
            return json_error(400, f"cannot switch to {spec!r}: {exc}", "invalid_request_error",
                              param="controller")
        return web.json_response({"controller": controller.name,
                                  "in_force": self.sc.state()["in_force"]})


async def _send(out: web.StreamResponse, data: bytes | None,
                request: web.Request | None = None, *, eof: bool = False) -> bool:
    """Write to the client; ``False`` when it has gone away.

    :param out: the stream response.
    :param data: bytes to write (``None`` with ``request``: send the headers).
    :param request: the request, to prepare the response.
    :param eof: finish the response instead.
    """
    try:
        if request is not None:
            await out.prepare(request)
        elif eof:
            await out.write_eof()
        elif data:
            await out.write(data)
    except ConnectionResetError:
        return False
    return True


def _take_usage(complete: bytes, strip: bool) -> tuple[bytes, int | None]:
    """Find the usage-only chunk (``"choices":[]`` + ``usage``) among complete SSE events;
    drop it when the client did not ask for it.

    :param complete: whole events (ending in a blank line).
    :param strip: remove the usage chunk.
    """
    kept: list[bytes] = []
    tokens: int | None = None
    for event in complete.split(b"\n\n"):
        if not event:
            continue
        if b'"usage"' in event and b'"choices":[]' in event:
            tokens = completion_tokens(event)
            if strip:
                continue
        kept.append(event + b"\n\n")
    return b"".join(kept), tokens


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
    proxy = Proxy(sidecar)
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[SIDECAR] = sidecar
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/metrics", proxy.metrics)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/ready", proxy.ready)
    app.router.add_get("/admin/state", proxy.admin_state)
    app.router.add_post("/admin/controller", proxy.admin_controller)
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
