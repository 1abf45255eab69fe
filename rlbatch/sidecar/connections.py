"""Client connections: how many, how slow, how long idle; the bounds aiohttp lacks.

aiohttp's server has a keep-alive timeout (3,630 s by default; the sidecar sets
``keepalive_timeout_s``) but no header read timeout and no connection limit, so a client that
trickles a request head, or simply opens many connections, holds a file descriptor each for as
long as it likes. :class:`ConnectionGuard` sees every connection (the protocol factory of
:class:`GuardedSite` wraps aiohttp's) and every request (:meth:`ConnectionGuard.tracked` wraps
the route handlers):

* **header timeout**: a connection that received bytes of a request but no complete head
  ``header_timeout_s`` later is closed (``limit_trips{limit="header_timeout"}``);
* **connection limit**: past ``max_connections``, a new connection closes the connection idle
  longest (no request in progress: a slow header, an idle keep-alive), or is closed itself when
  every connection is busy (``limit_trips{limit="connections"}``).

Request bodies have their own time limit in the handlers (``body_timeout_s``, answered 408).
:func:`quiet_bad_requests` turns aiohttp's ERROR traceback for a malformed or oversized request
head into one DEBUG line and a ``header_size`` trip.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Awaitable, Callable
from typing import cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from rlbatch.sidecar.prom import SidecarMetrics

RESERVED_FDS = 64
"""Descriptors kept back for the listening socket, logs, scrapes and files."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def default_max_connections(upstream_connections: int) -> int:
    """Client connections that fit the process' descriptor limit next to the upstream ones.

    :param upstream_connections: upstream connections the sidecar may hold at once.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - upstream_connections - RESERVED_FDS)


class _Conn:
    """One client connection as the guard tracks it."""

    __slots__ = ("busy", "deadline", "idle_since", "transport")

    def __init__(self, transport: asyncio.Transport, now: float) -> None:
        self.transport = transport
        self.busy = 0
        self.idle_since = now
        self.deadline: asyncio.TimerHandle | None = None


class ConnectionGuard:
    """Tracks client connections; enforces the header timeout and the connection limit.

    :param max_connections: most connections held at once.
    :param header_timeout_s: time from a request's first byte to its complete head.
    :param metrics: where trips and the open count go.
    """

    def __init__(self, max_connections: int, header_timeout_s: float,
                 metrics: SidecarMetrics) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
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
        self._conns[transport] = _Conn(transport, loop.time())
        self.metrics.load.connections_open = len(self._conns)
        return True

    def received(self, transport: asyncio.Transport) -> None:
        """Bytes arrived: an idle connection starts a request head, which must be complete
        within ``header_timeout_s``.

        :param transport: the connection's transport.
        """
        conn = self._conns.get(transport)
        if conn is None or conn.busy or conn.deadline is not None:
            return
        conn.deadline = asyncio.get_running_loop().call_later(
            self.header_timeout_s, self._head_overdue, conn)

    def closed(self, transport: asyncio.Transport) -> None:
        """The connection is gone.

        :param transport: its transport.
        """
        self._drop(transport)

    def _drop(self, transport: asyncio.Transport) -> None:
        conn = self._conns.pop(transport, None)
        if conn is not None and conn.deadline is not None:
            conn.deadline.cancel()
        self.metrics.load.connections_open = len(self._conns)

    def _head_overdue(self, conn: _Conn) -> None:
        conn.deadline = None
        if conn.busy or conn.transport not in self._conns:
            return
        self.metrics.trip("header_timeout")
        self._drop(conn.transport)
        conn.transport.abort()

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
            if conn.deadline is not None:
                conn.deadline.cancel()
                conn.deadline = None
            try:
                return await handler(request)
            finally:
                conn.busy -= 1
                conn.idle_since = asyncio.get_running_loop().time()

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
        if self._transport is None:
            return
        self._guard.received(self._transport)
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

