"""Upstream answers as the sidecar passes them on: a cheap check of a JSON answer, the
edits of a stream (the usage chunk the sidecar asked for taken out again, the fingerprint
moved where vLLM would have put it), and writing to a client that may have gone.
"""

from __future__ import annotations

import json

from aiohttp import web

from rlbatch.sidecar.openai import completion_tokens

RESPONSE_ENDS: tuple[bytes, ...] = (b'"type":"response.completed"',
                                    b'"type":"response.incomplete"',
                                    b'"type":"response.failed"')
"""The events that end a Responses API stream (it sends no ``[DONE]``)."""


class StreamEdits:
    """What the sidecar reads from a stream's events as it passes them on (the generated
    tokens, whether it ended with its end event or an error) and what it changes (the usage
    chunk it asked for, taken out again when the client did not ask for it).

    :param responses: a Responses API stream (its own events; usage always sent).
    :param usage_key: the JSON key of the generated-token count.
    :param wants_usage: the client asked for the usage chunk.
    """

    def __init__(self, responses: bool, usage_key: bytes, wants_usage: bool) -> None:
        self.responses = responses
        self.usage_key = usage_key
        self.stripper = None if wants_usage else UsageStripper()
        self.tokens: int | None = None
        self.events = 0
        self.done = False
        self.errored = False

    def edit(self, complete: bytes) -> bytes:
        """The bytes to send for these whole events.

        :param complete: whole events (ending in a blank line).
        """
        self.events += complete.count(b"data: ")
        if self.responses:
            if self.usage_key in complete:
                found = completion_tokens(complete, self.usage_key)
                self.tokens = found if found is not None else self.tokens
            self.done = self.done or any(end in complete for end in RESPONSE_ENDS)
            self.errored = self.errored or b"event: error" in complete or (
                b'"type":"response.failed"' in complete)
        elif self.stripper is not None:
            complete = self.stripper.feed(complete)
            found = self.stripper.tokens
            self.tokens = found if found is not None else self.tokens
        elif b'"usage"' in complete:
            complete, found = take_usage(complete, False)
            self.tokens = found if found is not None else self.tokens
        if b"data: [DONE]" in complete:
            self.done = True
        if b'data: {"error"' in complete:
            self.errored = True
        return complete

    def flush(self) -> bytes:
        """Events held back when the stream ended (terminal chunks awaiting a usage chunk)."""
        return self.stripper.flush() if self.stripper is not None else b""


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
