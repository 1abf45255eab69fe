"""The OpenAI request bodies the sidecar reads: validation, prompt extraction, forwarding.

Only what admission needs is read (prompt, ``max_tokens``, ``stream``, ``n``); everything
else goes to the upstream untouched, and the original bytes are forwarded unless the sidecar
has to add something (``stream_options.include_usage`` to count streamed tokens,
``truncate_prompt_tokens`` for an over-long prompt under the ``truncate`` policy).

``POST /v1/responses`` (the Responses API) is read the same way: its ``input`` (and
``instructions``) as chat messages, ``max_output_tokens``, ``stream``; its answer's usage is
``output_tokens``. ``background`` responses are refused: their generation outlives the
request, so admission could not count it.

A list of prompts (strings or token-id lists) is one request for vLLM, a batch answered with
one choice per prompt; here too: it is bucketed by its longest prompt and takes one slot of
its bucket's cap, like ``n`` > 1. ``n`` (or ``best_of``) times the number of prompts is bounded
by ``max_sequences``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from rlbatch.sidecar.tokens import Prompt

Kind = Literal["completions", "chat", "responses"]

#: vLLM's default ``max_tokens`` of ``/v1/completions`` (OpenAI's): 16.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16



class BadRequest(ValueError):
    """A request body the sidecar cannot admit; answered 400 with the message.

    :param message: the reason, naming the offending field.
    :param param: the field, when one is to blame.
    :param limit: the sidecar bound it tripped (a ``limit`` label of
        ``rlbatch:limit_trips_total``), if any.
    """

    def __init__(self, message: str, param: str | None = None,
                 limit: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.limit = limit


@dataclass(slots=True)
class ParsedRequest:
    """One validated request.

    :param kind: ``completions`` or ``chat``.
    :param body: the decoded JSON object.
    :param raw: the bytes as received.
    :param prompts: what the prompt counters need, one per prompt of the request.
    :param stream: the client asked for a stream.
    :param wants_usage: the client asked for the final usage chunk of a stream.
    :param max_tokens: the client's output limit (``None``: vLLM's default).
    :param sequences: sequences the request asks for (``n`` times the prompts).
    """

    kind: Kind
    body: dict[str, Any]
    raw: bytes
    prompts: tuple[Prompt, ...]
    stream: bool
    wants_usage: bool
    max_tokens: int | None
    sequences: int = 1

    @property
    def usage_key(self) -> bytes:
        """The JSON key of the generated-token count in this kind's answer."""
        return b'"output_tokens":' if self.kind == "responses" else b'"completion_tokens":'

    @property
    def prompt(self) -> Prompt:
        """The first (usually the only) prompt."""
        return self.prompts[0]

    @property
    def size_chars(self) -> int:
        """Characters of the longest prompt (token-id prompts count none)."""
        return max(p.size_chars for p in self.prompts)

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

    def fitted_output_tokens(self, prompt_tokens: int, max_model_len: int) -> int:
        """Output tokens vLLM will let the request generate: its ``max_tokens`` (or the
        default) shortened so that prompt + output fit ``max_model_len`` (vLLM's
        ``get_max_tokens``).

        :param prompt_tokens: counted prompt length (< ``max_model_len``).
        :param max_model_len: the upstreams' context length.
        """
        return max(1, min(self.max_output_tokens(prompt_tokens, max_model_len),
                          max_model_len - prompt_tokens))

    def forward_body(self, truncate_to: int | None) -> bytes:
        """Bytes to send upstream.

        :param truncate_to: keep only the prompt's last ``truncate_to`` tokens (``None``: keep
            it whole).
        """
        changes: dict[str, Any] = {}
        if self.kind == "responses":  # usage always ends the answer; no truncation field
            return self.raw
        if self.stream and not self.wants_usage:
            options = self.body.get("stream_options")
            options = dict(options) if isinstance(options, dict) else {}
            options["include_usage"] = True
            # vLLM sends per-chunk usage only with include_usage; the client did not ask for
            # it, so turning include_usage on must not turn continuous usage on.
            options.pop("continuous_usage_stats", None)
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


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completion_prompts(body: dict[str, Any]) -> tuple[Prompt, ...]:
    if "prompt" not in body:
        raise BadRequest("field 'prompt' is required", "prompt")
    prompt = body["prompt"]
    model = body.get("model") if isinstance(body.get("model"), str) else None
    if isinstance(prompt, str):
        return (Prompt(text=prompt, model=model),)
    if isinstance(prompt, list) and prompt == []:
        raise BadRequest("field 'prompt' must not be an empty list", "prompt")
    if _is_token_ids(prompt):
        return (Prompt(token_ids=len(prompt), model=model),)
    if isinstance(prompt, list):
        prompts: list[Prompt] = []
        for item in prompt:
            if isinstance(item, str):
                prompts.append(Prompt(text=item, model=model))
            elif _is_token_ids(item):
                prompts.append(Prompt(token_ids=len(item), model=model))
            else:
                raise BadRequest("field 'prompt' must be a string, a list of token ids, or a "
                                 "list of strings or of token-id lists", "prompt")
        return tuple(prompts)
    raise BadRequest("field 'prompt' must be a string, a list of token ids, or a list of "
                     "strings or of token-id lists", "prompt")


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


