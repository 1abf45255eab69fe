"""Client connections: how many, how slow, how long idle, how large a head; the bounds aiohttp
lacks.

aiohttp's server has a keep-alive timeout, but it also closes a connection whose next request
head is still arriving (it cannot tell a trickled head from an idle connection), no header
read timeout, no bound on a head's total size (only per line, 8 KB by default, which refuses
the bearer tokens of auth gateways that vLLM accepts) and no connection limit.
:class:`ConnectionGuard` sees every connection (the protocol factory of :class:`GuardedSite`
wraps aiohttp's), every byte that arrives while no request is in progress, and every request
(:meth:`ConnectionGuard.tracked` wraps the route handlers):

* **keep-alive**: a connection with no request in progress and no head arriving is closed
  ``keepalive_timeout_s`` after its last answer (or after it opened); aiohttp's own timer is
  set past the guard's two, as a backstop;
* **header timeout**: once the first byte of a head arrives, the head must be complete within
  ``header_timeout_s`` or the connection is closed (``limit_trips{limit="header_timeout"}``);
* **head size**: a head (request line and headers) longer than ``max_header_bytes`` is
  answered 431 with a JSON error (which does not repeat the head) and the connection closed
  (``limit_trips{limit="header_size"}``);
* **connection limit**: past ``max_connections``, a new connection closes the connection idle
  longest (no request in progress: a slow header, an idle keep-alive), or is closed itself when
  every connection is busy (``limit_trips{limit="connections"}``).

Request bodies have their own time limit in the handlers (``body_timeout_s``, answered 408).
:func:`quiet_bad_requests` turns aiohttp's ERROR traceback for a malformed request head into
one DEBUG line.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Awaitable, Callable
from typing import cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from rlbatch.sidecar.openai import error_body
from rlbatch.sidecar.prom import SidecarMetrics

RESERVED_FDS = 64
"""Descriptors kept back for the listening socket, logs, scrapes and files."""

HEAD_END = b"\r\n\r\n"
"""The blank line that ends a request head."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def default_max_connections(upstream_connections: int) -> int:
    """Client connections that fit the process' descriptor limit next to the upstream ones.

    :param upstream_connections: upstream connections the sidecar may hold at once.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - upstream_connections - RESERVED_FDS)


def head_too_large(limit: int) -> bytes:
    """The whole 431 answer to a request head longer than ``limit`` bytes.

    :param limit: ``max_header_bytes``.
    """
    body = error_body(f"request head (request line and headers) is larger than {limit} "
                      f"bytes (--max-header-bytes)", "RequestHeaderFieldsTooLarge", 431)
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body


class _Conn:
    """One client connection as the guard tracks it.

    Between requests it is idle (``deadline`` unset, the keep-alive timer running), then
    receives a head (``deadline`` set, ``head_bytes`` counting), then waits for its handler
    (``deadline`` set, ``head_bytes`` -1: the head's end was seen), then is busy.
    """

    __slots__ = ("busy", "closing", "deadline", "head_bytes", "idle_since", "keepalive",
                 "tail", "transport")

    def __init__(self, transport: asyncio.Transport, now: float) -> None:
        self.transport = transport
        self.busy = 0
        self.closing = False
        self.idle_since = now
        self.deadline: asyncio.TimerHandle | None = None
        self.keepalive: asyncio.TimerHandle | None = None
        self.head_bytes = -1
        self.tail = b""


class ConnectionGuard:
    """Tracks client connections; enforces the keep-alive and header timeouts, the head size
    and the connection limit.

    :param max_connections: most connections held at once.
    :param header_timeout_s: time from a request's first byte to its complete head.
    :param metrics: where trips and the open count go.
    :param keepalive_timeout_s: idle time (no request, no head arriving) before closing.
    :param max_header_bytes: largest request head.
    """

    def __init__(self, max_connections: int, header_timeout_s: float,
                 metrics: SidecarMetrics, *, keepalive_timeout_s: float = 5.0,
                 max_header_bytes: int = 64 * 2**10) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.max_header_bytes = max_header_bytes
        self.metrics = metrics
        self._conns: dict[asyncio.Transport, _Conn] = {}

    @property
    def open(self) -> int:
        """Connections open now."""
        return len(self._conns)

    # ------------------------------------------------------------ protocol side
    def opened(self, transport: asyncio.Transport) -> bool:
        """A connection arrived; ``False`` when it was refused (already closed).

        :param transport: its transport.
        """
        loop = asyncio.get_running_loop()
        if len(self._conns) >= self.max_connections:
            self.metrics.trip("connections")
            victim = min((c for c in self._conns.values() if not c.busy),
                         key=lambda c: c.idle_since, default=None)
            if victim is None:
                transport.abort()
                return False
            self._drop(victim.transport)
            victim.transport.abort()
        conn = self._conns[transport] = _Conn(transport, loop.time())
        self._arm_keepalive(conn)
        self.metrics.load.connections_open = len(self._conns)
        return True

    def received(self, transport: asyncio.Transport, data: bytes) -> bool:
        """Bytes arrived. On a connection with no request in progress they start (or go on
        with) a request head, which must be complete within ``header_timeout_s`` and at most
        ``max_header_bytes`` long. ``False``: the head was too long, answered and closed
        (the bytes must not be parsed).

        :param transport: the connection's transport.
        :param data: the bytes.
        """
        conn = self._conns.get(transport)
        if conn is None or conn.busy or conn.closing:
            return True
        if conn.deadline is None:  # idle: a head starts
            if conn.keepalive is not None:
                conn.keepalive.cancel()
                conn.keepalive = None
            conn.deadline = asyncio.get_running_loop().call_later(
                self.header_timeout_s, self._head_overdue, conn)
            conn.head_bytes = 0
            conn.tail = b""
        elif conn.head_bytes < 0:  # the head is complete: a body (or a pipelined request)
            return True
        return self._count_head(conn, data)

    def _count_head(self, conn: _Conn, data: bytes) -> bool:
        # the tail keeps the last 3 bytes, so a blank line split across reads is found
        window = conn.tail + data
        end = window.find(HEAD_END)
        if end >= 0:
            size = conn.head_bytes + end + len(HEAD_END) - len(conn.tail)
            conn.head_bytes = -1
            conn.tail = b""
        else:
            size = conn.head_bytes = conn.head_bytes + len(data)
            conn.tail = window[-3:]
        if size <= self.max_header_bytes:
            return True
        self.metrics.trip("header_size")
        self._drop(conn.transport)
        conn.transport.write(head_too_large(self.max_header_bytes))
        conn.transport.close()
        return False

    def closed(self, transport: asyncio.Transport) -> None:
        """The connection is gone.

        :param transport: its transport.
        """
        self._drop(transport)

    def _drop(self, transport: asyncio.Transport) -> None:
        conn = self._conns.pop(transport, None)
        if conn is not None:
            for timer in (conn.deadline, conn.keepalive):
                if timer is not None:
                    timer.cancel()
        self.metrics.load.connections_open = len(self._conns)

    def _head_overdue(self, conn: _Conn) -> None:
        conn.deadline = None
        if conn.busy or conn.transport not in self._conns:
            return
        self.metrics.trip("header_timeout")
        self._drop(conn.transport)
        conn.transport.abort()

    def _arm_keepalive(self, conn: _Conn) -> None:
        if conn.keepalive is not None:
            conn.keepalive.cancel()
        conn.keepalive = asyncio.get_running_loop().call_later(
            self.keepalive_timeout_s, self._idle_overdue, conn)

    def _idle_overdue(self, conn: _Conn) -> None:
        conn.keepalive = None
        if (conn.busy or conn.closing or conn.deadline is not None
                or conn.transport not in self._conns):
            return
        if conn.transport.get_write_buffer_size():  # the last answer is still going out
            self._arm_keepalive(conn)
            return
        self._drop(conn.transport)
        conn.transport.close()

    # ------------------------------------------------------------ request side
    def tracked(self, handler: Handler) -> Handler:
        """``handler`` marking its connection busy while it runs (a plain wrapper: an
        aiohttp middleware costs every request more).

        :param handler: a route's handler.
        """
        conns = self._conns

        async def run(request: web.Request) -> web.StreamResponse:
            conn = conns.get(request.transport) if request.transport else None
            if conn is None:
                return await handler(request)
            conn.busy += 1
            for timer in (conn.deadline, conn.keepalive):
                if timer is not None:
                    timer.cancel()
            conn.deadline = conn.keepalive = None
            conn.head_bytes = -1
            response: web.StreamResponse | None = None
            try:
                response = await handler(request)
                return response
            finally:
                conn.busy -= 1
                conn.idle_since = asyncio.get_running_loop().time()
                if response is not None and response.keep_alive is False:
                    conn.closing = True  # what still arrives is the unread body, not a head
                elif not conn.busy and conn.transport in conns:
                    self._arm_keepalive(conn)

        return run


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's request handler protocol, with the guard told of connections and bytes."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self._inner = inner
        self._guard = guard
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transports implement asyncio.Transport without subclassing it
        tcp = cast(asyncio.Transport, transport)
        self._transport = tcp
        if self._guard.opened(tcp):
            self._inner.connection_made(tcp)
        else:
            self._transport = None

    def data_received(self, data: bytes) -> None:
        if self._transport is not None and self._guard.received(self._transport, data):
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._transport is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is None:
            return
        self._guard.closed(self._transport)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through a :class:`ConnectionGuard`.

    :param runner: the app runner.
    :param host: address to bind.
    :param port: port to bind.
    :param guard: the guard.
    :param backlog: listen backlog.
    """

    __slots__ = ("_guard", "_host", "_port")

    def __init__(self, runner: web.AppRunner, host: str, port: int, guard: ConnectionGuard,
                 *, backlog: int = 2048) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        guard = self._guard

        def factory() -> asyncio.Protocol:
            return _GuardedProtocol(server(), guard)

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(factory, self._host, self._port,
                                                backlog=self._backlog, reuse_address=True)


class _QuietBadRequests(logging.Filter):
    def __init__(self, metrics: SidecarMetrics) -> None:
        super().__init__()
        self.metrics = metrics

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        if isinstance(exc, LineTooLong):
            self.metrics.trip("header_size")
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg, record.args = "bad request head: %s", (exc,)
        record.exc_info = None
        record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_bad_requests(metrics: SidecarMetrics) -> Callable[[], None]:
    """Log a malformed or oversized request head as one DEBUG line (and count oversized
    ones) instead of aiohttp's ERROR traceback; returns the function that undoes it.

    :param metrics: where ``header_size`` trips go.
    """
    log = logging.getLogger("aiohttp.server")
    flt = _QuietBadRequests(metrics)
    log.addFilter(flt)

    def undo() -> None:
        log.removeFilter(flt)

    return undo

