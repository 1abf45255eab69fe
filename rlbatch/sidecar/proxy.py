"""The sidecar's OpenAI proxy: validate, count, admit and forward completions (streamed or not).

``POST /v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` are read within bounds
(:mod:`rlbatch.sidecar.bodies`: 413, 429, 408), validated (400 with a reason), counted,
bucketed, queued, forwarded to the pool its bucket is routed to when the bucket is under its
cap there; streamed responses are passed through chunk by chunk.

Admission's refusals are answered with :attr:`Rejected.status <rlbatch.serving.admission.
Rejected.status>` in the OpenAI error shape: 429 for a full queue, a predicted TTFT over the
SLA's slack or the queued-tokens bound at arrival, 503 for a request that waited out the
queue TTL (``queue_timeout_s``) or whose pool is unreachable. Each carries ``Retry-After``
(whole seconds, rounded up) and ``retry-after-ms`` (which the ``openai`` client prefers): the
refusal's predicted drain time, else ``retry_after_s``.

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
from rlbatch.serving.admission import Rejected
from rlbatch.sidecar.bodies import ERROR_TYPES, BodyReader, Refused, json_error
from rlbatch.sidecar.dispatch import REFUSALS
from rlbatch.sidecar.lengths import PromptSizer, over_policy
from rlbatch.sidecar.openai import (
    BadRequest,
    Kind,
    ParsedRequest,
    completion_tokens,
    error_body,
    parse_request,
)
from rlbatch.sidecar.relay import (
    EventSplitter,
    EventTooLong,
    failure_text,
    looks_like_events,
    read_head,
    read_lead,
    relay_body,
)
from rlbatch.sidecar.responses import StreamEdits, looks_like_json_object, send
from rlbatch.sidecar.service import Sidecar
from rlbatch.sidecar.upstream import HttpUpstream, Ticket
from rlbatch.sidecar.watchdog import ProgressWatchdog, UpstreamTimeout

PASS_HEADERS: tuple[str, ...] = ("Authorization", "X-Request-Id")
"""Client headers passed on to the upstream."""

UPSTREAM_FAILURES: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError,
                                                      OSError)
"""Failures of an upstream request (answered 503, or retried on another replica)."""

CONNECT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,
                                                   aiohttp.ConnectionTimeoutError)
"""Failures that mean the upstream is not there: it is marked down until a scrape succeeds."""


def retry_headers(retry_after_s: float | None, fallback_s: int) -> dict[str, str]:
    """``Retry-After`` (whole seconds, rounded up, at least 1) and ``retry-after-ms`` (the
    ``openai`` client reads it first) of a refusal.

    :param retry_after_s: when the client may come back (the refusal's predicted drain time);
        ``None`` or not positive: no prediction, ``fallback_s`` is sent.
    :param fallback_s: the configured ``Retry-After`` (``retry_after_s`` setting).
    """
    if retry_after_s is None or not (retry_after_s > 0 and math.isfinite(retry_after_s)):
        return {"Retry-After": str(fallback_s), "retry-after-ms": str(fallback_s * 1000)}
    return {"Retry-After": str(max(1, math.ceil(retry_after_s))),
            "retry-after-ms": str(max(1, math.ceil(retry_after_s * 1000)))}


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
        self.retry_after = retry_headers(None, sidecar.settings.retry_after_s)
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
            return json_error(400, exc.message, exc.error_type, param=exc.param)
        del raw  # the parsed request keeps the bytes it forwards
        if not sc.ready:
            return json_error(503, f"sidecar not ready: {sc.not_ready_reason}",
                              "service_unavailable", headers=self.retry_after)
        arrival = sc.now()
        limit = sc.max_model_len
        refused = self._refused_uncounted(parsed, arrival, limit)
        if refused is not None:
            return refused
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
        rejected = sc.dispatch.submit(ticket)
        if rejected is not None:
            return self._refusal(rejected, req, parsed)
        try:
            if not ticket.future.done():
                await ticket.future  # admitted, or expired by the queue TTL
            if ticket.refusal is not None:
                return self._refusal(ticket.refusal, req, parsed)
            sc.metrics.queue_time[bucket].observe(sc.now() - arrival)
            if ticket.truncated:
                sc.metrics.truncated[bucket].inc()
            return await self._forward(request, parsed, ticket, path)
        except asyncio.CancelledError:
            sc.metrics.requests[bucket, "cancelled"].inc()
            raise
        finally:
            sc.dispatch.abandon(ticket)

    def _refused_uncounted(self, parsed: ParsedRequest, arrival: float,
                           limit: int) -> web.Response | None:
        """The refusal of a request that every bucket its prompt can fall in refuses (pool
        unreachable, queue full), answered without counting its prompt (a ``/tokenize``
        call wasted); ``None`` when it must be counted."""
        sc = self.sc
        fewest, most = self.sizer.token_bounds(parsed, limit)
        if most >= limit or (sc.over_length == "reject"
                             and most + parsed.max_output_tokens(most, limit) > limit):
            return None  # it may be too long, which its 400 must say
        bucket = sc.buckets.index(fewest)
        reason = sc.dispatch.refused_in_buckets(bucket, sc.buckets.index(most))
        if reason is None:
            return None
        req = Request(sc.new_request_id(), arrival, fewest,
                      parsed.max_output_tokens(fewest, limit))
        return self._refusal(sc.dispatch.refuse(req, reason), req, parsed)

    def _refusal(self, refused: Rejected, req: Request, parsed: ParsedRequest) -> web.Response:
        """Count a refusal by its reason and answer it: its status, the OpenAI error shape,
        ``Retry-After`` and ``retry-after-ms``."""
        sc = self.sc
        sc.metrics.requests[refused.bucket, REFUSALS[refused.reason]].inc()
        if refused.reason == "too_long":
            return over_policy(parsed, req.prompt_tokens, req.max_output_tokens,
                               sc.max_model_len, sc.over_length)
        status = refused.status
        headers = retry_headers(refused.retry_after_s, sc.settings.retry_after_s)
        if not refused.retry:
            # the openai client obeys it; others read Retry-After
            headers["x-should-retry"] = "false"
        return json_error(status, self._refusal_message(refused), ERROR_TYPES[status],
                          headers=headers)

    def _refusal_message(self, refused: Rejected) -> str:
        """Why a request was refused, in words (naming the option that set the bound)."""
        sc = self.sc
        s = sc.settings
        name = sc.bucket_names[refused.bucket]
        wait = refused.retry_after_s
        drain = "" if not wait else f"; the requests ahead drain in about {wait:.1f} s"
        if refused.reason == "queue_full":
            return (f"admission queue of bucket {name} is full ({s.max_queue_len} requests, "
                    f"--max-queue-len)")
        if refused.reason == "predicted_ttft":
            return (f"predicted time to first token {wait or 0.0:.1f} s exceeds "
                    f"{s.reject_ttft_slack:g} x the SLA's {s.sla.ttft_s:g} s "
                    f"(--reject-ttft-slack)")
        if refused.reason == "queued_tokens":
            return (f"the admission queues hold {sc.admission.queued_prompt_tokens} prompt "
                    f"tokens, the bound is {s.max_num_queued_tokens} "
                    f"(--max-num-queued-tokens){drain}")
        if refused.reason == "queue_ttl":
            return (f"request waited {s.queue_timeout_s:g} s (the queue TTL, "
                    f"--queue-timeout-s) in bucket {name} without being admitted{drain}")
        pool = sc.dispatch.route(refused.bucket)
        reasons = "; ".join(r for u in sc.dispatch.by_pool[pool] if (r := u.down_reason))
        return f"no reachable upstream in pool {pool} for bucket {name}: {reasons}"

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
            if not upstream.healthy and sc.dispatch.retry_target(ticket) is not None:
                # out (ejected, failing its health check) since it took the request, which
                # was not sent to it yet
                if not ticket.future.done():
                    await ticket.future
                continue
            try:
                return await self._attempt(request, parsed, ticket, upstream, path, body,
                                           headers)
            except _UpstreamFailed as exc:
                failure = exc
            sc.dispatch.upstream_failed(upstream, failure.message)
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
        splitter = EventSplitter(self.sc.settings.max_event_bytes)
        resp, lead, whole = await self._open(parsed, upstream, path, body, headers, splitter)
        where = f"upstream {upstream.name}"
        if resp.status >= 500:
            resp.close()
            raise _UpstreamFailed(503, f"{where} answered {resp.status}: "
                                  f"{lead[:300].decode(errors='replace')}", retry=True)
        if resp.status == 200 and parsed.stream:
            return await self._stream(request, resp, parsed, ticket, upstream, splitter, lead)
        json_ok = looks_like_json_object(lead) if whole else lead.lstrip().startswith(b"{")
        if resp.status == 200 and not json_ok:
            resp.close()
            raise _UpstreamFailed(502, f"{where} answered 200 with a body that is not "
                                  f"valid JSON: {lead[:100]!r}", retry=False)
        if not whole:
            return await self._relay(request, resp, parsed, ticket, upstream, lead)
        resp.release()
        if resp.status == 200:
            self._completed(ticket, upstream, completion_tokens(lead, parsed.usage_key), None)
        else:
            self.sc.metrics.requests[ticket.bucket, "upstream_client_error"].inc()
            self.sc.dispatch.upstream_ok(upstream)
        return web.Response(status=resp.status, body=lead,
                            content_type=resp.content_type or "application/json")

    async def _open(self, parsed: ParsedRequest, upstream: HttpUpstream, path: str,
                    body: bytes, headers: dict[str, str],
                    splitter: EventSplitter) -> tuple[aiohttp.ClientResponse, bytes, bool]:
        """Send the request and read the start of the answer (a stream's first events, a
        body whole when it is short, else its first bytes), and whether that is all of it;
        every failure as :class:`_UpstreamFailed`."""
        sc = self.sc
        s = sc.settings
        assert sc.session is not None
        where = f"upstream {upstream.name}"
        resp: aiohttp.ClientResponse | None = None
        try:
            async with ProgressWatchdog(s.first_byte_timeout_s, s.idle_timeout_s) as dog:
                resp = await sc.session.post(self._url(upstream, path), data=body,
                                             headers=headers)
                if resp.status == 200 and parsed.stream:
                    return resp, await self._first_events(resp, splitter, where), False
                dog.progress()  # vLLM sends the head with the whole answer: its body follows
                return resp, *await read_lead(resp)
        except BaseException as exc:
            if resp is not None:
                resp.close()  # cancelled (client gone) too: closing makes vLLM abort it
            if isinstance(exc, Exception) and not isinstance(exc, _UpstreamFailed):
                raise self._open_failure(exc, upstream) from None
            raise

    def _open_failure(self, exc: Exception, upstream: HttpUpstream) -> Exception:
        """What a failure to send a request or to read the start of its answer means."""
        sc = self.sc
        where = f"upstream {upstream.name}"
        if isinstance(exc, UpstreamTimeout):
            first = exc.phase == "first_byte"
            sc.metrics.trip("upstream_first_byte" if first else "upstream_idle")
            option = "--first-byte-timeout-s" if first else "--idle-timeout-s"
            return _UpstreamFailed(504, f"{where}: {exc} ({option})", retry=False)
        if isinstance(exc, EventTooLong):
            sc.metrics.trip("event_size")
            return _UpstreamFailed(502, f"{where} {exc}", retry=False)
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            sc.metrics.trip("upstream_connect")
            reason = f"could not connect within {sc.settings.connect_timeout_s:g} s"
            upstream.mark_down(reason)
            return _UpstreamFailed(503, f"{where} unreachable: {reason}", retry=True)
        if isinstance(exc, CONNECT_ERRORS):
            upstream.mark_down(failure_text(exc))
            return _UpstreamFailed(503, f"{where} unreachable: {failure_text(exc)}",
                                   retry=True)
        if isinstance(exc, aiohttp.ServerDisconnectedError):
            return _UpstreamFailed(502, f"{where} closed the connection without answering "
                                   f"(not retried: it may have received the request)",
                                   retry=False)
        if isinstance(exc, TimeoutError):
            return self._total_timeout(where)
        if isinstance(exc, UPSTREAM_FAILURES):
            return _UpstreamFailed(502, f"{where} failed: {failure_text(exc)}", retry=False)
        return exc

    async def _first_events(self, resp: aiohttp.ClientResponse, splitter: EventSplitter,
                            where: str) -> bytes:
        """A stream's first whole events, once it is clear the answer is an event stream:
        another body under a 200 is the upstream's failure, answered before the client
        gets a stream."""
        if resp.content_type != "text/event-stream":
            snippet = await read_head(resp, 100)
            raise _UpstreamFailed(502, f"{where} answered a stream request with "
                                  f"{resp.content_type or 'no content type'}, not an event "
                                  f"stream: {snippet!r}", retry=False)
        while True:
            chunk = await resp.content.readany()
            if not chunk:
                rest = splitter.rest()
                if rest and not looks_like_events(rest):
                    raise _UpstreamFailed(502, f"{where} answered a stream request with a "
                                          f"body that is not an event stream: "
                                          f"{rest[:100]!r}", retry=False)
                raise _UpstreamFailed(502, f"{where} ended the stream before its first "
                                      f"event", retry=False)
            events = splitter.feed(chunk)
            if events:
                break
        if not looks_like_events(events):
            raise _UpstreamFailed(502, f"{where} answered a stream request with a body that "
                                  f"is not an event stream: {events[:100]!r}", retry=False)
        return events

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse,
                     parsed: ParsedRequest, ticket: Ticket, upstream: HttpUpstream,
                     lead: bytes) -> web.StreamResponse:
        """Pass a non-streamed answer on as it arrives; count it from its tail."""
        sc = self.sc
        try:
            relayed = await relay_body(request, resp, lead, sc.settings.idle_timeout_s)
        except BaseException:
            resp.close()  # cancelled (client gone): closing makes vLLM abort the request
            raise
        if relayed.complete:
            resp.release()
        else:
            resp.close()
        if relayed.client_gone:
            sc.metrics.requests[ticket.bucket, "cancelled"].inc()
        elif relayed.failure:
            if relayed.stalled:
                sc.metrics.trip("upstream_idle")
            sc.metrics.requests[ticket.bucket, "upstream_error"].inc()
            sc.dispatch.upstream_failed(upstream, f"answer cut: {relayed.failure}")
        elif resp.status != 200:
            sc.metrics.requests[ticket.bucket, "upstream_client_error"].inc()
            sc.dispatch.upstream_ok(upstream)
        elif not relayed.tail.rstrip().endswith(b"}"):  # vLLM's answer is one JSON object
            sc.metrics.requests[ticket.bucket, "upstream_error"].inc()
            sc.dispatch.upstream_failed(upstream, "answer cut: not a whole JSON object")
        else:
            self._completed(ticket, upstream, completion_tokens(relayed.tail,
                                                                parsed.usage_key), None)
        return relayed.out

    def _total_timeout(self, where: str) -> _UpstreamFailed:
        """aiohttp's total time limit (``request_timeout_s``) tripped."""
        self.sc.metrics.trip("upstream_total")
        limit = self.sc.settings.request_timeout_s
        return _UpstreamFailed(504, f"{where}: did not finish within {limit} s "
                               f"(--request-timeout-s)", retry=False)

    async def _stream(self, request: web.Request, resp: aiohttp.ClientResponse,
                      parsed: ParsedRequest, ticket: Ticket, upstream: HttpUpstream,
                      splitter: EventSplitter, first: bytes) -> web.StreamResponse:
        """Pass a stream on event by event, starting with its ``first`` events. The idle
        limit counts from the last event passed on: bytes that end no event are no
        progress."""
        sc = self.sc
        out = web.StreamResponse(status=200, headers={
            "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache"})
        edits = StreamEdits(parsed.kind == "responses", parsed.usage_key, parsed.wants_usage)
        first_s = sc.now()
        where = f"upstream {upstream.name}"
        failure = ""
        try:
            if not await send(out, None, request):
                return self._client_gone(resp, ticket, out)
            complete = first
            idle = sc.settings.idle_timeout_s
            async with ProgressWatchdog(idle, idle) as dog:
                while True:
                    if complete:
                        dog.progress()
                        complete = edits.edit(complete)
                        if complete and not await send(out, complete):
                            return self._client_gone(resp, ticket, out)
                    chunk = await resp.content.readany()
                    if not chunk:
                        break
                    complete = splitter.feed(chunk)
            rest = edits.flush() + splitter.rest()
            if rest and not await send(out, rest + b"\n\n"):  # end the partial event
                return self._client_gone(resp, ticket, out)
        except UpstreamTimeout as exc:
            sc.metrics.trip("upstream_idle")
            failure = f"{where} sent {exc} mid-stream"
        except EventTooLong as exc:
            sc.metrics.trip("event_size")
            failure = f"{where} {exc}"
        except TimeoutError:
            failure = self._total_timeout(where).message
        except UPSTREAM_FAILURES as exc:
            failure = f"{where} failed mid-stream: {failure_text(exc)}"
        except BaseException:
            resp.close()  # cancelled (client gone): closing makes vLLM abort the request
            raise
        if not failure and not edits.done:
            failure = f"{where} ended the stream without its end event"
        if failure:
            resp.close()
            sc.dispatch.upstream_failed(upstream, failure.removeprefix(where + " "))
            await self._stream_error(out, failure, ticket, edits.responses)
            return out
        resp.release()
        if edits.errored:
            sc.metrics.requests[ticket.bucket, "upstream_error"].inc()
        else:
            tokens = edits.tokens if edits.tokens is not None else max(edits.events - 1, 0)
            self._completed(ticket, upstream, tokens, first_s)
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
        sc.dispatch.upstream_ok(upstream)
        sc.dispatch.finish(ticket, FinishedRequest(
            request_id=req.request_id, bucket=ticket.bucket, pool=upstream.pool,
            arrival_s=req.arrival_s, prompt_tokens=ticket.prompt_tokens,
            output_tokens=out_tokens, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, finish_s=now,
            truncated=ticket.truncated))