def _responses_prompt(body: dict[str, Any]) -> Prompt:
    given = body.get("input")
    if given is None:
        raise BadRequest("field 'input' is required", "input")
    items = [given] if isinstance(given, str) else given
    if not isinstance(items, list) or not items:
        raise BadRequest("field 'input' must be a string or a non-empty list", "input")
    messages: list[dict[str, str]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        if isinstance(item, str):
            messages.append({"role": "user", "content": item})
        elif isinstance(item, dict):
            role = item.get("role") if isinstance(item.get("role"), str) else "user"
            content = item.get("content", item.get("output"))
            text = _message_text(content, i) if not isinstance(content, dict) else ""
            messages.append({"role": str(role), "content": text})
        else:
            raise BadRequest(f"input[{i}] must be a string or an object", "input")
    if body.get("background"):
        raise BadRequest("background responses are not served through the sidecar: their "
                         "generation outlives the request, so admission could not count it",
                         "background")
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return Prompt(messages=tuple(m["content"] for m in messages), raw_messages=messages,
                  model=model)


def parse_request(raw: bytes, kind: Kind, max_sequences: int = 16) -> ParsedRequest:
    """Validate a ``/v1/completions``, ``/v1/chat/completions`` or ``/v1/responses`` body.

    :param raw: the body bytes.
    :param kind: which endpoint received it.
    :param max_sequences: most sequences (``n`` or ``best_of``, times the prompts) allowed.
    :raises BadRequest: not JSON, nested too deeply to decode, not an object, a required
        field missing or mistyped, too many sequences.
    """
    if not raw:
        raise BadRequest("empty body: expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    except RecursionError:  # the C decoder recurses once per level
        raise BadRequest("body is nested too deeply to decode", limit="json_depth") from None
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object, got {type(body).__name__}")
    if kind == "completions":
        prompts = _completion_prompts(body)
    else:
        prompts = (_chat_prompt(body) if kind == "chat" else _responses_prompt(body),)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("field 'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("field 'stream_options' must be an object", "stream_options")
    # a response's usage always comes with its answer: nothing to ask for or strip
    wants_usage = kind == "responses" or bool(options and options.get("include_usage"))
    max_tokens = _int_field(body, "max_output_tokens" if kind == "responses" else
                            "max_tokens", 1)
    if kind == "chat":
        completion = _int_field(body, "max_completion_tokens", 1)
        if completion is not None:
            max_tokens = completion
    n = _int_field(body, "n", 1) or 1
    best_of = _int_field(body, "best_of", 1) or 1
    for name, value in (("n", n), ("best_of", best_of)):
        if value * len(prompts) > max_sequences:
            per = f" ({len(prompts)} prompts x {name}={value})" if len(prompts) > 1 else ""
            raise BadRequest(f"field {name!r} asks for {value * len(prompts)} sequences{per}; "
                             f"this server allows at most {max_sequences} per request", name,
                             "sequences")
    return ParsedRequest(kind=kind, body=body, raw=raw, prompts=prompts, stream=stream,
                         wants_usage=wants_usage, max_tokens=max_tokens,
                         sequences=max(n, best_of) * len(prompts))


def completion_tokens(data: bytes, key: bytes = b'"completion_tokens":') -> int | None:
    """``usage.completion_tokens`` of a response body or usage chunk, found without decoding
    the whole JSON (vLLM writes compact JSON with ``usage`` last; a quote inside generated
    text is escaped, so the key cannot be faked by the text).

    :param data: JSON bytes.
    :param key: the count's key (``"output_tokens":`` in a Responses API answer).
    """
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
