"""Request length distributions for generated workloads, and the named presets.

A :class:`LengthDist` draws ``(prompt_tokens, output_tokens)`` pairs from a caller-supplied
``numpy.random.Generator``; it holds no RNG of its own. Bounds are enforced by resampling
(a truncated distribution, no point masses at the bounds).

Presets follow the tuning guide's case study (a financial customer-service system): by day
uniform short chats, at night short chats mixed with long reports. Every preset keeps
``prompt + output <= 4096`` so nothing is rejected by a 4k-context model (llama-2-7b).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]

#: Context window of the default model (llama-2-7b); presets keep prompt + output within it.
DEFAULT_CONTEXT_TOKENS = 4096
_MAX_ROUNDS = 200


@runtime_checkable
class LengthDist(Protocol):
    """Draws request lengths; all randomness comes from the ``rng`` argument."""

    def sample(self, rng: np.random.Generator, n: int) -> tuple[IntArray, IntArray]:
        """Draw ``n`` requests.

        :param rng: the caller's generator.
        :param n: number of requests (>= 0).
        :returns: ``(prompt_tokens, output_tokens)``, two int64 arrays of length ``n``, >= 1.
        """
        ...

    def describe(self) -> str:
        """A short label for workload sources and reports."""
        ...


@dataclass(frozen=True)
class LogNormalLengths:
    """Independent log-normal prompt and output lengths, rounded and truncated to bounds.

    :param prompt_median: median prompt length in tokens (``exp(mu)``).
    :param prompt_sigma: standard deviation of ``log(prompt)`` (0 = always the median).
    :param output_median: median output length in tokens.
    :param output_sigma: standard deviation of ``log(output)``.
    :param prompt_max: largest prompt kept (larger draws are redrawn).
    :param output_max: largest output kept.
    :param prompt_min: smallest prompt kept (>= 1).
    :param output_min: smallest output kept (>= 1).
    :param total_max: if set, pairs with ``prompt + output > total_max`` are redrawn.
    :param name: label returned by :meth:`describe` (default: the parameters).
    """

    prompt_median: float
    prompt_sigma: float
    output_median: float
    output_sigma: float
    prompt_max: int
    output_max: int
    prompt_min: int = 1
    output_min: int = 1
    total_max: int | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        for label, lo, median, hi in (
                ("prompt", self.prompt_min, self.prompt_median, self.prompt_max),
                ("output", self.output_min, self.output_median, self.output_max)):
            if not 1 <= lo <= median <= hi:
                raise ValueError(f"{label} bounds must satisfy 1 <= {label}_min <= "
                                 f"{label}_median <= {label}_max, got {lo}, {median}, {hi}")
        for label, sigma in (("prompt_sigma", self.prompt_sigma),
                             ("output_sigma", self.output_sigma)):
            if not (math.isfinite(sigma) and sigma >= 0.0):
                raise ValueError(f"{label} must be a finite number >= 0, got {sigma}")
        if self.total_max is not None and self.total_max < self.prompt_min + self.output_min:
            raise ValueError(f"total_max ({self.total_max}) must be >= prompt_min + output_min "
                             f"({self.prompt_min + self.output_min})")

    def sample(self, rng: np.random.Generator, n: int) -> tuple[IntArray, IntArray]:
        """Draw ``n`` requests by rejection until all lie within the bounds.

        :param rng: the caller's generator.
        :param n: number of requests (>= 0).
        :raises ValueError: if the bounds reject nearly every draw.
        """
        _check_count(n)
        prompts = np.empty(0, dtype=np.int64)
        outputs = np.empty(0, dtype=np.int64)
        for _ in range(_MAX_ROUNDS):
            missing = n - prompts.size
            if missing <= 0:
                return prompts[:n], outputs[:n]
            draw = 2 * missing + 16
            p = np.rint(rng.lognormal(math.log(self.prompt_median), self.prompt_sigma, draw))
            o = np.rint(rng.lognormal(math.log(self.output_median), self.output_sigma, draw))
            ok = ((p >= self.prompt_min) & (p <= self.prompt_max)
                  & (o >= self.output_min) & (o <= self.output_max))
            if self.total_max is not None:
                ok &= p + o <= self.total_max
            prompts = np.concatenate([prompts, p[ok].astype(np.int64)])
            outputs = np.concatenate([outputs, o[ok].astype(np.int64)])
        if prompts.size >= n:
            return prompts[:n], outputs[:n]
        raise ValueError(f"{self.describe()}: bounds accept too few draws to sample {n} requests")

    def describe(self) -> str:
        """The preset name, or the parameters."""
        if self.name is not None:
            return self.name
        total = f", total<={self.total_max}" if self.total_max is not None else ""
        return (f"lognormal(prompt {self.prompt_median:g}x{self.prompt_sigma:g} in "
                f"[{self.prompt_min},{self.prompt_max}], output {self.output_median:g}x"
                f"{self.output_sigma:g} in [{self.output_min},{self.output_max}]{total})")


@dataclass(frozen=True, init=False)
class LengthMixture:
    """Each request's lengths come from one component, picked with probability ~ weight.

    :param components: ``(weight, distribution)`` pairs; weights > 0 (normalised here).
    :param name: label returned by :meth:`describe` (default: the components).
    """

    components: tuple[tuple[float, LengthDist], ...]
    name: str | None

    def __init__(self, components: Sequence[tuple[float, LengthDist]],
                 name: str | None = None) -> None:
        if not components:
            raise ValueError("LengthMixture needs at least one (weight, distribution) component")
        for weight, _ in components:
            if not (math.isfinite(weight) and weight > 0.0):
                raise ValueError(f"mixture weights must be finite and > 0, got {weight}")
        object.__setattr__(self, "components", tuple(components))
        object.__setattr__(self, "name", name)

    @property
    def weights(self) -> tuple[float, ...]:
        """Normalised component probabilities."""
        total = sum(weight for weight, _ in self.components)
        return tuple(weight / total for weight, _ in self.components)

    def sample(self, rng: np.random.Generator, n: int) -> tuple[IntArray, IntArray]:
        """Assign each request a component, then draw each component's share.

        :param rng: the caller's generator.
        :param n: number of requests (>= 0).
        """
        _check_count(n)
        which = rng.choice(len(self.components), size=n, p=np.asarray(self.weights))
        prompts = np.empty(n, dtype=np.int64)
        outputs = np.empty(n, dtype=np.int64)
        for index, (_, dist) in enumerate(self.components):
            members = np.flatnonzero(which == index)
            prompts[members], outputs[members] = dist.sample(rng, int(members.size))
        return prompts, outputs

    def describe(self) -> str:
        """The preset name, or the weighted components."""
        if self.name is not None:
            return self.name
        parts = (f"{w:.2f}*{dist.describe()}"
                 for w, (_, dist) in zip(self.weights, self.components, strict=True))
        return "mix(" + " + ".join(parts) + ")"


def _check_count(n: int) -> None:
    if isinstance(n, bool) or n < 0:
        raise ValueError(f"number of requests must be an integer >= 0, got {n}")


def short_chats() -> LogNormalLengths:
    """Short customer-service questions: prompts 200-800 tokens, outputs 100-300."""
    return LogNormalLengths(prompt_median=400, prompt_sigma=0.35, output_median=180,
                            output_sigma=0.3, prompt_min=200, prompt_max=800, output_min=100,
                            output_max=300, name="short_chats")


def long_reports() -> LogNormalLengths:
    """Long reports: prompts 2500-3500 tokens, outputs 500-1000, prompt + output <= 4096."""
    return LogNormalLengths(prompt_median=3000, prompt_sigma=0.1, output_median=700,
                            output_sigma=0.25, prompt_min=2500, prompt_max=3500, output_min=500,
                            output_max=1000, total_max=DEFAULT_CONTEXT_TOKENS,
                            name="long_reports")


def day_mix() -> LogNormalLengths:
    """The case study's daytime traffic: uniformly short chats (all in the 0-1k bucket)."""
    return replace(short_chats(), name="day_mix")


