"""Prompt length: how many tokens a request's prompt has, to pick its bucket.

Three counters, chosen with ``--tokenizer`` (their cost is measured by
``benchmarks/bench_sidecar.py`` and exported as ``rlbatch_tokenize_seconds``):

* ``local``: the model's own ``tokenizer.json`` loaded with ``tokenizers`` in the sidecar
  (exact for completions; chat counts the messages' text plus a small per-message overhead
  instead of rendering the chat template). Long prompts are encoded in a worker thread
  (``tokenizers`` releases the GIL) so the event loop is never blocked for milliseconds.
* ``upstream``: the upstream's ``/tokenize`` (exact, chat template included; one extra
  round trip per request), bounded by a time limit; when it trips or the call fails the
  prompt is counted by ``approx`` instead, logged once per failure run and counted
  (``rlbatch_limit_trips_total{limit="tokenize_timeout"|"tokenize_error"}``). After
  ``breaker_failures`` failures in a row a breaker stops calling it for ``breaker_s`` (each
  request counted by ``approx`` and ``limit="tokenize_breaker"``), then lets one call try it
  again: a hung ``/tokenize`` costs its time limit a few times, not on every request.
* ``approx``: UTF-8 bytes / ``bytes_per_token`` (free, rough).

Token-id prompts (``prompt: [ids]``) are never tokenised: their length is known.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

_LOG = logging.getLogger(__name__)

CHAT_MESSAGE_OVERHEAD = 4
"""Tokens a chat template typically adds per message (role markers, separators)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """The prompt of one request, as the counters need it.

    :param text: the completion prompt (``""`` for chat or token ids).
    :param token_ids: length of a token-id prompt (``None`` otherwise).
    :param messages: chat messages' text parts, one string per message (``None`` for
        completions).
    :param raw_messages: the chat messages as sent (for the upstream's ``/tokenize``).
    :param model: the request's ``model`` field.
    """

    text: str = ""
    token_ids: int | None = None
    messages: tuple[str, ...] | None = None
    raw_messages: list[Any] | None = None
    model: str | None = None

    @property
    def size_chars(self) -> int:
        if self.messages is not None:
            return sum(len(m) for m in self.messages)
        return len(self.text)


class PromptCounter(Protocol):
    """Counts prompt tokens."""

    name: str

    async def count(self, prompt: Prompt) -> int:
        """Tokens in ``prompt`` (>= 1)."""
        ...


class ApproxCounter:
    """UTF-8 bytes / ``bytes_per_token``.

    :param bytes_per_token: divisor (about 4 for English text and Llama-style BPE).
    """

    name = "approx"

    def __init__(self, bytes_per_token: float = 4.0) -> None:
        if not bytes_per_token > 0:
            raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
        self.bytes_per_token = bytes_per_token

    def count_now(self, prompt: Prompt) -> int:
        if prompt.token_ids is not None:
            return max(1, prompt.token_ids)
        if prompt.messages is not None:
            return max(1, sum(math.ceil(len(m.encode()) / self.bytes_per_token)
                              + CHAT_MESSAGE_OVERHEAD for m in prompt.messages))
        return max(1, math.ceil(len(prompt.text.encode()) / self.bytes_per_token))

    async def count(self, prompt: Prompt) -> int:
        return self.count_now(prompt)


class LocalCounter:
    """The model's tokenizer, run in the sidecar.

    :param tokenizer: a ``tokenizers.Tokenizer``.
    :param thread_chars: prompts longer than this are encoded in a worker thread.
    """

    name = "local"

    def __init__(self, tokenizer: Any, thread_chars: int = 2048) -> None:
        self._tok = tokenizer
        self.thread_chars = thread_chars
        vocab = tokenizer.get_vocab()
        #: characters of the vocabulary's longest token (vLLM's ``max_chars_per_token``).
        self.max_chars_per_token = max((len(t) for t in vocab), default=1)

    @classmethod
    def load(cls, path: Path, thread_chars: int = 2048) -> LocalCounter:
        """Load ``tokenizer.json`` (a file, or a model folder holding one). Does file I/O.

        :param path: the file or folder.
        :param thread_chars: see the class.
        :raises ValueError: no tokenizer there, or ``tokenizers`` is not installed.
        """
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no tokenizer.json at {path}")
        try:
            import tokenizers
        except ImportError:  # pragma: no cover - tokenizers comes with vllm / transformers
            raise ValueError("the local tokenizer needs the 'tokenizers' package; install it "
                             "or use --tokenizer upstream|approx") from None
        return cls(tokenizers.Tokenizer.from_file(str(file)), thread_chars)

    def count_now(self, prompt: Prompt) -> int:
        if prompt.token_ids is not None:
            return max(1, prompt.token_ids)
        if prompt.messages is not None:
            encoded = self._tok.encode_batch(list(prompt.messages), add_special_tokens=False)
            return max(1, sum(len(e.ids) + CHAT_MESSAGE_OVERHEAD for e in encoded) + 1)
        return max(1, len(self._tok.encode(prompt.text, add_special_tokens=True).ids))

    async def count(self, prompt: Prompt) -> int:
        if prompt.token_ids is None and prompt.size_chars > self.thread_chars:
            return await asyncio.to_thread(self.count_now, prompt)
        return self.count_now(prompt)


