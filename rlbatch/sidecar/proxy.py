"""The sidecar's OpenAI proxy: validate, count, admit and forward completions (streamed or not).

``POST /v1/completions`` and ``POST /v1/chat/completions`` are validated (400 with a reason),
counted, bucketed, queued (429 + ``Retry-After`` when the bucket's queue is full or the
request waited ``queue_timeout_s``), forwarded to the pool its bucket is routed to when the
bucket is under its cap there; streamed responses are passed through chunk by chunk. An
upstream that cannot be reached or answers 5xx before anything was sent to the client is
retried on another replica of the same pool, else the client gets 503 with the reason; an
upstream dying mid-stream ends the stream with an OpenAI-style error event. A client that
disconnects cancels its upstream request (the upstream connection is closed; vLLM aborts the
request).

Wall-clock times are the sidecar's: TTFT is the arrival at the sidecar to the first
streamed chunk (vLLM sends the first token in the first chunk); TPOT comes from the token
count in the response's usage (requested from the upstream for streams, and stripped from
the stream again unless the client asked for it). A non-streamed response shows no first
token, so its TPOT is the upstream's mean inter-token latency over the last tick and its
TTFT the rest of its time.
"""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp
from aiohttp import web
from prometheus_client import Histogram
from yarl import URL

from rlbatch.engine.stats import FinishedRequest
from rlbatch.request import Request
from rlbatch.sidecar.openai import (
    BadRequest,
    Kind,
    ParsedRequest,
    completion_tokens,
    error_body,
    parse_request,
)
from rlbatch.sidecar.service import Sidecar
from rlbatch.sidecar.upstream import QUEUED, HttpUpstream, Ticket

PASS_HEADERS: tuple[str, ...] = ("Authorization", "X-Request-Id")
"""Client headers passed on to the upstream."""

UPSTREAM_FAILURES: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError,
                                                      OSError)
"""Failures of an upstream request (answered 503, or retried on another replica)."""

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


class CompletionProxy:
    """The completion handlers of one sidecar.

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

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``.

        :param request: the client's request.
        """
        return await self.handle(request, "completions", "/v1/completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``.

        :param request: the client's request.
        """
        return await self.handle(request, "chat", "/v1/chat/completions")

    async def handle(self, request: web.Request, kind: Kind, path: str) -> web.StreamResponse:
        """Validate, count, submit, wait for admission, forward; answer the client.

        :param request: the client's request.
        :param kind: ``completions`` or ``chat``.
        :param path: the upstream path to forward to.
        """
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
        refused = sc.dispatch.submit(ticket)
        if refused is not None:
            sc.metrics.requests[bucket, refused].inc()
            return self._refusal(refused, ticket)
        try:
            if ticket.state == QUEUED or not ticket.future.done():
                try:
                    async with asyncio.timeout(sc.settings.queue_timeout_s):
                        await ticket.future
                except TimeoutError:
                    sc.dispatch.abandon(ticket)
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
            sc.dispatch.abandon(ticket)

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
                              f"({req.max_output_tokens}) exceeds max_model_len "
                              f"{sc.max_model_len} (over-length policy: reject)",
                              "invalid_request_error", param="prompt")
        pool = sc.dispatch.route(ticket.bucket)
        reasons = "; ".join(u.down_reason for u in sc.dispatch.by_pool[pool])
        return json_error(503, f"no reachable upstream in pool {pool} for bucket {name}: "
                          f"{reasons}", "service_unavailable", headers=self.retry_after)

    def headers(self, request: web.Request) -> dict[str, str]:
        """The headers forwarded upstream: JSON, plus the client's :data:`PASS_HEADERS`.

        :param request: the client's request.
        """
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
        headers = self.headers(request)
        body = parsed.forward_body(ticket.prompt_tokens if ticket.truncated else None)
        while True:
            upstream = ticket.upstream
            assert upstream is not None, "forwarding a request no upstream holds"
            try:
                return await self._attempt(request, parsed, ticket, upstream, path, body,
                                           headers)
            except _Upstream503 as exc:
                message = str(exc)
            if ticket.upstream is upstream and sc.dispatch.retry_target(ticket) is not None:
                sc.metrics.retries[upstream.pool].inc()
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
            except UPSTREAM_FAILURES as exc:
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
        except UPSTREAM_FAILURES as exc:
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
        except UPSTREAM_FAILURES as exc:
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
        sc.dispatch.finish(ticket, FinishedRequest(
            request_id=req.request_id, bucket=ticket.bucket, pool=upstream.pool,
            arrival_s=req.arrival_s, prompt_tokens=ticket.prompt_tokens,
            output_tokens=out_tokens, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, finish_s=now,
            truncated=ticket.truncated))


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
