"""The answers to over-length requests, in vLLM's words where vLLM would refuse them too.

vLLM 0.32 (``renderers/params.py``, ``entrypoints/serve/utils/api_utils.get_max_tokens``)
refuses a prompt with more characters than ``max_model_len`` tokens can span (before
tokenising it), or with more than ``max_model_len`` tokens (it tokenises a text prompt only up
to ``max_model_len + 1`` tokens: "at least"), and a prompt of exactly ``max_model_len`` tokens
leaves ``max_tokens`` 0; prompt + ``max_tokens`` over ``max_model_len`` only shortens the
output. The sidecar's own ``truncate`` / ``reject`` policies answer in its words, naming the
field to change. :class:`PromptSizer` counts a request's prompt tokens (timed, visible in
``rlbatch_requests_counting`` while it runs) after vLLM's character check, which vLLM skips
for a request that truncates its own prompt (``truncate_prompt_tokens``): such a prompt
counts as the tokens vLLM keeps of it.
"""

from __future__ import annotations

import math
import time

from aiohttp import web
from prometheus_client import Histogram

from rlbatch.request import Request
from rlbatch.sidecar.bodies import ERROR_TYPES, json_error
from rlbatch.sidecar.openai import ParsedRequest
from rlbatch.sidecar.service import Sidecar


def too_many_chars(parsed: ParsedRequest, limit: int, max_chars: int) -> web.Response:
    """vLLM's 400 for a prompt with more than ``max_chars`` characters.

    :param parsed: the request.
    :param limit: ``max_model_len``.
    :param max_chars: ``limit`` times the longest token's characters.
    """
    size = parsed.size_chars
    return json_error(
        400, f"This model's maximum context length is {limit} tokens. However, your prompt "
        f"contains {size} characters (more than {max_chars} characters, which is the upper "
        f"bound for {limit} input tokens). Please reduce the length of the input prompt. "
        f"(parameter=input_text, value={size})", ERROR_TYPES[400], param="input_text")


def too_many_tokens(parsed: ParsedRequest, prompt_tokens: int, limit: int) -> web.Response:
    """vLLM's 400 for a prompt of ``prompt_tokens`` >= ``limit`` tokens.

    :param parsed: the request.
    :param prompt_tokens: the longest prompt's tokens.
    :param limit: ``max_model_len``.
    """
    if prompt_tokens == limit:  # vLLM: no room for output, max_tokens becomes 0
        return json_error(400, "max_tokens must be at least 1, got 0.", ERROR_TYPES[400],
                          param="max_tokens")
    shown = prompt_tokens if all(p.token_ids is not None for p in parsed.prompts) else (
        min(prompt_tokens, limit + 1))
    qualifier = "at least " if shown == limit + 1 else ""
    return json_error(
        400, f"This model's maximum context length is {limit} tokens. However, your prompt "
        f"contains {qualifier}{shown} input tokens, which exceeds this limit even without any "
        f"output tokens. Please reduce the length of the input prompt. "
        f"(parameter=input_tokens, value={shown})", ERROR_TYPES[400], param="input_tokens")


def truncation_too_large(keep: int, limit: int) -> web.Response:
    """vLLM's 400 for a ``truncate_prompt_tokens`` over ``max_model_len``.

    :param keep: the client's ``truncate_prompt_tokens``.
    :param limit: ``max_model_len``.
    """
    return json_error(
        400, f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = {limit}. "
        f"Please request a smaller truncation size. (parameter=truncate_prompt_tokens, "
        f"value={keep})", ERROR_TYPES[400], param="truncate_prompt_tokens")


SPECIAL_TOKENS = 16
"""Tokens a tokenizer may add to a text beyond one per byte (BOS, EOS, prefixes)."""


def over_policy(parsed: ParsedRequest, prompt_tokens: int, max_output_tokens: int,
                limit: int, policy: str) -> web.Response:
    """The 400 of the sidecar's own ``truncate`` / ``reject`` policies.

    :param parsed: the request.
    :param prompt_tokens: its prompt tokens.
    :param max_output_tokens: its output limit.
    :param limit: ``max_model_len``.
    :param policy: ``truncate`` or ``reject``.
    """
    field = "max_completion_tokens" if (
        parsed.kind == "chat" and "max_completion_tokens" in parsed.body) else "max_tokens"
    if policy == "truncate":
        text = (f"{field} ({max_output_tokens}) leaves no room for the prompt within "
                f"max_model_len {limit}")
    else:
        text = (f"prompt ({prompt_tokens} tokens) + {field} ({max_output_tokens}) exceeds "
                f"max_model_len {limit}")
    param = field if prompt_tokens < limit else "input_tokens"
    return json_error(400, f"{text} (over-length policy: {policy})", ERROR_TYPES[400],
                      param=param)


