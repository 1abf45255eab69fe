"""The sidecar's OpenAI proxy: validate, count, admit and forward completions (streamed or not).

``POST /v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` are read within bounds
(:mod:`rlbatch.sidecar.bodies`: 413, 429, 408), validated (400 with a reason), counted,
bucketed, queued (429 + ``Retry-After`` when the bucket's queue is full or the request waited
``queue_timeout_s``), forwarded to the pool its bucket is routed to when the bucket is under
its cap there; streamed responses are passed through chunk by chunk.

Over-length requests follow vLLM by default (:mod:`rlbatch.sidecar.lengths`): the output is
shortened, the body goes upstream untouched; ``--over-length truncate|reject`` choose the
sidecar's own policies.

Upstream failures: one that was never reached (connect error or timeout) or answered 5xx
before anything was sent to the client is retried on another replica of the same pool, else
503; a connection dropped after the request was sent is NOT retried (the upstream may have
received it: sending it again is not safe for every use), 502; an answer that does not start
within ``first_byte_timeout_s``, 504; a 200 that is not JSON, 502. A stream that fails or stalls
for ``idle_timeout_s`` mid-way ends with an OpenAI-style error event. A client that disconnects
cancels its upstream request (the upstream connection is closed; vLLM aborts the request).

Times are the sidecar's: TTFT is arrival to the first streamed chunk; TPOT comes from the
usage's token count (a stream's usage chunk is requested, then stripped unless the client
asked for it). A non-streamed answer's TPOT is the upstream's mean inter-token latency over
the last tick, its TTFT the rest of its time.
"""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
from aiohttp import web
from yarl import URL

from rlbatch.engine.stats import FinishedRequest
from rlbatch.request import Request
from rlbatch.sidecar.bodies import ERROR_TYPES, BodyReader, Refused, json_error
from rlbatch.sidecar.lengths import PromptSizer, over_policy
from rlbatch.sidecar.openai import (
    BadRequest,
    Kind,
    ParsedRequest,
    completion_tokens,
    error_body,
    parse_request,
)
from rlbatch.sidecar.responses import (
    UsageStripper,
    looks_like_json_object,
    send,
    take_usage,
)
from rlbatch.sidecar.service import Sidecar
from rlbatch.sidecar.upstream import QUEUED, HttpUpstream, Ticket
from rlbatch.sidecar.watchdog import ProgressWatchdog, UpstreamTimeout

RESPONSE_ENDS: tuple[bytes, ...] = (b'"type":"response.completed"',
                                    b'"type":"response.incomplete"',
                                    b'"type":"response.failed"')
"""The events that end a Responses API stream (it sends no ``[DONE]``)."""

PASS_HEADERS: tuple[str, ...] = ("Authorization", "X-Request-Id")
"""Client headers passed on to the upstream."""

UPSTREAM_FAILURES: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError,
                                                      OSError)
"""Failures of an upstream request (answered 503, or retried on another replica)."""

CONNECT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,
                                                   aiohttp.ConnectionTimeoutError)
"""Failures that mean the upstream is not there: it is marked down until a scrape succeeds."""


class _UpstreamFailed(Exception):
    """One try on one upstream failed before the client got anything.

    :param status: the answer if no other replica takes it (502, 503 or 504).
    :param message: the reason.
    :param retry: safe to send to another replica (the upstream never got it, or answered
        an error).
    """

    def __init__(self, status: int, message: str, retry: bool) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry = retry


