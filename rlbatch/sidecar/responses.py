"""Upstream answers as the sidecar passes them on: a cheap check of a JSON answer, the
edits of a stream (the usage chunk the sidecar asked for taken out again, the fingerprint
moved where vLLM would have put it), and writing to a client that may have gone.
"""

from __future__ import annotations

import json

from aiohttp import web

from rlbatch.sidecar.openai import completion_tokens


def looks_like_json_object(data: bytes) -> bool:
    """A cheap check that a 200 answer is a JSON object (vLLM's always is): it starts with
    ``{`` and ends with ``}``, which an HTML error page, plain text or a truncated body does
    not. Not a full parse: that would cost every request a decode of its answer."""
    body = data.strip()
    return body[:1] == b"{" and body[-1:] == b"}"


class UsageStripper:
    """Takes the usage chunk the sidecar asked for (to count a stream's tokens) out of a
    stream whose client did not ask for it, so the client sees what vLLM would have sent it:
    vLLM puts ``system_fingerprint`` on the usage chunk when there is one, else on each
    choice's terminal chunk (the one with a ``finish_reason``). Terminal chunks are therefore
    held until the usage chunk (vLLM sends it right after them), stamped with its fingerprint
    and sent; other chunks pass at once.
    """

    def __init__(self) -> None:
        self.tokens: int | None = None
        self._held: list[bytes] = []

    def feed(self, complete: bytes) -> bytes:
        """Bytes to send for these complete events (ending in a blank line).

        :param complete: whole events.
        """
        if not self._held and b'"usage"' not in complete and (
                b'"finish_reason":"' not in complete):
            return complete  # the common chunk: nothing to do
        out: list[bytes] = []
        for event in complete.split(b"\n\n"):
            if not event:
                continue
            if b'"usage"' in event and b'"choices":[]' in event:
                self.tokens = completion_tokens(event)
                stamp = _fingerprint(event)
                out.extend(_stamped(e, stamp) for e in self._held)
                self._held.clear()
                continue
            if b'"finish_reason":"' in event and event.startswith(b"data: {"):
                self._held.append(event)
                continue
            if self._held and (event == b"data: [DONE]" or event.startswith(b'data: {"error"')):
                out.extend(self._held)
                self._held.clear()
            out.append(event)
        return b"".join(e + b"\n\n" for e in out)

    def flush(self) -> bytes:
        """Terminal chunks still held when the stream ended without a usage chunk."""
        held, self._held = self._held, []
        return b"".join(e + b"\n\n" for e in held)


def _fingerprint(event: bytes) -> bytes | None:
    """The JSON-encoded ``system_fingerprint`` of an event, if it has one."""
    try:
        value = json.loads(event[len(b"data: "):]).get("system_fingerprint")
    except (ValueError, AttributeError):
        return None
    return json.dumps(value).encode() if isinstance(value, str) else None


def _stamped(event: bytes, stamp: bytes | None) -> bytes:
    if stamp is None or b'"system_fingerprint"' in event or not event.endswith(b"}"):
        return event
    return event[:-1] + b',"system_fingerprint":' + stamp + b"}"


def take_usage(complete: bytes, strip: bool) -> tuple[bytes, int | None]:
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


async def send(out: web.StreamResponse, data: bytes | None,
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