class PromptSizer:
    """Prompt tokens of requests, and the refusals of prompts too long for vLLM.

    :param sidecar: the sidecar (its counter, limits, admission and metrics).
    """

    def __init__(self, sidecar: Sidecar) -> None:
        self.sc = sidecar
        self._timers: dict[str, Histogram] = {}

    def token_bounds(self, parsed: ParsedRequest, limit: int) -> tuple[int, int]:
        """The fewest and the most tokens the request's prompt can count, without counting
        it: a token spans at most ``max_chars_per_token`` characters and at least one byte
        of a text (a chat template adds tokens of its own: no most for chat).

        :param parsed: the request.
        :param limit: ``max_model_len``.
        """
        unbounded = 2 * limit  # past any bucket that matters: over-length
        fewest = most = 1
        for p in parsed.prompts:
            if p.token_ids is not None:
                low = high = p.token_ids
            else:
                low = math.ceil(p.size_chars / self.sc.max_chars_per_token)
                high = (len(p.text.encode()) + SPECIAL_TOKENS if p.messages is None
                        else unbounded)
            fewest, most = max(fewest, low), max(most, high)
        kept = parsed.kept_tokens(limit)
        if kept is not None:
            fewest, most = min(fewest, kept), min(most, kept)
        return max(1, fewest), min(most, unbounded)

    async def count(self, parsed: ParsedRequest, limit: int) -> int | web.Response:
        """Prompt tokens of the longest prompt (at most what the client's own truncation
        keeps), or the 400 of a prompt certainly too long (more characters than ``limit``
        tokens can span: vLLM's own check, done before tokenising; under ``truncate`` such
        a prompt counts as ``limit + 1`` tokens).

        :param parsed: the request.
        :param limit: ``max_model_len``.
        """
        sc = self.sc
        keep = parsed.truncate_prompt_tokens
        if keep is not None and keep > limit:
            return truncation_too_large(keep, limit)
        kept = parsed.kept_tokens(limit)
        max_chars = limit * sc.max_chars_per_token
        if parsed.size_chars > max_chars and kept is not None:
            return kept  # more tokens than the limit: vLLM keeps `kept` of them
        if parsed.size_chars > max_chars:
            if sc.over_length == "truncate":
                return limit + 1
            self.refuse(limit + 1, sc.now())
            return too_many_chars(parsed, limit, max_chars)
        counter = sc.counter
        t0 = time.perf_counter()
        load = sc.metrics.load
        load.requests_counting += 1
        try:
            tokens = max([await counter.count(p) for p in parsed.prompts])
        finally:
            load.requests_counting -= 1
        timer = self._timers.get(counter.name)
        if timer is None:
            timer = self._timers[counter.name] = sc.metrics.tokenize_seconds.labels(
                counter.name)
        timer.observe(time.perf_counter() - t0)
        return tokens if kept is None else min(tokens, kept)

    def refuse(self, prompt_tokens: int, arrival: float) -> None:
        """Count a request refused for its length before admission saw it.

        :param prompt_tokens: its prompt tokens.
        :param arrival: its arrival on the sidecar clock.
        """
        sc = self.sc
        sc.admission.refuse(Request(sc.new_request_id(), arrival, prompt_tokens, 1), "too_long")
        sc.metrics.requests[sc.buckets.index(prompt_tokens), "rejected_too_long"].inc()

    def too_long(self, parsed: ParsedRequest, prompt_tokens: int,
                 arrival: float) -> web.Response:
        """Refuse (and count) a prompt of ``max_model_len`` tokens or more, as vLLM does.

        :param parsed: the request.
        :param prompt_tokens: its longest prompt's tokens.
        :param arrival: its arrival on the sidecar clock.
        """
        self.refuse(prompt_tokens, arrival)
        return too_many_tokens(parsed, prompt_tokens, self.sc.max_model_len)
