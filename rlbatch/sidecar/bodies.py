"""Request bodies within bounds: size, the bytes all requests hold together, and time.

A body larger than ``max_body_bytes`` is answered 413. Every request inside the sidecar holds
its body until it is answered; together they share ``max_held_bytes``, counted as the bytes
arrive: a ``Content-Length`` only promises bytes, and reserving the promise let four slow
uploads that announced the body cap hold the whole budget while sending a byte at a time. A
request whose body does not fit what the others hold is answered 429 with ``Retry-After``
(before reading anything when its ``Content-Length`` already says so). A body that does not
arrive within ``body_timeout_s`` is answered 408. Each trip is counted
(``rlbatch_limit_trips_total``).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from rlbatch.sidecar.openai import error_body
from rlbatch.sidecar.prom import SidecarMetrics
from rlbatch.sidecar.settings import SidecarSettings

ERROR_TYPES: dict[int, str] = {400: "BadRequestError", 408: "RequestTimeout",
                               413: "RequestEntityTooLarge", 429: "rate_limit_exceeded",
                               502: "bad_gateway", 503: "service_unavailable",
                               504: "gateway_timeout"}
"""Error ``type`` per status (vLLM's ``BadRequestError`` for 400s)."""


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


class Refused(Exception):
    """A request answered before admission (body limits); carries the answer."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


class BodyReader:
    """Reads request bodies within the sidecar's bounds, keeping the held-bytes account.

    :param settings: the limits.
    :param metrics: where trips and the held bytes go.
    :param retry_after: the ``Retry-After`` header of a 429.
    """

    def __init__(self, settings: SidecarSettings, metrics: SidecarMetrics,
                 retry_after: dict[str, str]) -> None:
        self.settings = settings
        self.metrics = metrics
        self.retry_after = retry_after
        self.held_bytes = 0

    async def read(self, request: web.Request) -> tuple[bytes, int]:
        """Read a request body within the body-size, held-bytes and body-time limits, holding
        its bytes in the budget as they arrive.

        :param request: the client's request.
        :returns: the body and the bytes held for it (give them back with :meth:`release`).
        :raises Refused: a limit tripped (413, 429 or 408; counted).
        """
        s = self.settings
        length = request.content_length
        if length is not None and length > s.max_body_bytes:
            self.metrics.trip("body_size")
            raise Refused(self._too_large())
        if length is not None and self.held_bytes + length > s.max_held_bytes:
            raise Refused(self._over_budget(length))  # cannot fit: refused unread
        chunks: list[bytes] = []
        try:
            if request.content.is_eof():  # all there already (a small body): no timer
                await self._receive(request, chunks)
            else:
                async with asyncio.timeout(s.body_timeout_s):
                    await self._receive(request, chunks)
        except TimeoutError:
            self.release(sum(map(len, chunks)))
            self.metrics.trip("body_timeout")
            response = json_error(408, f"request body not received within "
                                  f"{s.body_timeout_s:g} s", ERROR_TYPES[408])
            response.force_close()
            raise Refused(response) from None
        except BaseException:
            self.release(sum(map(len, chunks)))
            raise
        raw = b"".join(chunks)
        return raw, len(raw)

    async def _receive(self, request: web.Request, chunks: list[bytes]) -> None:
        """Append the body's chunks to ``chunks`` as they arrive, each held in the budget
        (a slow upload holds what it sent, not what it announced)."""
        s = self.settings
        received = 0
        while chunk := await request.content.readany():
            received += len(chunk)
            if received > s.max_body_bytes:
                self.metrics.trip("body_size")
                raise Refused(self._too_large())
            if self.held_bytes + len(chunk) > s.max_held_bytes:
                response = self._over_budget(received)
                response.force_close()  # the rest of its body is not read
                raise Refused(response)
            self._hold(len(chunk))
            chunks.append(chunk)

    def _over_budget(self, size: int) -> web.Response:
        cap = self.settings.max_held_bytes
        self.metrics.trip("held_bytes")
        return json_error(429, f"the sidecar holds {self.held_bytes} bytes of request bodies; "
                          f"this request's {size} would pass its budget of {cap} bytes "
                          f"(--max-held-bytes)", ERROR_TYPES[429], headers=self.retry_after)

    def _too_large(self) -> web.Response:
        cap = self.settings.max_body_bytes
        response = json_error(413, f"request body is larger than {cap} bytes "
                              f"(--max-body-bytes)", ERROR_TYPES[413])
        response.force_close()
        return response

    def _hold(self, delta: int) -> None:
        self.held_bytes += delta
        self.metrics.load.held_body_bytes = self.held_bytes

    def release(self, nbytes: int) -> None:
        """Give back bytes held by :meth:`read`.

        :param nbytes: the bytes.
        """
        self._hold(-nbytes)
