"""Multi-turn conversations whose turns share their history: a workload for prefix caching.

:func:`conversations` starts conversations at Poisson times; each has a few turns, and turn
``t``'s prompt is the system prompt, every earlier user message and answer, and the new user
message, so it begins with turn ``t - 1``'s whole prompt. Requests carry Mooncake-style
``prefix_ids`` (one id per 512-token prompt block, :data:`PREFIX_BLOCK_TOKENS`): block ``i`` of
conversation ``c`` has the same id in every turn (its content is the same history), and block
0, the system prompt, is shared by all conversations. The simulator's prefix cache and the live
engine's prompt tokens (:class:`rlbatch.engine.vllm.prompts.PromptTokens`) both
read these ids, so they agree on what can be shared: a cached block of turn ``t`` is hit by
turn ``t + 1`` at the block granularity of the engine.
"""

from __future__ import annotations

import math

import numpy as np

from rlbatch.request import PREFIX_BLOCK_TOKENS
from rlbatch.workload.base import Workload, build_workload

__all__ = ["SYSTEM_BLOCK_ID", "conversations"]

SYSTEM_BLOCK_ID = 0
"""Id of the system prompt's block, shared by every conversation."""


def conversations(rate_cps: float, duration_s: float, *, max_model_len: int,
                  turns: tuple[int, int] = (3, 5), user_tokens: tuple[int, int] = (40, 240),
                  output_tokens: tuple[int, int] = (20, 120), think_s: float = 1.5,
                  system_tokens: int = PREFIX_BLOCK_TOKENS, seed: int = 0) -> Workload:
    """Conversations starting at Poisson times, each a few turns sharing their history.

    A conversation ends early when its next turn would not fit ``max_model_len``.

    :param rate_cps: conversations started per second.
    :param duration_s: conversations start within ``[0, duration_s)``.
    :param max_model_len: the engine's context (prompt + output of every turn fits it).
    :param turns: number of turns, uniform in ``[lo, hi]``.
    :param user_tokens: tokens of each user message, uniform in ``[lo, hi]``.
    :param output_tokens: tokens of each answer, uniform in ``[lo, hi]``.
    :param think_s: mean time between a turn's arrival and the next (exponential, plus the
        answer's length at 5 ms per token, so a turn rarely arrives before the previous
        answer is done).
    :param system_tokens: tokens of the shared system prompt (``PREFIX_BLOCK_TOKENS``: one
        shared block).
    :param seed: generator seed.
    :raises ValueError: a rate, duration or range that cannot produce requests.
    """
    if not (rate_cps > 0 and duration_s > 0 and math.isfinite(rate_cps * duration_s)):
        raise ValueError(f"rate_cps and duration_s must be > 0, got {rate_cps}, {duration_s}")
    for label, (lo, hi) in (("turns", turns), ("user_tokens", user_tokens),
                            ("output_tokens", output_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{label} must be 1 <= lo <= hi, got {(lo, hi)}")
    if system_tokens + user_tokens[1] + output_tokens[1] > max_model_len:
        raise ValueError(f"a first turn ({system_tokens} + {user_tokens[1]} + "
                         f"{output_tokens[1]} tokens) does not fit max_model_len "
                         f"{max_model_len}")
    rng = np.random.default_rng(seed)
    rows: list[tuple[float, int, int, tuple[int, ...] | None]] = []
    start = float(rng.exponential(1.0 / rate_cps))
    conversation = 0
    while start < duration_s:
        conversation += 1
        chain = [SYSTEM_BLOCK_ID] + [conversation * 10_000 + i
                                     for i in range(1, max_model_len // PREFIX_BLOCK_TOKENS + 2)]
        history = system_tokens
        arrival = start
        for _ in range(int(rng.integers(turns[0], turns[1] + 1))):
            user = int(rng.integers(user_tokens[0], user_tokens[1] + 1))
            output = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
            prompt = history + user
            if prompt + output > max_model_len:
                break
            blocks = -(-prompt // PREFIX_BLOCK_TOKENS)
            rows.append((arrival, prompt, output, tuple(chain[:blocks])))
            history = prompt + output
            arrival += float(rng.exponential(think_s)) + 0.005 * output
        start += float(rng.exponential(1.0 / rate_cps))
    if not rows:
        raise ValueError(f"no conversation started in {duration_s} s at {rate_cps}/s")
    return build_workload(rows, name="conversations",
                          source=f"conversations:rate={rate_cps:g},duration={duration_s:g}",
                          transforms=(f"system prompt {system_tokens} tokens shared",
                                      f"context {max_model_len}"))
