"""Rule controllers: the tuning guide's playbook, AIMD on P99, a random policy, and fixed caps.

All of them propose an action and pass it through the same :class:`~rlbatch.control.guard.Guard` the
PPO agent learns behind; ``guard_overrides_total`` counts what the guard changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rlbatch.control.controllers import Controller
from rlbatch.control.discipline import KvBudget, QueueOrder
from rlbatch.control.guard import Guard, GuardConfig
from rlbatch.control.hold_release import HoldRelease
from rlbatch.control.pipeline import DecisionPipeline
from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats, balanced_route
from rlbatch.settings import SettingsError, apply


class GuardedController(Controller):
    """Shared machinery: a proposal rule through the decision pipeline
    (:class:`~rlbatch.control.pipeline.DecisionPipeline`: release, then the guard).

    :param name: controller name as the command line spells it.
    :param guard: the guard configuration.
    :param order: the order of admission's queues (:mod:`rlbatch.control.discipline`).
    :param release: when held-back work is released (``None``: never).
    """

    def __init__(self, name: str, guard: GuardConfig | None = None,
                 order: QueueOrder = "fifo", release: HoldRelease | None = None) -> None:
        self.name = name
        self._pipeline = DecisionPipeline(guard, release, order)
        self.info: DeploymentInfo | None = None

    @property
    def pipeline(self) -> DecisionPipeline:
        return self._pipeline

    @property
    def guard(self) -> Guard:
        """The pipeline's guard."""
        return self._pipeline.guard

    @property
    def order(self) -> QueueOrder:
        """The order of admission's queues under this controller."""
        return self._pipeline.order

    def reset(self, info: DeploymentInfo) -> ControlAction:
        self.info = info
        self._pipeline.reset(info)
        self.on_reset(info)
        action, _ = self._pipeline.decide(self.propose(None), None)
        return action

    def decide(self, stats: DeploymentStats) -> ControlAction:
        action, _ = self._pipeline.decide(self.propose(stats), stats)
        return action

    def on_reset(self, info: DeploymentInfo) -> None:
        """Hook for per-run state."""

    def propose(self, stats: DeploymentStats | None) -> ControlAction:
        raise NotImplementedError


# The guide's "P99 > SLA -> fall back to no batching", applied to TPOT: the latency a batch
# size inflates. Applied to TTFT too (``playbook:literal``) one queueing burst trips it, cap 1
# then grows the queue, P99 never recovers and the service collapses (measured: night
# scenario, 2 of 3 seeds).
# The guide reserves headroom for every admitted request's growth: the sum of the counts
PLAYBOOK_GUARD = GuardConfig(p99_metrics=("tpot",), p99_fallback="no_batching",
                             kv_budget=KvBudget(commit="final"))
PLAYBOOK_LITERAL_GUARD = GuardConfig(p99_metrics=("ttft", "tpot"), p99_fallback="no_batching",
                                     kv_budget=KvBudget(commit="final"))


class PlaybookController(GuardedController):
    """``playbook``: the operator tuning guide's whole playbook.

    Length routing (short prompts -> cap ``short_cap`` 32, long -> ``long_cap`` 8, split at
    ``long_from_tokens`` 2048), behind the guide's rules in the guard: warm-up ramp (4, +4 per
    minute for 5 minutes), KV > 80% for 10 s halves caps, P99 > SLA falls back to no
    batching (cap 1) until it recovers, batch efficiency < 70% shrinks caps, committed KV
    within 80% of the pool (>= 20% headroom).

    :param short_cap: cap of the short-prompt buckets.
    :param long_cap: cap of the long-prompt buckets.
    :param long_from_tokens: buckets starting at or above this prompt length are long.
    :param guard: guard configuration (default: the guide's literal rules).
    """

    def __init__(self, short_cap: int = 32, long_cap: int = 8, long_from_tokens: int = 2048,
                 guard: GuardConfig | None = None) -> None:
        super().__init__("playbook", guard or PLAYBOOK_GUARD)
        self.short_cap = short_cap
        self.long_cap = long_cap
        self.long_from_tokens = long_from_tokens
        self._caps: tuple[int, ...] = ()

    def on_reset(self, info: DeploymentInfo) -> None:
        lows = (0, *info.buckets.edges)
        self._caps = tuple(self.long_cap if low >= self.long_from_tokens else self.short_cap
                           for low in lows)

    def propose(self, stats: DeploymentStats | None) -> ControlAction:
        assert self.info is not None
        return ControlAction(self._caps, (balanced_route(self.info.pool_names),) * len(self._caps))


