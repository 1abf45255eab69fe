"""The Engine protocol: what the deployment (admission, control loop) needs of an engine.

The simulator implements it now; the live vLLM engine implements the same surface, so the
control loop, the env and the evaluation never know which one runs.
"""

from __future__ import annotations

from typing import Protocol

from rlbatch.engine.stats import EngineStats
from rlbatch.request import Request


def kv_tokens_at_limit(request: Request, prompt_tokens: int, max_model_len: int,
                       block_size: int) -> int:
    """KV a request holds if it runs to its declared limit: prompt + ``output_limit`` (cut to
    the context, as vLLM shortens the output to fit), rounded up to whole blocks (a request
    holds ``ceil(tokens / block)`` blocks, so token sums alone undercount).

    :param request: the request.
    :param prompt_tokens: its prompt tokens (after truncation).
    :param max_model_len: the engine's context.
    :param block_size: tokens per KV block.
    """
    tokens = min(prompt_tokens + request.output_limit, max_model_len)
    return -(-tokens // block_size) * block_size


class Engine(Protocol):
    """One serving engine (one vLLM instance) of one pool."""

    engine_id: int
    pool: str

    @property
    def now_s(self) -> float:
        """The engine clock (simulated seconds, or wall seconds on a live engine)."""
        ...

    @property
    def max_num_seqs(self) -> int:
        """The engine-wide cap on running sequences currently in force."""
        ...

    def set_max_num_seqs(self, value: int) -> None:
        """Change the engine-wide cap; running sequences above it finish, none is killed."""
        ...

    def num_unfinished(self, bucket: int) -> int:
        """Requests of ``bucket`` inside the engine (running or waiting)."""
        ...

    def num_unfinished_total(self) -> int:
        """Requests inside the engine (running or waiting)."""
        ...

    def num_waiting(self, bucket: int) -> int:
        """Requests of ``bucket`` inside the engine waiting to be scheduled (admission's
        queue bound counts them for a bucket without a cap)."""
        ...

    def committed_tokens(self) -> int:
        """Prompt + max output tokens of every request inside the engine, each rounded up to
        whole KV blocks (:func:`kv_tokens_at_limit`): the KV it will need if every request runs
        to its limit. Committed KV within the pool means no admitted set can be preempted."""
        ...

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block (the unit a request's KV grows by)."""
        ...

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache pool holds (blocks x block size)."""
        ...

    def add_request(self, request: Request, bucket: int, prompt_tokens: int,
                    truncated: bool) -> None:
        """Hand a request to the engine's own waiting queue (vLLM ``add_request``)."""
        ...

    def is_idle(self) -> bool:
        """Nothing running and nothing waiting."""
        ...

    def advance_idle(self, to_s: float) -> None:
        """Move the clock of an idle engine forward to ``to_s``."""
        ...

    def step(self, bound_s: float) -> None:
        """Run one iteration; may run further iterations while nothing but decoding happens
        and the clock at the start of the next one is below ``bound_s``."""
        ...

    def snapshot(self) -> EngineStats:
        """Stats since the previous snapshot; resets the interval counters."""
        ...