PostJson = Callable[[str, bytes], Awaitable[tuple[int, bytes]]]
"""``(path, body) -> (status, the body's first ANSWER_HEAD_BYTES)``: a POST to some reachable
upstream."""

ANSWER_HEAD_BYTES = 4096
"""Bytes of a ``/tokenize`` answer read: vLLM writes ``count`` first, then every token id
(megabytes for a long prompt, which the count does not need)."""

_COUNT = re.compile(rb'"count"\s*:\s*(\d+)')


class UpstreamCounter:
    """The upstream's ``/tokenize`` (vLLM applies the chat template for messages). When the
    call takes longer than ``timeout_s`` or fails, the count falls back to
    :class:`ApproxCounter`: logged once per failure run, and every fallback reported to
    ``on_fallback`` (``tokenize_timeout``, ``tokenize_error``, or ``tokenize_breaker`` while
    the breaker keeps it from being called).

    :param post: sends a POST to a reachable upstream.
    :param fallback: the counter used when the upstream cannot answer.
    :param timeout_s: time limit of one call.
    :param on_fallback: told the reason of each fallback.
    :param breaker_failures: failures in a row that open the breaker.
    :param breaker_s: how long the open breaker skips the call before one call tries it.
    :param clock: seconds, monotonic.
    """

    name = "upstream"

    def __init__(self, post: PostJson, fallback: ApproxCounter, timeout_s: float = 5.0,
                 on_fallback: Callable[[str], None] | None = None, *,
                 breaker_failures: int = 3, breaker_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._post = post
        self._fallback = fallback
        self.timeout_s = timeout_s
        self._on_fallback = on_fallback or (lambda reason: None)
        self.breaker_failures = breaker_failures
        self.breaker_s = breaker_s
        self._clock = clock
        self._open_until: float | None = None
        self._trying = False
        self.failures = 0
        """Calls failed in a row."""

    async def count(self, prompt: Prompt) -> int:
        if prompt.token_ids is not None:
            return max(1, prompt.token_ids)
        if self._open_until is not None and (self._trying
                                             or self._clock() < self._open_until):
            self._on_fallback("tokenize_breaker")  # open, or one call is trying it
            return self._fallback.count_now(prompt)
        self._trying = self._open_until is not None
        try:
            count = await self._call(prompt)
        except Exception as exc:  # any failure: the approximate count still buckets it
            self._failed(exc)
            return self._fallback.count_now(prompt)
        finally:
            self._trying = False
        if self.failures:
            _LOG.info("upstream /tokenize answers again; counting prompt tokens with it")
        self.failures = 0
        self._open_until = None
        return max(1, count)

    async def _call(self, prompt: Prompt) -> int:
        body: dict[str, Any] = {}
        if prompt.model is not None:
            body["model"] = prompt.model
        if prompt.raw_messages is not None:
            body["messages"] = prompt.raw_messages
        else:
            body["prompt"] = prompt.text
        async with asyncio.timeout(self.timeout_s):
            status, head = await self._post("/tokenize", json.dumps(body).encode())
        found = _COUNT.search(head) if status == 200 else None
        if found is None:
            raise ValueError(f"/tokenize answered {status}: {head[:200]!r}")
        return int(found.group(1))

    def _failed(self, exc: Exception) -> None:
        timed_out = isinstance(exc, TimeoutError)
        self.failures += 1
        self._on_fallback("tokenize_timeout" if timed_out else "tokenize_error")
        reason = (f"no answer within {self.timeout_s:g} s" if timed_out
                  else str(exc) or type(exc).__name__)
        if self.failures == 1:
            _LOG.warning("upstream /tokenize failed (%s); counting prompt tokens "
                         "approximately until it answers again", reason)
        if self.failures >= self.breaker_failures:
            if self._open_until is None:
                _LOG.warning("upstream /tokenize failed %d times in a row; not calling it "
                             "for %g s at a time until it answers", self.failures,
                             self.breaker_s)
            self._open_until = self._clock() + self.breaker_s
