"""The guard's ``proportional`` P99 fallback: trim where a TPOT breach comes from.

A cap cannot remove prefill work, only postpone it: trimming a bucket trades its own requests'
TTFT for everyone else's TPOT. That is worth it for the buckets whose prompts are long against
the traffic (nominal length >= ``long_ratio`` x the arrival-weighted mean: few requests, most
of the prefill that slows every decode) while they surge (recent arrival rate over
``surge_ratio`` x their usual rate: a flood postponed is served once it ebbs, whereas a steady
share of long prompts held back only queues until its requests miss), which are trimmed to
their occupancy x SLA / P99 (at least one less, floor 1). With no long bucket (surging or
not), when the mean iteration time exceeds the TPOT limit while decodes dominate the computed
tokens, the batch is too big for everyone (the mean over iterations, which is what a decoding
request waits per token: a few long prefill chunks among many short decode steps raise the
tail, not the mean, and no total removes them; averaging per tick instead let one 0.6-0.9 s
chunk in a second of 13 ms decodes count as a slow batch and cut the total to 1-4 on
long-prompt traffic, docs/notebook/BENCHMARKS-archive.md): the total (without a total, every
occupied bucket) is trimmed to the running count x SLA / iteration time. Otherwise the tail
comes from the prefills of the traffic's own bulk, which no cap removes without queueing that
bulk, and nothing is trimmed. Decreases are at most one per ``cooldown_s``. Back within SLA for
``hold_s``, each limit grows by ``recover_step`` once per ``cooldown_s`` (no cliff) and is
dropped once it no longer binds (the proposal is reached, or nothing of its bucket is held
back). :class:`rlbatch.control.guard.Guard` owns one per run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rlbatch.control.types import DeploymentInfo, DeploymentStats

EMA = 0.01  # per tick (~100 ticks): the traffic's length mix, iteration time, prefill share
SURGE_FAST = 1 / 30  # per tick: a bucket's recent arrival rate
SURGE_SLOW = 1 / 600  # per tick: its usual arrival rate
Limits = tuple[tuple[int | None, ...] | None, int | None]


def trim(base: float, factor: float) -> int:
    """``base`` x ``factor``, at least one less than ``base``, at least 1."""
    base = max(1, int(base))
    return max(1, min(base - 1, int(base * factor)))


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def nominal_lengths(info: DeploymentInfo) -> tuple[float, ...]:
    """Nominal prompt length per bucket: the middle of its range, 1.5x the lower edge for the
    open last bucket, never past what the engine accepts."""
    edges = info.buckets.edges
    lows, highs = (0, *edges), (*edges, int(edges[-1] * 2))
    return tuple(float(min((lo + hi) / 2, info.max_model_len))
                 for lo, hi in zip(lows, highs, strict=True))


class ProportionalTrim:
    """State and decisions of the ``proportional`` fallback for one run.

    :param lengths: nominal prompt length per bucket (:func:`nominal_lengths`).
    :param sla_tpot_s: the TPOT limit.
    :param long_ratio: a bucket's nominal prompt length over the traffic's mean from which
        the bucket is held responsible for a TPOT breach.
    :param recover_step: growth of each limit per ``cooldown_s`` once back within SLA.
    :param hold_s: how long the P99 must be within SLA before the limits grow.
    :param cooldown_s: least time between two changes of the limits.
    :param max_total: the largest total (the ceiling of a bucket limit without a total).
    :param surge_ratio: a long bucket is trimmed only while its recent arrival rate exceeds
        this multiple of its usual rate (0: always).
    """

    def __init__(self, lengths: tuple[float, ...], sla_tpot_s: float, long_ratio: float,
                 recover_step: int, hold_s: float, cooldown_s: float, max_total: int,
                 surge_ratio: float = 0.0) -> None:
        self.n = len(lengths)
        self.lengths = lengths
        self.sla_tpot_s = sla_tpot_s
        self.long_ratio = long_ratio
        self.recover_step = recover_step
        self.hold_s = hold_s
        self.cooldown_s = cooldown_s
        self.max_total = max_total
        self.surge_ratio = surge_ratio
        self.fast = _Average(self.n, SURGE_FAST)
        self.slow = _Average(self.n, SURGE_SLOW)
        self.arrivals: tuple[float, ...] = ()
        self.iteration_s = 0.0
        # Exponential sums from zero: iteration_s is their ratio, scaled by the weight seen so
        # far (``_seen``) so that it ramps up over the first ~100 ticks as a plain average
        # from zero does: a run's first ticks (one long prefill, two requests) are no
        # evidence that the batch is too big.
        self._busy_s = 0.0
        self._iterations = 0.0
        self._seen = 0.0
        self.prefill_share = 0.0
        self.limit: list[int | None] = [None] * self.n
        self.total: int | None = None
        self.changed_at_s: float | None = None
        self.ok_since_s: float | None = None

    def observe(self, stats: DeploymentStats) -> None:
        """Track the length mix (arrivals per bucket), the mean iteration time (weighted by
        iterations) and the prefill share."""
        arrived = [max(0.0, _finite(float(a))) for a in stats.arrived][:self.n]
        arrived += [0.0] * (self.n - len(arrived))
        self.fast.add(arrived)
        self.slow.add(arrived)
        self.arrivals = (tuple(arrived) if len(self.arrivals) != self.n else
                         tuple(e + EMA * (a - e) for e, a in zip(self.arrivals, arrived,
                                                                 strict=True)))
        # an engine that reports no busy time (behind the sidecar: an interval without a
        # decoded token, whose step time vLLM does not tell) adds no iterations either
        busy = iterations = 0.0
        for es in stats.engines:
            engine_busy = _finite(es.busy_s)
            if engine_busy > 0:
                busy += engine_busy
                iterations += max(0, es.iterations)
        if iterations > 0 and busy > 0:
            self._busy_s += EMA * (busy - self._busy_s)
            self._iterations += EMA * (iterations - self._iterations)
            self._seen += EMA * (1.0 - self._seen)
            self.iteration_s = self._seen * self._busy_s / self._iterations
        prefill, decode = max(0, stats.prefill_tokens), max(0, stats.decode_tokens)
        if prefill + decode > 0:
            self.prefill_share += EMA * (prefill / (prefill + decode) - self.prefill_share)

    def long_buckets(self, occupied: Sequence[int]) -> list[int]:
        """The buckets held responsible for a TPOT breach (see the module docstring)."""
        mass = sum(self.arrivals)
        if mass <= 0:
            return []
        mean_len = sum(w * ln for w, ln in zip(self.arrivals, self.lengths, strict=True)) / mass
        return [b for b in range(self.n) if self.lengths[b] >= self.long_ratio * mean_len
                and (occupied[b] > 0 or self.arrivals[b] > 0)]

    def surging(self, buckets: Sequence[int]) -> list[int]:
        """Of ``buckets``, those arriving faster than ``surge_ratio`` x their usual rate."""
        fast, slow, ratio = self.fast.value, self.slow.value, self.surge_ratio
        return [b for b in buckets if ratio <= 0 or fast[b] > ratio * slow[b]]

    def update(self, stats: DeploymentStats, t: float, overshoot: float,
               caps: Sequence[int | None], total: int | None, in_force: Sequence[int | None],
               in_total: int | None) -> Limits:
        """One tick: the per-bucket limits (``None``: none) and the total limit.

        :param overshoot: watched P99 / its limit when breached, 0 when within SLA.
        :param caps: the proposal's caps (after the rules before this one).
        :param total: the proposal's total.
        :param in_force: the caps in force during the tick.
        :param in_total: the total in force during the tick.
        """
        n = self.n
        limit = self.limit
        occupied = [max(0, x) for x in stats.in_engines_per_bucket][:n]
        occupied += [0] * (n - len(occupied))
        paced = self.changed_at_s is None or t - self.changed_at_s >= self.cooldown_s
        if overshoot > 0:
            self.ok_since_s = None
            if paced:
                self._decrease(stats, t, overshoot, occupied, in_force, in_total)
        elif any(x is not None for x in limit) or self.total is not None:
            if self.ok_since_s is None:
                self.ok_since_s = t
            step = 0
            if paced and t - self.ok_since_s >= self.hold_s:
                step, self.changed_at_s = self.recover_step, t
            ceiling = total if total is not None else self.max_total
            held = [q > 0 for q in stats.queued][:n] + [False] * (n - len(stats.queued))
            for b, lim in enumerate(limit):
                if lim is not None:
                    lim += step
                    cap = caps[b]
                    free = not held[b] and occupied[b] < lim
                    limit[b] = None if free or lim >= (ceiling if cap is None else cap) else lim
            if self.total is not None:
                self.total += step
                if (not any(held) and stats.running_total < self.total) or self.total >= ceiling:
                    self.total = None
        bucket_limits = tuple(limit) if any(x is not None for x in limit) else None
        return bucket_limits, self.total

    def _decrease(self, stats: DeploymentStats, t: float, overshoot: float,
                  occupied: list[int], in_force: Sequence[int | None],
                  in_total: int | None) -> None:
        limit = self.limit

        def base(b: int) -> int:
            return min(x for x in (occupied[b], in_force[b], limit[b]) if x is not None)

        long = self.long_buckets(occupied)
        trimmed = self.surging(long)
        for b in trimmed:
            limit[b] = trim(base(b), 1.0 / overshoot)
        batch_bound = (not long and self.iteration_s > self.sla_tpot_s
                       and self.prefill_share < 0.5)
        if batch_bound:
            factor = self.sla_tpot_s / self.iteration_s
            if in_total is not None:
                running = max(0, stats.running_total)
                self.total = trim(min(x for x in (running, in_total, self.total)
                                      if x is not None), factor)
            else:
                for b in range(self.n):
                    if occupied[b] > 0:
                        limit[b] = trim(base(b), factor)
        if trimmed or batch_bound:
            self.changed_at_s = t


class _Average:
    """Per-bucket exponential average, bias-corrected: from the first tick on it is the
    weighted mean of what was seen (a run that starts mid-trace starts from its own mix,
    not from zero)."""

    def __init__(self, n: int, weight: float) -> None:
        self.weight = weight
        self.sums = [0.0] * n
        self.mass = 0.0

    def add(self, values: Sequence[float]) -> None:
        keep = 1.0 - self.weight
        self.sums = [keep * s + self.weight * v for s, v in zip(self.sums, values, strict=True)]
        self.mass = keep * self.mass + self.weight

    @property
    def value(self) -> list[float]:
        return [s / self.mass for s in self.sums] if self.mass > 0 else list(self.sums)
