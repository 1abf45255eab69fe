"""Upstream answers passed on without holding them whole.

A non-streamed answer is read whole only up to :data:`WHOLE_ANSWER_BYTES` (every ordinary
answer: checked, counted and sent as one, or answered 502 when it fails); a longer one is
relayed chunk by chunk (:func:`relay_body`), keeping only its last bytes, where vLLM puts
``usage``: four 150 MiB answers (``n`` = 16 with logprobs and echo reach tens of MiB) must not
cost the sidecar their size in memory. A stream is cut into its events by
:class:`EventSplitter`, which scans each byte once and holds at most ``max_event_bytes`` of an
unfinished event. :func:`read_head` reads the first bytes of an answer whose rest is not
needed (an error's detail, ``/tokenize``'s count).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from rlbatch.sidecar.responses import send
from rlbatch.sidecar.watchdog import ProgressWatchdog, UpstreamTimeout

WHOLE_ANSWER_BYTES = 256 * 2**10
"""Answers up to this long are read whole before the client gets anything (a few KB is
usual; the requests in flight times this is what it may cost)."""

TAIL_BYTES = 64 * 2**10
"""Bytes kept of the end of a relayed answer (its ``usage`` comes last, and the fields vLLM
writes after it are small)."""

EVENT_FIELDS: tuple[bytes, ...] = (b"data:", b"event:", b"id:", b"retry:", b":")
"""How a line of a server-sent event stream begins (``:`` a comment)."""


class EventTooLong(Exception):
    """An upstream stream event grew past ``max_event_bytes`` without ending.

    :param limit: the bound.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(f"sent an event longer than {limit} bytes (--max-event-bytes)")
        self.limit = limit


class EventSplitter:
    """Whole server-sent events out of the chunks of a stream.

    :param max_event_bytes: most bytes of an unfinished event held.
    """

    def __init__(self, max_event_bytes: int) -> None:
        self.max_event_bytes = max_event_bytes
        self._pending = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        """The events this chunk completes (each ending in a blank line), ``b""`` when none.

        :param chunk: bytes of the stream.
        :raises EventTooLong: the unfinished event passed the bound.
        """
        pending = self._pending
        # only the new bytes (and the one before them) can hold the blank line that ends one
        start = max(0, len(pending) - 1)
        pending += chunk
        end = pending.rfind(b"\n\n", start)
        if end < 0:
            complete = b""
        else:
            complete = bytes(pending[:end + 2])
            del pending[:end + 2]
        if len(pending) > self.max_event_bytes:
            raise EventTooLong(self.max_event_bytes)
        return complete

    def rest(self) -> bytes:
        """The unfinished event left when the stream ended (then forgotten)."""
        rest = bytes(self._pending)
        self._pending.clear()
        return rest


def failure_text(exc: BaseException) -> str:
    """What went wrong with an upstream call, in words a client may read: no host, port or
    URL (aiohttp's messages name them), which the logs carry instead.

    :param exc: the failure.
    """
    if isinstance(exc, UpstreamTimeout | aiohttp.ServerDisconnectedError):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno:  # ClientConnectorError among them
        # the errno's words: the exception's own may name the address
        return f"{type(exc).__name__} ({os.strerror(exc.errno)})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return type(exc).__name__


def looks_like_events(data: bytes) -> bool:
    """Whether ``data``, the start of a stream, reads as server-sent events."""
    return data.lstrip(b"\r\n").startswith(EVENT_FIELDS)


async def read_head(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """Up to the first ``limit`` bytes of an answer's body (fewer when it ends first).

    :param resp: the answer.
    :param limit: most bytes read.
    """
    data = b""
    while len(data) < limit:
        chunk = await resp.content.read(limit - len(data))
        if not chunk:
            break
        data += chunk
    return data


async def read_lead(resp: aiohttp.ClientResponse,
                    limit: int = WHOLE_ANSWER_BYTES) -> tuple[bytes, bool]:
    """The answer's body when it ends within about ``limit`` bytes, else its first bytes (at
    least ``limit``); and whether it was whole.

    :param resp: the answer.
    :param limit: bytes read before giving up on holding it whole.
    """
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await resp.content.readany()
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False


@dataclass(slots=True)
class Relayed:
    """How a relayed answer went.

    :param out: the client's response.
    :param tail: the last :data:`TAIL_BYTES` of the body sent.
    :param complete: the whole body was relayed (else the upstream failed or the client
        went away mid-way, and the client connection was closed).
    :param client_gone: the client went away.
    :param failure: why the upstream failed mid-way (``""`` when it did not).
    :param stalled: that failure was the idle limit.
    """

    out: web.StreamResponse
    tail: bytes
    complete: bool
    client_gone: bool = False
    failure: str = ""
    stalled: bool = False


async def relay_body(request: web.Request, resp: aiohttp.ClientResponse, lead: bytes,
                     idle_s: float) -> Relayed:
    """Pass an upstream answer (its status, content type and body) to the client chunk by
    chunk. When the upstream fails mid-way the client's connection is closed, so the client
    sees a broken answer rather than a short one that looks whole.

    :param request: the client's request.
    :param resp: the upstream's answer, ``lead`` already read from its body.
    :param lead: the first bytes of its body.
    :param idle_s: longest wait for the next chunk.
    """
    out = web.StreamResponse(status=resp.status, headers={
        "Content-Type": resp.headers.get("Content-Type", "application/json")})
    if resp.content_length is not None:
        out.content_length = resp.content_length
    tail = lead[-TAIL_BYTES:]
    if not await send(out, None, request) or not await send(out, lead):
        return Relayed(out, tail, False, client_gone=True)
    try:
        async with ProgressWatchdog(idle_s, idle_s) as dog:
            async for chunk in resp.content.iter_any():
                dog.progress()
                tail = (tail + chunk)[-TAIL_BYTES:]
                if not await send(out, chunk):
                    return Relayed(out, tail, False, client_gone=True)
    except (UpstreamTimeout, aiohttp.ClientError, OSError, TimeoutError) as exc:
        if request.transport is not None:
            request.transport.abort()
        return Relayed(out, tail, False, failure=failure_text(exc),
                       stalled=isinstance(exc, UpstreamTimeout))
    if not await send(out, b"", eof=True):
        return Relayed(out, tail, False, client_gone=True)
    return Relayed(out, tail, True)
