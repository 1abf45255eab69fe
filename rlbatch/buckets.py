"""Prompt-length buckets: the unit the controller sets caps and pools for."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

DEFAULT_EDGES: tuple[int, ...] = (1024, 2048, 4096)


def _fmt_tokens(n: int) -> str:
    return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class Buckets:
    """Prompt-length buckets split at ``edges`` (tokens, strictly increasing).

    Default edges 1024 / 2048 / 4096 give buckets ``0-1k``, ``1k-2k``, ``2k-4k``, ``4k+``.
    A prompt of exactly ``edge`` tokens belongs to the bucket that starts at ``edge``.
    """

    edges: tuple[int, ...] = DEFAULT_EDGES
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.edges:
            raise ValueError("bucket edges must not be empty")
        if any(e <= 0 for e in self.edges) or any(
            b <= a for a, b in zip(self.edges, self.edges[1:], strict=False)
        ):
            raise ValueError(f"bucket edges must be positive and strictly increasing, "
                             f"got {self.edges}")
        lows = (0, *self.edges)
        names = [f"{_fmt_tokens(lo)}-{_fmt_tokens(hi)}" for lo, hi in zip(lows, self.edges,
                                                                          strict=False)]
        names.append(f"{_fmt_tokens(self.edges[-1])}+")
        object.__setattr__(self, "names", tuple(names))

    def __len__(self) -> int:
        return len(self.edges) + 1

    def index(self, prompt_tokens: int) -> int:
        """Bucket index of a prompt of ``prompt_tokens`` tokens."""
        return bisect.bisect_right(self.edges, prompt_tokens)

    @classmethod
    def parse(cls, text: str) -> Buckets:
        """Parse ``"1024,2048,4096"`` into buckets."""
        try:
            edges = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError as exc:
            raise ValueError(
                f"bucket edges must be comma-separated integers, got {text!r}") from exc
        return cls(edges)
