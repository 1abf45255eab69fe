"""The token ids a live engine serves for a request: prompts of a given length, and prompts
whose Mooncake-style ``prefix_ids`` say which blocks they share.

A trace gives prompt lengths, not text, so :class:`PromptTokens` cuts every prompt from one
pool of vocabulary ids (no special tokens). Without ``prefix_ids`` a prompt is a slice at an
offset by request id; with them, block ``i`` of the original prompt
(:data:`~rlbatch.request.PREFIX_BLOCK_TOKENS` tokens) is a draw seeded by its id alone, so two
requests whose ids agree up to a block share its tokens, and vLLM's chained block hashes match
exactly where the ids say (what the simulator's prefix cache assumes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlbatch.request import PREFIX_BLOCK_TOKENS, Request

__all__ = ["PromptTokens"]

_BLOCK_CACHE = 4096
"""Prompt blocks whose tokens are kept (then the cache starts over)."""


class PromptTokens:
    """Deterministic prompt token ids for one engine.

    :param pool: vocabulary ids prompts are cut from (length >= 2 * ``max_model_len``).
    :param max_model_len: the engine's context.
    :param seed: seeds the prompt blocks of ``prefix_ids``.
    """

    def __init__(self, pool: Sequence[int], max_model_len: int, seed: int) -> None:
        if len(pool) < 2 * max_model_len:
            raise ValueError(f"prompt_pool holds {len(pool)} ids, fewer than 2 x "
                             f"max_model_len ({max_model_len})")
        self._pool = np.asarray(pool, dtype=np.int64)
        self._max_model_len = max_model_len
        self._seed = seed
        self._blocks: dict[int, list[int]] = {}

    def by_id(self, request_id: int, prompt_tokens: int) -> list[int]:
        """``prompt_tokens`` ids at an offset by ``request_id``.

        :param request_id: the workload's request id.
        :param prompt_tokens: prompt length (<= ``max_model_len``).
        """
        offset = (request_id * 7919) % self._max_model_len
        ids: list[int] = self._pool[offset:offset + prompt_tokens].tolist()
        return ids

    def for_request(self, request: Request, prompt_tokens: int) -> list[int]:
        """The ``prompt_tokens`` ids served for ``request``: :meth:`by_id` without
        ``prefix_ids``; with them, each described block's tokens from its id and the request's
        own tokens past them. A truncated prompt keeps the original's last ``prompt_tokens``.

        :param request: the request.
        :param prompt_tokens: tokens served (``<= request.prompt_tokens``).
        """
        ids = request.prefix_ids
        if not ids:
            return self.by_id(request.request_id, prompt_tokens)
        start = request.prompt_tokens - prompt_tokens
        out: list[int] = []
        pos = start
        for i in range(start // PREFIX_BLOCK_TOKENS, len(ids)):
            end = min(request.prompt_tokens, (i + 1) * PREFIX_BLOCK_TOKENS)
            if pos >= end:
                break
            base = i * PREFIX_BLOCK_TOKENS
            out.extend(self.block(ids[i])[pos - base:end - base])
            pos = end
        if pos < request.prompt_tokens:
            out.extend(self.by_id(request.request_id, request.prompt_tokens - pos))
        return out

    def block(self, block_id: int) -> list[int]:
        """The :data:`~rlbatch.request.PREFIX_BLOCK_TOKENS` token ids of prompt block
        ``block_id`` (a draw from the pool seeded by the engine seed and the id).

        :param block_id: a ``prefix_ids`` entry.
        """
        tokens = self._blocks.get(block_id)
        if tokens is None:
            rng = np.random.default_rng([self._seed, abs(int(block_id)), int(block_id < 0)])
            picks = rng.integers(0, len(self._pool), PREFIX_BLOCK_TOKENS)
            tokens = self._pool[picks].tolist()
            if len(self._blocks) >= _BLOCK_CACHE:
                self._blocks.clear()
            self._blocks[block_id] = tokens
        return tokens
