"""The OpenAI request bodies the sidecar reads: validation, prompt extraction, forwarding.

Only what admission needs is read (prompt, ``max_tokens``, ``stream``); everything else goes
to the upstream untouched, and the original bytes are forwarded unless the sidecar has to add
something (``stream_options.include_usage`` to count streamed tokens, ``truncate_prompt_tokens``
for an over-long prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from rlbatch.sidecar.tokens import Prompt

Kind = Literal["completions", "chat"]

#: vLLM's default ``max_tokens`` of ``/v1/completions`` (OpenAI's): 16.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class BadRequest(ValueError):
    """A request body the sidecar cannot admit; answered 400 with the message.

    :param message: the reason, naming the offending field.
    :param param: the field, when one is to blame.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(slots=True)
class ParsedRequest:
    """One validated request.

    :param kind: ``completions`` or ``chat``.
    :param body: the decoded JSON object.
    :param raw: the bytes as received.
    :param prompt: what the prompt counters need.
    :param stream: the client asked for a stream.
    :param wants_usage: the client asked for the final usage chunk of a stream.
    :param max_tokens: the client's output limit (``None``: vLLM's default).
    """

    kind: Kind
    body: dict[str, Any]
    raw: bytes
    prompt: Prompt
    stream: bool
    wants_usage: bool
    max_tokens: int | None

    def max_output_tokens(self, prompt_tokens: int, max_model_len: int) -> int:
        """Output tokens the request may generate, as vLLM will apply it.

        :param prompt_tokens: counted prompt length.
        :param max_model_len: the upstreams' context length.
        """
        if self.max_tokens is not None:
            return self.max_tokens
        if self.kind == "completions":
            return COMPLETIONS_DEFAULT_MAX_TOKENS
        return max(1, max_model_len - prompt_tokens)

    def forward_body(self, truncate_to: int | None) -> bytes:
        """Bytes to send upstream.

        :param truncate_to: keep only the prompt's last ``truncate_to`` tokens (``None``: keep
            it whole).
        """
        changes: dict[str, Any] = {}
        if self.stream and not self.wants_usage:
            options = self.body.get("stream_options")
            options = dict(options) if isinstance(options, dict) else {}
            options["include_usage"] = True
            changes["stream_options"] = options
        if truncate_to is not None:
            changes["truncate_prompt_tokens"] = truncate_to
        if not changes:
            return self.raw
        return json.dumps({**self.body, **changes}, separators=(",", ":")).encode()


def _int_field(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"field {name!r} must be an integer, got {type(value).__name__}", name)
    if value < minimum:
        raise BadRequest(f"field {name!r} must be >= {minimum}, got {value}", name)
    return value


def _completion_prompt(body: dict[str, Any]) -> Prompt:
    if "prompt" not in body:
        raise BadRequest("field 'prompt' is required", "prompt")
    prompt = body["prompt"]
    model = body.get("model") if isinstance(body.get("model"), str) else None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return Prompt(text=prompt, model=model)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in prompt):
        if not prompt:
            raise BadRequest("field 'prompt' must not be an empty token list", "prompt")
        return Prompt(token_ids=len(prompt), model=model)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest(f"field 'prompt' holds {len(prompt)} prompts; the sidecar admits one "
                         f"prompt per request (send them as separate requests)", "prompt")
    raise BadRequest("field 'prompt' must be a string or a list of token ids", "prompt")


def _message_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict):
                raise BadRequest(f"messages[{index}].content parts must be objects",
                                 "messages")
            text = part.get("text")
            if isinstance(text, str):
                parts.append(text)
        return "".join(parts)
    raise BadRequest(f"messages[{index}].content must be a string, a list of parts or null",
                     "messages")


def _chat_prompt(body: dict[str, Any]) -> Prompt:
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("field 'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("field 'messages' must be a non-empty list", "messages")
    texts: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'",
                             "messages")
        texts.append(_message_text(message.get("content"), i))
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return Prompt(messages=tuple(texts), raw_messages=messages, model=model)


def parse_request(raw: bytes, kind: Kind) -> ParsedRequest:
    """Validate a ``/v1/completions`` or ``/v1/chat/completions`` body.

    :param raw: the body bytes.
    :param kind: which endpoint received it.
    :raises BadRequest: not JSON, not an object, a required field missing or mistyped.
    """
    if not raw:
        raise BadRequest("empty body: expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object, got {type(body).__name__}")
    prompt = _completion_prompt(body) if kind == "completions" else _chat_prompt(body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("field 'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("field 'stream_options' must be an object", "stream_options")
    wants_usage = bool(options and options.get("include_usage"))
    max_tokens = _int_field(body, "max_tokens", 1)
    if kind == "chat":
        completion = _int_field(body, "max_completion_tokens", 1)
        if completion is not None:
            max_tokens = completion
    _int_field(body, "n", 1)
    return ParsedRequest(kind=kind, body=body, raw=raw, prompt=prompt, stream=stream,
                         wants_usage=wants_usage, max_tokens=max_tokens)


def completion_tokens(data: bytes) -> int | None:
    """``usage.completion_tokens`` of a response body or usage chunk, found without decoding
    the whole JSON (vLLM writes compact JSON with ``usage`` last; a quote inside generated
    text is escaped, so the key cannot be faked by the text).

    :param data: JSON bytes.
    """
    key = b'"completion_tokens":'
    at = data.rfind(key)
    if at < 0:
        return None
    start = at + len(key)
    while start < len(data) and data[start] == 0x20:
        start += 1
    end = start
    while end < len(data) and 0x30 <= data[end] <= 0x39:
        end += 1
    return int(data[start:end]) if end > start else None


def error_body(message: str, kind: str, code: int, param: str | None = None) -> bytes:
    """An OpenAI-style error object (vLLM's shape).

    :param message: the reason.
    :param kind: error type, e.g. ``invalid_request_error``.
    :param code: HTTP status.
    :param param: offending field.
    """
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}).encode()