def night_mix(long_fraction: float = 0.25) -> LengthMixture:
    """The case study's night traffic: short chats mixed with long reports (0-1k and 2k-4k).

    :param long_fraction: share of long reports, in (0, 1).
    """
    if not 0.0 < long_fraction < 1.0:
        raise ValueError(f"long_fraction must be in (0, 1), got {long_fraction}")
    return LengthMixture([(1.0 - long_fraction, short_chats()), (long_fraction, long_reports())],
                         name="night_mix" if long_fraction == 0.25
                         else f"night_mix(long={long_fraction:g})")


def azure_like_mix() -> LogNormalLengths:
    """Log-normal fit to the Azure 2023 conversation trace, truncated to a 4k context.

    The trace's prompts have median ~1000 tokens and log-sd ~1.0, its outputs median ~130
    and log-sd ~0.86; ~8% of its requests exceed 4096 tokens in total, which this preset
    redraws so nothing is rejected by llama-2-7b.
    """
    return LogNormalLengths(prompt_median=1000, prompt_sigma=0.95, output_median=140,
                            output_sigma=0.85, prompt_min=16, prompt_max=3840, output_min=4,
                            output_max=1024, total_max=DEFAULT_CONTEXT_TOKENS, name="azure_like")


def code_completion_mix() -> LogNormalLengths:
    """Code completion: prompts of 1-3k tokens, outputs of tens of tokens.

    A log-normal fit to the published statistics of the Azure 2023 code trace (Splitwise,
    ISCA 2024): prompt median 1,500 tokens (mean 2,048, p99 ~7,436), output median 13 (mean
    28, p99 ~249). The log-sd follows from the median and mean (0.79 for prompts, 1.24 for
    outputs; docs/notebook/traffic-families-research.md). Prompts over a 4k context are redrawn
    so that nothing is rejected by llama-2-7b, as :func:`azure_like_mix` does.
    """
    return LogNormalLengths(prompt_median=1500, prompt_sigma=0.79, output_median=13,
                            output_sigma=1.24, prompt_min=16, prompt_max=3840, output_min=1,
                            output_max=1024, total_max=DEFAULT_CONTEXT_TOKENS, name="code")
