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

What vLLM accepts is accepted: the fields read are coerced as vLLM's pydantic models coerce
them in their (default) lax mode (:func:`lax_int`, :func:`lax_bool`: ``"16"``, ``4.0``,
``stream: 1``), and what they refuse is answered as vLLM answers it (400, type
``Bad Request``, param ``body.FIELD``). ``truncate_prompt_tokens`` (the Responses API's
``truncation: "auto"``) makes the prompt as long as vLLM will keep it. A prompt that is no
valid Unicode text (a lone surrogate, sent as a JSON escape) is refused with vLLM's 400.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from rlbatch.sidecar.tokens import Prompt

Kind = Literal["completions", "chat", "responses"]

#: vLLM's default ``max_tokens`` of ``/v1/completions`` (OpenAI's): 16.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16



INT64_MAX = 2**63 - 1
"""The largest integer pydantic reads from a float (and the bound of vLLM's integer fields)."""

LAX_MESSAGES: dict[str, str] = {
    "int_type": "Input should be a valid integer",
    "int_parsing": "Input should be a valid integer, unable to parse string as an integer",
    "int_from_float": "Input should be a valid integer, got a number with a fractional part",
    "int_parsing_size": "Unable to parse input string as an integer, exceeded maximum size",
    "finite_number": "Input should be a finite number",
    "bool_type": "Input should be a valid boolean",
    "bool_parsing": "Input should be a valid boolean, unable to interpret input",
    "greater_than_equal": "Input should be greater than or equal to {limit}",
    "less_than_equal": "Input should be less than or equal to {limit}",
    "model_type": "Input should be a valid dictionary or instance of StreamOptions"}
"""pydantic's words for the validation errors of the fields the sidecar reads."""