class CompletionProxy:
    """The completion handlers of one sidecar.

    :param sidecar: the state.
    """

    def __init__(self, sidecar: Sidecar) -> None:
        self.sc = sidecar
        self.retry_after = {"Retry-After": str(sidecar.settings.retry_after_s)}
        self.sizer = PromptSizer(sidecar)
        self._urls: dict[tuple[int, str], URL] = {}
        self.bodies = BodyReader(sidecar.settings, sidecar.metrics, self.retry_after)

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

    async def read_body(self, request: web.Request) -> tuple[bytes, int]:
        """:meth:`BodyReader.read` of this sidecar's budget.

        :param request: the client's request.
        """
        return await self.bodies.read(request)

    def release(self, nbytes: int) -> None:
        """:meth:`BodyReader.release`.

        :param nbytes: the bytes.
        """
        self.bodies.release(nbytes)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses`` (the Responses API).

        :param request: the client's request.
        """
        return await self.handle(request, "responses", "/v1/responses")

    async def handle(self, request: web.Request, kind: Kind, path: str) -> web.StreamResponse:
        """Read within bounds, validate, count, submit, wait for admission, forward; answer
        the client.

        :param request: the client's request.
        :param kind: ``completions`` or ``chat``.
        :param path: the upstream path to forward to.
        """
        try:
            raw, held = await self.read_body(request)
        except Refused as refused:
            return refused.response
        try:
            return await self._handle(request, raw, kind, path)
        finally:
            self.release(held)

    async def _handle(self, request: web.Request, raw: bytes, kind: Kind,
                      path: str) -> web.StreamResponse:
        sc = self.sc
        try:
            parsed = parse_request(raw, kind, sc.settings.max_sequences)
        except BadRequest as exc:
            sc.metrics.bad_requests.inc()
            if exc.limit is not None:
                sc.metrics.trip(exc.limit)
            return json_error(400, exc.message, ERROR_TYPES[400], param=exc.param)
        del raw  # the parsed request keeps the bytes it forwards
        if not sc.ready:
            return json_error(503, f"sidecar not ready: {sc.not_ready_reason}",
                              "service_unavailable", headers=self.retry_after)
        arrival = sc.now()
        limit = sc.max_model_len
        counted = await self.sizer.count(parsed, limit)
        if isinstance(counted, web.Response):
            return counted
        prompt_tokens = counted
        if sc.over_length == "vllm":
            if prompt_tokens >= limit:
                return self.sizer.too_long(parsed, prompt_tokens, arrival)
            max_out = parsed.fitted_output_tokens(prompt_tokens, limit)
        else:
            max_out = parsed.max_output_tokens(prompt_tokens, limit)
        req = Request(sc.new_request_id(), arrival, prompt_tokens, max_out)
        bucket = sc.buckets.index(prompt_tokens)
        ticket = Ticket(req, bucket, asyncio.get_running_loop().create_future())
        refused = sc.dispatch.submit(ticket)
        if refused is not None:
            sc.metrics.requests[bucket, refused].inc()
            return self._refusal(refused, ticket, parsed)
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

    def _refusal(self, outcome: str, ticket: Ticket, parsed: ParsedRequest) -> web.Response:
        sc = self.sc
        name = sc.bucket_names[ticket.bucket]
        req = ticket.request
        if outcome == "rejected_queue_full":
            return json_error(429, f"admission queue of bucket {name} is full "
                              f"({sc.settings.max_queue_len} requests)", "rate_limit_exceeded",
                              headers=self.retry_after)
        if outcome == "rejected_too_long":
            return over_policy(parsed, req.prompt_tokens, req.max_output_tokens,
                               sc.max_model_len, sc.over_length)
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
            except _UpstreamFailed as exc:
                failure = exc
            if (failure.retry and ticket.upstream is upstream
                    and sc.dispatch.retry_target(ticket) is not None):
                sc.metrics.retries[upstream.pool].inc()
                if not ticket.future.done():  # the new replica's engine-wide cap is full
                    await ticket.future
                continue
            outcome = "upstream_timeout" if failure.status == 504 else "upstream_error"
            sc.metrics.requests[ticket.bucket, outcome].inc()
            return json_error(failure.status, failure.message, ERROR_TYPES[failure.status],
                              headers=self.retry_after)

    async def _attempt(self, request: web.Request, parsed: ParsedRequest, ticket: Ticket,
                       upstream: HttpUpstream, path: str, body: bytes,
                       headers: dict[str, str]) -> web.StreamResponse:
        """One try on one upstream; raises :class:`_UpstreamFailed` when it failed before
        the client got anything (the caller may retry elsewhere when that is safe)."""
        sc = self.sc
        s = sc.settings
        assert sc.session is not None
        where = f"upstream {upstream.name} ({upstream.url})"
        dog = ProgressWatchdog(s.first_byte_timeout_s, s.idle_timeout_s)
        try:
            async with dog:
                resp = await sc.session.post(self._url(upstream, path), data=body,
                                             headers=headers)
                if resp.status == 200 and not parsed.stream:
                    # vLLM sends the head with the whole answer: its body follows at once
                    dog.progress()
                    try:
                        data = await resp.read()
                    except BaseException:
                        resp.close()
                        raise
        except UpstreamTimeout as exc:
            first = exc.phase == "first_byte"
            sc.metrics.trip("upstream_first_byte" if first else "upstream_idle")
            option = "--first-byte-timeout-s" if first else "--idle-timeout-s"
            raise _UpstreamFailed(504, f"{where}: {exc} ({option})", retry=False) from None
        except aiohttp.ConnectionTimeoutError:
            sc.metrics.trip("upstream_connect")
            reason = f"{where}: could not connect within {s.connect_timeout_s:g} s"
            upstream.mark_down(reason)
            raise _UpstreamFailed(503, reason, retry=True) from None
        except CONNECT_ERRORS as exc:
            reason = f"{where} unreachable: {exc or type(exc).__name__}"
            upstream.mark_down(reason)
            raise _UpstreamFailed(503, reason, retry=True) from None
        except aiohttp.ServerDisconnectedError:
            raise _UpstreamFailed(502, f"{where} closed the connection without answering "
                                  f"(not retried: it may have received the request)",
                                  retry=False) from None
        except TimeoutError:
            raise self._total_timeout(where) from None
        except UPSTREAM_FAILURES as exc:
            raise _UpstreamFailed(502, f"{where} failed: {exc or type(exc).__name__}",
                                  retry=False) from None
        try:
            if resp.status >= 500:
                detail = await resp.read()
                raise _UpstreamFailed(503, f"upstream {upstream.name} answered "
                                      f"{resp.status}: "
                                      f"{detail[:300].decode(errors='replace')}", retry=True)
            if resp.status == 200 and parsed.stream:
                return await self._stream(request, resp, parsed, ticket, upstream)
            if resp.status != 200:
                async with ProgressWatchdog(s.idle_timeout_s, s.idle_timeout_s):
                    data = await resp.read()
        except UpstreamTimeout as exc:
            resp.close()
            sc.metrics.trip("upstream_idle")
            raise _UpstreamFailed(504, f"{where}: {exc} (--idle-timeout-s)",
                                  retry=False) from None
        except TimeoutError:
            resp.close()
            raise self._total_timeout(where) from None
        except UPSTREAM_FAILURES as exc:
            resp.close()
            raise _UpstreamFailed(502, f"{where} failed: {exc or type(exc).__name__}",
                                  retry=False) from None
        except BaseException:
            resp.close()  # cancelled (client gone): closing makes vLLM abort the request
            raise
        resp.release()
        if resp.status == 200:
            if not looks_like_json_object(data):
                raise _UpstreamFailed(502, f"{where} answered 200 with a body that is not "
                                      f"valid JSON: {data[:100]!r}", retry=False)
            self._completed(ticket, upstream, completion_tokens(data, parsed.usage_key), None)
        else:
            sc.metrics.requests[ticket.bucket, "upstream_client_error"].inc()
        return web.Response(status=resp.status, body=data,
                            content_type=resp.content_type or "application/json")

    def _total_timeout(self, where: str) -> _UpstreamFailed:
        """aiohttp's total time limit (``request_timeout_s``) tripped."""
        self.sc.metrics.trip("upstream_total")
        limit = self.sc.settings.request_timeout_s
        return _UpstreamFailed(504, f"{where}: did not finish within {limit} s "
                               f"(--request-timeout-s)", retry=False)

    async def _stream(self, request: web.Request, resp: aiohttp.ClientResponse,
                      parsed: ParsedRequest, ticket: Ticket,
                      upstream: HttpUpstream) -> web.StreamResponse:
        sc = self.sc
        out = web.StreamResponse(status=200, headers={
            "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache"})
        stripper = None if parsed.wants_usage else UsageStripper()
        responses = parsed.kind == "responses"
        first_s: float | None = None
        tokens: int | None = None
        events = 0
        done = errored = False
        pending = b""
        s = sc.settings
        try:
            if not await send(out, None, request):
                return self._client_gone(resp, ticket, out)
            async with ProgressWatchdog(s.first_byte_timeout_s, s.idle_timeout_s) as dog:
                async for chunk in resp.content.iter_any():
                    dog.progress()
                    if first_s is None:
                        first_s = sc.now()
                    pending += chunk
                    end = pending.rfind(b"\n\n")
                    if end < 0:
                        continue
                    complete, pending = pending[:end + 2], pending[end + 2:]
                    events += complete.count(b"data: ")
                    if responses:
                        if parsed.usage_key in complete:
                            found = completion_tokens(complete, parsed.usage_key)
                            tokens = found if found is not None else tokens
                        done = done or any(end in complete for end in RESPONSE_ENDS)
                        errored = errored or b"event: error" in complete or (
                            b'"type":"response.failed"' in complete)
                    elif stripper is not None:
                        complete = stripper.feed(complete)
                        tokens = stripper.tokens if stripper.tokens is not None else tokens
                    elif b'"usage"' in complete:
                        complete, found = take_usage(complete, False)
                        tokens = found if found is not None else tokens
                    if b"data: [DONE]" in complete:
                        done = True
                    if b'data: {"error"' in complete:
                        errored = True
                    if complete and not await send(out, complete):
                        return self._client_gone(resp, ticket, out)
            if stripper is not None:
                pending = stripper.flush() + pending
            if pending and not await send(out, pending + b"\n\n"):  # end the partial event
                return self._client_gone(resp, ticket, out)
        except UpstreamTimeout as exc:
            resp.close()
            sc.metrics.trip("upstream_idle" if exc.phase == "idle" else "upstream_first_byte")
            await self._stream_error(out, f"upstream {upstream.name} ({upstream.url}) sent "
                                     f"{exc} mid-stream", ticket, responses)
            return out
        except TimeoutError:
            resp.close()
            failure = self._total_timeout(f"upstream {upstream.name} ({upstream.url})")
            await self._stream_error(out, failure.message, ticket, responses)
            return out
        except UPSTREAM_FAILURES as exc:
            resp.close()
            reason = f"upstream {upstream.name} failed mid-stream: {exc or type(exc).__name__}"
            await self._stream_error(out, reason, ticket, responses)
            return out
        except BaseException:
            resp.close()  # cancelled (client gone): closing makes vLLM abort the request
            raise
        resp.release()
        if not done:
            await self._stream_error(out, f"upstream {upstream.name} ended the stream "
                                     f"without its end event", ticket, responses)
            return out
        if errored:
            sc.metrics.requests[ticket.bucket, "upstream_error"].inc()
        else:
            self._completed(ticket, upstream,
                            tokens if tokens is not None else max(events - 1, 0), first_s)
        await send(out, b"", eof=True)
        return out

    def _client_gone(self, resp: aiohttp.ClientResponse, ticket: Ticket,
                     out: web.StreamResponse) -> web.StreamResponse:
        resp.close()  # closing the upstream connection makes vLLM abort the request
        self.sc.metrics.requests[ticket.bucket, "cancelled"].inc()
        return out

    async def _stream_error(self, out: web.StreamResponse, message: str, ticket: Ticket,
                            responses: bool = False) -> None:
        self.sc.metrics.requests[ticket.bucket, "upstream_error"].inc()
        if responses:  # the Responses API's error event
            event = b"event: error\ndata: " + json.dumps(
                {"type": "error", "code": "upstream_error", "message": message,
                 "param": None}).encode() + b"\n\n"
        else:
            event = (b"data: " + error_body(message, "upstream_error", 503) + b"\n\n"
                     + b"data: [DONE]\n\n")
        if await send(out, event):
            await send(out, b"", eof=True)

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