class AimdController(GuardedController):
    """``aimd``: Clipper-style additive increase / multiplicative decrease on P99, per bucket.

    Each tick a bucket whose window TPOT P99 exceeds ``target`` x its SLA limit (or whose
    TTFT P99 does while nothing queues: prefill contention, not queueing) has its cap
    multiplied by ``decrease``; otherwise, if it has work waiting, the cap grows by
    ``increase``. A TTFT breach with a queue is queueing delay, which a smaller cap only
    makes worse. Decreases are at most one per ``cooldown_s``: the window P99 lags.

    :param start_cap: initial cap.
    :param increase: additive step.
    :param decrease: multiplicative factor on breach.
    :param target: fraction of the SLA aimed at (headroom below the limit).
    """

    def __init__(self, start_cap: int = 8, increase: int = 1, decrease: float = 0.5,
                 target: float = 0.9, cooldown_s: float = 10.0,
                 guard: GuardConfig | None = None) -> None:
        super().__init__("aimd", guard)
        if start_cap < 1 or increase < 0 or not 0 < decrease < 1 or not 0 < target <= 1:
            raise ValueError(f"aimd needs start_cap >= 1, increase >= 0, 0 < decrease < 1, "
                             f"0 < target <= 1; got {start_cap}, {increase}, {decrease}, "
                             f"{target}")
        self.start_cap = start_cap
        self.increase = increase
        self.decrease = decrease
        self.target = target
        self.cooldown_s = cooldown_s
        self._caps: list[float] = []
        self._decreased_at: list[float] = []

    def on_reset(self, info: DeploymentInfo) -> None:
        self._caps = [float(self.start_cap)] * len(info.buckets)
        self._decreased_at = [-float("inf")] * len(info.buckets)

    def propose(self, stats: DeploymentStats | None) -> ControlAction:
        assert self.info is not None
        max_cap = self.guard.config.max_cap
        sla = self.info.sla
        if stats is not None:
            w = stats.window
            for b in range(len(self._caps)):
                breach = (w.tpot_p99_s[b] > self.target * sla.tpot_s
                          or (w.ttft_p99_s[b] > self.target * sla.ttft_s
                              and stats.queued[b] == 0))
                if breach:
                    if stats.time_s - self._decreased_at[b] >= self.cooldown_s:
                        self._caps[b] = max(1.0, self._caps[b] * self.decrease)
                        self._decreased_at[b] = stats.time_s
                elif stats.queued[b] > 0:
                    self._caps[b] = min(float(max_cap), self._caps[b] + self.increase)
        return ControlAction(tuple(max(1, int(c)) for c in self._caps),
                             (balanced_route(self.info.pool_names),) * len(self._caps))


class RandomController(GuardedController):
    """``random[:SEED]``: a uniformly random cap and pool per bucket every tick, behind the
    guard (shows the guard alone keeps the service memory-safe).

    :param seed: RNG seed.
    """

    def __init__(self, seed: int = 0, guard: GuardConfig | None = None) -> None:
        super().__init__("random" if seed == 0 else f"random:{seed}", guard)
        self.seed = seed
        self._rng = np.random.default_rng(seed)

    def on_reset(self, info: DeploymentInfo) -> None:
        self._rng = np.random.default_rng(self.seed)

    def propose(self, stats: DeploymentStats | None) -> ControlAction:
        assert self.info is not None
        ladder = self.guard.config.ladder
        pools = self.info.pool_names
        n = len(self.info.buckets)
        caps = tuple(int(ladder[i]) for i in self._rng.integers(len(ladder), size=n))
        chosen = tuple(pools[i] for i in self._rng.integers(len(pools), size=n))
        return ControlAction(caps, chosen)


