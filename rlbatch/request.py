"""The unit of work: one inference request as a trace or generator describes it."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX_BLOCK_TOKENS = 512
"""Prompt tokens one ``Request.prefix_ids`` entry names (Mooncake's ``hash_ids`` blocks)."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request as it arrives at the serving system.

    :param request_id: unique within its workload (0..n-1 in arrival order).
    :param arrival_s: arrival time in seconds, re-based so the workload starts at 0.
    :param prompt_tokens: prompt length in tokens (>= 1).
    :param max_output_tokens: tokens to generate (traces: the real output length, >= 1).
    :param prefix_ids: Mooncake-style ids of 512-token prompt blocks (equal id at the same
        position = shared prefix); ``None`` when the source has none.
    :param max_tokens: the output limit the client declared (OpenAI ``max_tokens``), at
        least ``max_output_tokens``; ``None``: it declared none (traces carry only the real
        output length), so vLLM lets it run to the end of the context. What the KV budget's
        ``declared`` count uses and what caps the ``observed`` one
        (:mod:`rlbatch.engine.reserve`); the engine still generates ``max_output_tokens``.
    """

    request_id: int
    arrival_s: float
    prompt_tokens: int
    max_output_tokens: int
    prefix_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"request {self.request_id}: prompt_tokens must be >= 1, "
                             f"got {self.prompt_tokens}")
        if self.max_output_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_output_tokens must be >= 1, "
                             f"got {self.max_output_tokens}")
        if self.max_tokens is not None and self.max_tokens < self.max_output_tokens:
            raise ValueError(f"request {self.request_id}: max_tokens {self.max_tokens} is "
                             f"below the {self.max_output_tokens} tokens it generates")
        if not self.arrival_s >= 0.0:  # also rejects NaN
            raise ValueError(f"request {self.request_id}: arrival_s must be >= 0, "
                             f"got {self.arrival_s}")