_LAX_INT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BadRequest(ValueError):
    """A request body the sidecar cannot admit; answered 400 with the message.

    :param message: the reason, naming the offending field.
    :param param: the field, when one is to blame.
    :param limit: the sidecar bound it tripped (a ``limit`` label of
        ``rlbatch_limit_trips_total``), if any.
    :param error_type: the error's ``type`` (vLLM's ``Bad Request`` for a field its models
        refuse).
    :param kind: pydantic's name of the validation error, for a field vLLM's models refuse.
    """

    def __init__(self, message: str, param: str | None = None,
                 limit: str | None = None, *, error_type: str = "BadRequestError",
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.limit = limit
        self.error_type = error_type
        self.kind = kind

    @classmethod
    def invalid(cls, kind: str, loc: str, value: object, limit: int = 0) -> BadRequest:
        """vLLM's answer to a field its pydantic models refuse.

        :param kind: pydantic's error type, a key of :data:`LAX_MESSAGES`.
        :param loc: the field's path in the body, e.g. ``stream_options.include_usage``.
        :param value: the value sent.
        :param limit: the bound of a ``greater_than_equal`` / ``less_than_equal``.
        """
        detail = {"type": kind, "loc": f"body.{loc}",
                  "msg": LAX_MESSAGES[kind].format(limit=limit), "input": str(value)}
        return cls(f"1 validation error:\n  {detail}", f"body.{loc}", error_type="Bad Request",
                   kind=kind)


def lax_int(value: object, loc: str, *, optional: bool = True) -> int | None:
    """``value`` as pydantic's lax mode reads an ``int`` field (``int | None`` when
    ``optional``): booleans, integral floats and integer strings (``" 16 "``, ``"1_000"``,
    ``"16.0"``) are integers.

    :param value: the JSON value.
    :param loc: the field's path in the body.
    :param optional: ``None`` is accepted.
    :raises BadRequest: refused as vLLM refuses it.
    """
    if value is None and optional:
        return None
    if isinstance(value, int):  # bool included: True is 1
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadRequest.invalid("finite_number", loc, value)
        if abs(value) > INT64_MAX:
            raise BadRequest.invalid("int_parsing_size", loc, value)
        if not value.is_integer():
            raise BadRequest.invalid("int_from_float", loc, value)
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if not _LAX_INT.fullmatch(text):
            raise BadRequest.invalid("int_parsing", loc, value)
        return int(text.partition(".")[0])
    raise BadRequest.invalid("int_type", loc, value)


def lax_bool(value: object, loc: str, *, optional: bool = True) -> bool | None:
    """``value`` as pydantic's lax mode reads a ``bool`` field (``bool | None`` when
    ``optional``): 0 and 1 (as numbers or strings) and ``"yes"``, ``"on"``, ``"t"``... are
    booleans.

    :param value: the JSON value.
    :param loc: the field's path in the body.
    :param optional: ``None`` is accepted.
    :raises BadRequest: refused as vLLM refuses it.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) <= INT64_MAX:
        value = int(value)
    if isinstance(value, int):
        if value in (0, 1):
            return value == 1
        raise BadRequest.invalid("bool_parsing" if abs(value) <= INT64_MAX else "bool_type",
                                 loc, value)
    if isinstance(value, str):
        word = value.lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise BadRequest.invalid("bool_parsing", loc, value)
    raise BadRequest.invalid("bool_type", loc, value)


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
    :param truncate_prompt_tokens: the client's ``truncate_prompt_tokens`` (-1: as many as
        ``max_model_len`` leaves room for; ``None``: no truncation).
    """

    kind: Kind
    body: dict[str, Any]
    raw: bytes
    prompts: tuple[Prompt, ...]
    stream: bool
    wants_usage: bool
    max_tokens: int | None
    sequences: int = 1
    truncate_prompt_tokens: int | None = None

    def kept_tokens(self, max_model_len: int) -> int | None:
        """The most prompt tokens vLLM keeps under the client's own truncation (``None``:
        it keeps the whole prompt), as vLLM's ``TokenizeParams`` applies it.

        :param max_model_len: the upstreams' context length.
        """
        keep = self.truncate_prompt_tokens
        if keep is None:
            return None
        return max(1, max_model_len - 1 if keep < 0 else keep)

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
            keep = self.truncate_prompt_tokens  # the client's own, when it keeps fewer
            changes["truncate_prompt_tokens"] = (truncate_to if keep is None or keep < 0
                                                 else min(keep, truncate_to))
        if not changes:
            return self.raw
        return json.dumps({**self.body, **changes}, separators=(",", ":")).encode()


def _int_field(body: dict[str, Any], name: str, minimum: int, *,
               optional: bool = True) -> int | None:
    value = lax_int(body.get(name), name, optional=optional or name not in body)
    if value is not None and value < minimum:
        raise BadRequest(f"field {name!r} must be >= {minimum}, got {value}", name)
    return value


def _truncation(body: dict[str, Any], kind: Kind) -> int | None:
    """The client's truncation, as vLLM reads it (``truncate_prompt_tokens``; the Responses
    API's ``truncation: "auto"`` keeps what fits)."""
    if kind == "responses":
        return -1 if body.get("truncation") == "auto" else None
    keep = lax_int(body.get("truncate_prompt_tokens"), "truncate_prompt_tokens")
    if keep is not None and keep < -1:
        raise BadRequest.invalid("greater_than_equal", "truncate_prompt_tokens", keep, -1)
    if keep is not None and keep > INT64_MAX:
        raise BadRequest.invalid("less_than_equal", "truncate_prompt_tokens", keep, INT64_MAX)
    return keep


def _check_text(raw: bytes, prompts: tuple[Prompt, ...]) -> None:
    """Refuse a prompt that is no valid Unicode text (a lone surrogate, which only a JSON
    escape can carry), as vLLM's tokenizer does; the counters could not encode it."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    for prompt in prompts:
        for text in (prompt.text, *(prompt.messages or ())):
            try:
                text.encode()
            except UnicodeEncodeError as exc:
                raise BadRequest(f"the prompt is not valid Unicode text: it holds a lone "
                                 f"surrogate ({text[exc.start]!r}) at character "
                                 f"{exc.start}") from None


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
    if lax_bool(body.get("background"), "background"):
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
    _check_text(raw, prompts)
    stream = bool(lax_bool(body.get("stream"), "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest.invalid("model_type", "stream_options", options)
    # a response's usage always comes with its answer: nothing to ask for or strip
    wants_usage = kind == "responses" or bool(options and lax_bool(
        options.get("include_usage"), "stream_options.include_usage"))
    max_tokens = _int_field(body, "max_output_tokens" if kind == "responses" else
                            "max_tokens", 1)
    if kind == "chat":
        completion = _int_field(body, "max_completion_tokens", 1)
        if completion is not None:
            max_tokens = completion
    # completions' n is an int that may not be null (chat's may)
    n = _int_field(body, "n", 1, optional=kind != "completions") or 1
    best_of = _int_field(body, "best_of", 1) or 1
    for name, value in (("n", n), ("best_of", best_of)):
        if value * len(prompts) > max_sequences:
            per = f" ({len(prompts)} prompts x {name}={value})" if len(prompts) > 1 else ""
            raise BadRequest(f"field {name!r} asks for {value * len(prompts)} sequences{per}; "
                             f"this server allows at most {max_sequences} per request", name,
                             "sequences")
    return ParsedRequest(kind=kind, body=body, raw=raw, prompts=prompts, stream=stream,
                         wants_usage=wants_usage, max_tokens=max_tokens,
                         sequences=max(n, best_of) * len(prompts),
                         truncate_prompt_tokens=_truncation(body, kind))


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