DEFAULT_GUARD = GuardConfig()


@dataclass(frozen=True)
class PlaybookSettings:
    """Settings of ``playbook`` (:class:`PlaybookController`).

    :param short_cap: cap of the short-prompt buckets.
    :param long_cap: cap of the long-prompt buckets.
    :param long_from_tokens: buckets starting at or above this prompt length are long.
    :param guard: the guard (default: the guide's rules, :data:`PLAYBOOK_GUARD`).
    """

    short_cap: int = 32
    long_cap: int = 8
    long_from_tokens: int = 2048
    guard: GuardConfig = PLAYBOOK_GUARD


@dataclass(frozen=True)
class AimdSettings:
    """Settings of ``aimd`` (:class:`AimdController`).

    :param start_cap: initial cap.
    :param increase: additive step.
    :param decrease: multiplicative factor on breach.
    :param target: fraction of the SLA aimed at.
    :param cooldown_s: at most one decrease per this many seconds.
    :param guard: the guard.
    """

    start_cap: int = 8
    increase: int = 1
    decrease: float = 0.5
    target: float = 0.9
    cooldown_s: float = 10.0
    guard: GuardConfig = DEFAULT_GUARD


@dataclass(frozen=True)
class GuardSettings:
    """Settings of a rule that has only its guard (``random``).

    :param guard: the guard.
    """

    guard: GuardConfig = DEFAULT_GUARD


def playbook_factory(arg: str, settings: Mapping[str, Any]) -> PlaybookController:
    """``playbook``, ``playbook:literal`` (no-batching fallback on TTFT too) or
    ``playbook:guard`` (the routing behind the default guard); settings:
    :class:`PlaybookSettings`."""
    variants = {"": PLAYBOOK_GUARD, "literal": PLAYBOOK_LITERAL_GUARD, "guard": DEFAULT_GUARD}
    if arg not in variants:
        raise ValueError(f"playbook variants: playbook, playbook:literal, playbook:guard; "
                         f"got playbook:{arg}")
    cfg = apply(PlaybookSettings(guard=variants[arg]), settings)
    return PlaybookController(cfg.short_cap, cfg.long_cap, cfg.long_from_tokens, cfg.guard)


def aimd_factory(arg: str, settings: Mapping[str, Any]) -> AimdController:
    """``aimd``; settings: :class:`AimdSettings`."""
    if arg:
        raise ValueError(f"aimd takes no argument, got aimd:{arg}")
    cfg = apply(AimdSettings(), settings)
    return AimdController(cfg.start_cap, cfg.increase, cfg.decrease, cfg.target,
                          cfg.cooldown_s, cfg.guard)


def random_factory(arg: str, settings: Mapping[str, Any]) -> RandomController:
    """``random[:SEED]``; settings: :class:`GuardSettings`."""
    try:
        seed = int(arg) if arg else 0
    except ValueError:
        raise ValueError(f"random takes an integer seed, e.g. random:3; got random:{arg}") \
            from None
    return RandomController(seed, apply(GuardSettings(), settings).guard)


