"""Request bodies within bounds: size, the bytes all requests hold together, and time.

A body larger than ``max_body_bytes`` is answered 413. Every request inside the sidecar holds
its body until it is answered; together they share ``max_held_bytes``, reserved from the
``Content-Length`` before the body is read, so a request that would pass the budget is answered
429 with ``Retry-After`` without reading anything. A body that does not arrive within
``body_timeout_s`` is answered 408. Each trip is counted (``rlbatch:limit_trips_total``).
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
        """Read a request body within the body-size, held-bytes and body-time limits.

        :param request: the client's request.
        :returns: the body and the bytes reserved for it (give them back with
            :meth:`release`).
        :raises Refused: a limit tripped (413, 429 or 408; counted).
        """
        s = self.settings
        metrics = self.metrics
        length = request.content_length
        if length is not None and length > s.max_body_bytes:
            metrics.trip("body_size")
            raise Refused(self._too_large())
        reserve = length if length is not None else s.max_body_bytes
        if self.held_bytes + reserve > s.max_held_bytes:
            metrics.trip("held_bytes")
            raise Refused(json_error(
                429, f"the sidecar holds {self.held_bytes} bytes of waiting requests; this "
                f"request's {reserve} would pass its budget of {s.max_held_bytes} bytes "
                f"(--max-held-bytes)", ERROR_TYPES[429], headers=self.retry_after))
        self._hold(reserve)
        try:
            if request.content.is_eof():  # all there already (a small body): no timer
                raw = await request.read()
            else:
                async with asyncio.timeout(s.body_timeout_s):
                    raw = await request.read()
        except TimeoutError:
            self.release(reserve)
            metrics.trip("body_timeout")
            response = json_error(408, f"request body not received within "
                                  f"{s.body_timeout_s:g} s", ERROR_TYPES[408])
            response.force_close()
            raise Refused(response) from None
        except web.HTTPRequestEntityTooLarge:
            self.release(reserve)
            metrics.trip("body_size")
            raise Refused(self._too_large()) from None
        except BaseException:
            self.release(reserve)
            raise
        self._hold(len(raw) - reserve)
        return raw, len(raw)

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
        """Give back bytes reserved by :meth:`read`.

        :param nbytes: the bytes.
        """
        self._hold(-nbytes)