class FixedController(GuardedController):
    """``fixed:CAPS``: fixed caps behind the guard (see :func:`fixed_factory`).

    :param name: the command-line name.
    :param caps: per-bucket caps (``None`` = no per-bucket cap); ``None`` = every bucket
        uncapped (a total cap alone).
    :param total: engine-wide cap (``max_num_seqs``); ``None`` keeps the engine default.
    :param guard: guard configuration.
    :param order: the order of admission's queues.
    """

    def __init__(self, name: str, caps: tuple[int | None, ...] | None, total: int | None,
                 guard: GuardConfig | None = None, order: QueueOrder = "fifo") -> None:
        super().__init__(name, guard, order)
        self.caps = caps
        self.total = total

    def on_reset(self, info: DeploymentInfo) -> None:
        if self.caps is not None and len(self.caps) != len(info.buckets):
            raise ValueError(f"{self.name}: {len(self.caps)} bucket caps given, the deployment "
                             f"has {len(info.buckets)} buckets")

    def propose(self, stats: DeploymentStats | None) -> ControlAction:
        assert self.info is not None
        n = len(self.info.buckets)
        caps = self.caps if self.caps is not None else (None,) * n
        return ControlAction(caps, (balanced_route(self.info.pool_names),) * n, self.total)


@dataclass(frozen=True)
class FixedSettings:
    """Settings of ``fixed`` (:class:`FixedController`).

    :param order: the order of admission's queues (``fifo`` or ``deadline``).
    :param guarded: ``false`` switches every rule of the guard off (its sanitising stays):
        the caps as they are, as ``static:N`` but through admission.
    :param guard: the guard (its rules, the P99 fallback, the KV budget).
    """

    order: QueueOrder = "fifo"
    guarded: bool = True
    guard: GuardConfig = DEFAULT_GUARD


UNGUARDED = replace(DEFAULT_GUARD, warmup=False, kv_high=False, p99=False, efficiency=False,
                    kv_budget=None)
"""Every rule off; the sanitising stays."""


def fixed_factory(arg: str, settings: Mapping[str, Any]) -> FixedController:
    """``fixed:CAPS``: the same caps every tick, behind the (default) guard.

    ``CAPS`` is either
    - ``N``: a total cap of N running sequences (``max_num_seqs=N``, no per-bucket cap: the
      same action as ``static:N``, but guarded);
    - ``A/B/C/D``: one cap per bucket, ``-`` for a bucket without cap; ``A/B/C/D@N`` adds a
      total cap N.

    Settings: :class:`FixedSettings`, e.g. ``fixed:256[order=deadline]``,
    ``fixed:64[guard.p99=false]``, ``fixed:64/64/64/64[guard.p99_fallback=halve]``,
    ``fixed:64[guard.kv_budget.fraction=0.8,guard.kv_budget.commit=final]``,
    ``fixed:256[guarded=false]``.
    """
    usage = "e.g. fixed:64, fixed:64/64/64/64, fixed:64/-/8/8@48"
    if not arg:
        raise ValueError(f"fixed needs caps, {usage}; got fixed:{arg}")
    caps_text, at, total_text = arg.partition("@")
    try:
        parts = caps_text.split("/")
        if len(parts) == 1 and not at:
            caps: tuple[int | None, ...] | None = None
            total: int | None = int(parts[0])
        else:
            caps = tuple(None if p.strip() == "-" else int(p) for p in parts)
            total = int(total_text) if at else None
    except ValueError:
        raise ValueError(f"fixed caps must be integers ('-' = no bucket cap), {usage}; got "
                         f"fixed:{arg}") from None
    if (total is not None and total < 1) or any(c is not None and c < 1 for c in caps or ()):
        raise ValueError(f"fixed caps must be >= 1, got fixed:{arg}")
    cfg = apply(FixedSettings(), settings)
    if not cfg.guarded and "guard" in settings:
        raise SettingsError("guarded=false switches every rule of the guard off: its guard.* "
                            "settings would be ignored")
    guard = cfg.guard if cfg.guarded else replace(UNGUARDED, ladder=cfg.guard.ladder,
                                                  max_total_cap=cfg.guard.max_total_cap)
    return FixedController(f"fixed:{arg}", caps, total, guard, cfg.order)
