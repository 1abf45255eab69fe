"""The Guard: hard rules that override any policy on OOM risk and SLA breach.

Every rule is the tuning guide's (../shared/guide/), with its numbers as defaults; each can be
switched off and re-parameterised. ``Guard.check(proposed, stats)`` returns
``(safe_action, overrides)``: the same code runs behind PPO in the Gymnasium env, behind the
rule controllers in evaluation, and in the sidecar.

Rules, applied in this order to the proposed caps (each only ever lowers a cap):

``sanitize``
    caps outside ``[1, ladder max]`` (or missing) are clamped, unknown pools replaced by the
    first pool: whatever a policy emits, the result is a valid action.
``warmup``
    for the first ``warmup_s`` (5 min) after an engine start caps start at
    ``warmup_start_cap`` (4) and may grow by ``warmup_step`` (4) per ``warmup_step_s``
    (1 min). Applies when the deployment reports a cold start (``DeploymentInfo.cold_start``:
    live engines; simulated runs only with ``--cold-start``, since simulated engines are warm
    from t=0 and trace slices start mid-service).
``kv_high``
    KV cache usage above ``kv_high_threshold`` (80%) for ``kv_high_duration_s`` (10 s)
    halves every cap in force, again for every further period it stays high; released when
    usage falls back below the threshold. (KV usage, not nvidia-smi memory: vLLM
    pre-allocates its pool, so device memory sits near ``gpu_memory_utilization`` whatever
    the load.)
``p99``
    a sliding-window P99 above the SLA falls back: by default a multiplicative decrease
    (halve the caps in force, floor ``p99_floor_cap``; at most once per ``p99_cooldown_s``
    so the window can show the effect), held until the P99 has been back
    within SLA for ``p99_hold_s``; ``p99_fallback="no_batching"`` is the guide's literal
    "fall back to no batching" (cap 1). By default the rule watches TPOT, the latency a batch
    size inflates; TTFT breaches under overload come from queueing, where shrinking caps only
    lowers throughput (``p99_metrics`` adds ``ttft``).
``efficiency``
    batch efficiency (useful / computed tokens: preemption recompute is waste) below
    ``efficiency_threshold`` (70%) shrinks caps by ``efficiency_factor``.
``kv_budget``
    admission keeps the committed KV (prompt + max output of admitted requests) within
    ``kv_budget_fraction`` of the KV pool (80%: the guide's >= 20% headroom for growth; on
    an A100-80G with Llama-2-7B this equals its "KV <= 70% of GPU memory minus weights").
    This is what makes the guard alone memory-safe: no admitted set can outgrow the pool.

``max_seq_len`` truncation / rejection is enforced at admission (``GuardConfig.max_seq_len``
and ``over_length`` feed the deployment's ``max_model_len``); truncated and rejected requests
are counted in every evaluation row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from rlbatch.control.types import ControlAction, DeploymentInfo, DeploymentStats

DEFAULT_LADDER: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
RULES: tuple[str, ...] = ("sanitize", "warmup", "kv_high", "p99", "efficiency", "kv_budget")


@dataclass(frozen=True)
class GuardConfig:
    """Every rule switchable and parameterised; defaults are the tuning guide's numbers.

    :param ladder: the cap ladder; caps are kept within ``[1, max(ladder)]``.
    :param warmup: enable the warm-up ramp.
    :param warmup_s: length of the ramp.
    :param warmup_start_cap: cap at start.
    :param warmup_step: cap increase per step.
    :param warmup_step_s: step length.
    :param kv_high: enable the KV-usage circuit breaker.
    :param kv_high_threshold: KV usage fraction that counts as high.
    :param kv_high_duration_s: how long it must stay high before caps are halved.
    :param p99: enable the P99 fallback.
    :param p99_metrics: latencies watched: ``tpot`` and/or ``ttft``.
    :param p99_fallback: ``halve`` (multiplicative decrease) or ``no_batching`` (cap 1).
    :param p99_floor_cap: lowest cap the ``halve`` fallback goes to.
    :param p99_hold_s: P99 must be back within SLA this long before the fallback lifts.
    :param p99_cooldown_s: after a decrease, wait this long before decreasing again: the
        window P99 needs time to show the effect of smaller caps (halving every tick on a
        30 s window drives caps to the floor before the first decrease is even visible).
    :param efficiency: enable the batch-efficiency monitor.
    :param efficiency_threshold: efficiency below which caps shrink.
    :param efficiency_factor: multiplier applied to the caps in force.
    :param kv_budget: enable the committed-KV admission budget.
    :param kv_budget_fraction: fraction of the KV pool committed KV may use.
    :param max_seq_len: longest prompt + output admitted (``None``: the model's context).
    :param over_length: ``truncate`` or ``reject`` requests longer than ``max_seq_len``.
    """

    ladder: tuple[int, ...] = DEFAULT_LADDER
    warmup: bool = True
    warmup_s: float = 300.0
    warmup_start_cap: int = 4
    warmup_step: int = 4
    warmup_step_s: float = 60.0
    kv_high: bool = True
    kv_high_threshold: float = 0.8
    kv_high_duration_s: float = 10.0
    p99: bool = True
    p99_metrics: tuple[str, ...] = ("tpot",)
    p99_fallback: Literal["halve", "no_batching"] = "halve"
    p99_floor_cap: int = 4
    p99_hold_s: float = 30.0
    p99_cooldown_s: float = 10.0
    efficiency: bool = True
    efficiency_threshold: float = 0.7
    efficiency_factor: float = 0.75
    kv_budget: bool = True
    kv_budget_fraction: float = 0.8
    max_seq_len: int | None = None
    over_length: Literal["truncate", "reject"] = "truncate"

    def __post_init__(self) -> None:
        if not self.ladder or any(c < 1 for c in self.ladder) or list(self.ladder) != sorted(
                set(self.ladder)):
            raise ValueError(f"ladder must be strictly increasing positive ints, got "
                             f"{self.ladder}")
        for name in ("warmup_s", "warmup_step_s", "kv_high_duration_s", "p99_hold_s",
                     "p99_cooldown_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.warmup_start_cap < 1 or self.warmup_step < 0:
            raise ValueError(f"warm-up needs start cap >= 1 and step >= 0, got "
                             f"{self.warmup_start_cap}, {self.warmup_step}")
        if not 0 < self.kv_high_threshold <= 1:
            raise ValueError(f"kv_high_threshold must be in (0, 1], got {self.kv_high_threshold}")
        if not 0 < self.kv_budget_fraction <= 1:
            raise ValueError(f"kv_budget_fraction must be in (0, 1], got "
                             f"{self.kv_budget_fraction}")
        if not 0 <= self.efficiency_threshold <= 1 or not 0 < self.efficiency_factor <= 1:
            raise ValueError(f"efficiency threshold must be in [0, 1] and factor in (0, 1], got "
                             f"{self.efficiency_threshold}, {self.efficiency_factor}")
        if set(self.p99_metrics) - {"ttft", "tpot"}:
            raise ValueError(f"p99_metrics must be among ('ttft', 'tpot'), got "
                             f"{self.p99_metrics}")
        if self.p99_fallback not in ("halve", "no_batching"):
            raise ValueError(f"p99_fallback must be 'halve' or 'no_batching', got "
                             f"{self.p99_fallback!r}")
        if self.p99_floor_cap < 1:
            raise ValueError(f"p99_floor_cap must be >= 1, got {self.p99_floor_cap}")
        if self.over_length not in ("truncate", "reject"):
            raise ValueError(f"over_length must be 'truncate' or 'reject', got "
                             f"{self.over_length!r}")

    @property
    def max_cap(self) -> int:
        return self.ladder[-1]


@dataclass(frozen=True)
class Override:
    """One rule lowering (or fixing) one bucket's cap or pool.

    :param rule: the rule's name (one of ``RULES``).
    :param bucket: bucket index, ``None`` for a deployment-wide effect.
    :param before: value proposed.
    :param after: value enforced.
    """

    rule: str
    bucket: int | None
    before: int | str | None
    after: int | str | None


@dataclass
class GuardState:
    """What the guard remembers between ticks (exposed for observation flags)."""

    kv_high_since_s: float | None = None
    kv_high_halvings: int = 0
    kv_high_limit: tuple[int, ...] | None = None
    p99_active: bool = False
    p99_ok_since_s: float | None = None
    p99_decreased_at_s: float | None = None
    p99_limit: tuple[int, ...] | None = None
    efficiency_active: bool = False
    warmup_active: bool = False
    kv_budget_blocked: bool = False
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))


class Guard:
    """Hard safety rules over any policy's proposed action.

    :param config: rule switches and parameters.
    """

    def __init__(self, config: GuardConfig | None = None) -> None:
        self.config = config or GuardConfig()
        self.state = GuardState()
        self._pools: tuple[str, ...] = ("fp16",)
        self._n_buckets = 4
        self._sla_ttft_s = 2.0
        self._sla_tpot_s = 0.1
        self._cold_start = True

    def reset(self, info: DeploymentInfo) -> None:
        """Start of a run: forget all state."""
        self.state = GuardState()
        self._pools = info.pool_names
        self._n_buckets = len(info.buckets)
        self._sla_ttft_s = info.sla.ttft_s
        self._sla_tpot_s = info.sla.tpot_s
        self._cold_start = info.cold_start

    @property
    def overrides_total(self) -> int:
        return sum(self.state.counts.values())

    def fallback_action(self) -> ControlAction:
        """Safe caps when no observation can be had (e.g. a metrics scrape failed)."""
        cfg = self.config
        cap = max(1, min(cfg.warmup_start_cap, cfg.max_cap))
        return ControlAction((cap,) * self._n_buckets, (self._pools[0],) * self._n_buckets,
                             None, cfg.kv_budget_fraction if cfg.kv_budget else None)

    def check(self, proposed: ControlAction | None,
              stats: DeploymentStats | None) -> tuple[ControlAction, list[Override]]:
        """Return the safe version of ``proposed`` given the last tick's ``stats``.

        ``stats`` is ``None`` before the first tick (start of a run): only the static rules
        apply then. Never raises on odd numbers: NaN or infinite readings count as unsafe
        for memory and as "no signal" for latency.
        """
        cfg = self.config
        n = self._n_buckets
        overrides: list[Override] = []
        caps, pools = self._sanitize(proposed, overrides)
        t = stats.time_s if stats is not None and math.isfinite(stats.time_s) else 0.0
        t = max(t, 0.0)
        in_force = self._in_force_caps(stats, caps)

        # warm-up ramp
        self.state.warmup_active = False
        if cfg.warmup and self._cold_start and t < cfg.warmup_s:
            steps = int(t // cfg.warmup_step_s) if cfg.warmup_step_s > 0 else 0
            limit = min(cfg.max_cap, cfg.warmup_start_cap + cfg.warmup_step * steps)
            self.state.warmup_active = True
            caps = self._limit(caps, (limit,) * n, "warmup", overrides)

        if stats is not None:
            if cfg.kv_high:
                caps = self._kv_high(stats, t, caps, in_force, overrides)
            if cfg.p99:
                caps = self._p99(stats, t, caps, in_force, overrides)
            if cfg.efficiency:
                caps = self._efficiency(stats, caps, in_force, overrides)
            self.state.kv_budget_blocked = bool(stats.kv_budget_blocked) and cfg.kv_budget
            if self.state.kv_budget_blocked:
                overrides.append(Override("kv_budget", None, None, None))

        for o in overrides:
            self.state.counts[o.rule] += 1
        budget = cfg.kv_budget_fraction if cfg.kv_budget else None
        return ControlAction(tuple(caps), tuple(pools), None, budget), overrides

    # ------------------------------------------------------------------ rules
    def _sanitize(self, proposed: ControlAction | None,
                  overrides: list[Override]) -> tuple[list[int], list[str]]:
        cfg = self.config
        n = self._n_buckets
        if proposed is None or len(proposed.caps) != n:
            overrides.append(Override("sanitize", None, None, cfg.warmup_start_cap))
            return [min(cfg.max_cap, cfg.warmup_start_cap)] * n, [self._pools[0]] * n
        caps: list[int] = []
        pools: list[str] = []
        for b, (cap, pool) in enumerate(zip(proposed.caps, proposed.pools, strict=True)):
            safe_cap = cfg.max_cap if cap is None else min(max(int(cap), 1), cfg.max_cap)
            if safe_cap != cap:
                overrides.append(Override("sanitize", b, cap, safe_cap))
            safe_pool = pool if pool in self._pools else self._pools[0]
            if safe_pool != pool:
                overrides.append(Override("sanitize", b, pool, safe_pool))
            caps.append(safe_cap)
            pools.append(safe_pool)
        return caps, pools

    def _in_force_caps(self, stats: DeploymentStats | None, fallback: list[int]) -> list[int]:
        if stats is None or len(stats.action.caps) != self._n_buckets:
            return list(fallback)
        return [self.config.max_cap if c is None else c for c in stats.action.caps]

    def _limit(self, caps: list[int], limit: tuple[int, ...] | list[int], rule: str,
               overrides: list[Override]) -> list[int]:
        out = []
        for b, (cap, lim) in enumerate(zip(caps, limit, strict=True)):
            if cap > lim:
                overrides.append(Override(rule, b, cap, lim))
                cap = lim
            out.append(cap)
        return out

    def _kv_high(self, stats: DeploymentStats, t: float, caps: list[int], in_force: list[int],
                 overrides: list[Override]) -> list[int]:
        cfg = self.config
        st = self.state
        usage = stats.kv_cache_usage_max
        high = not (usage <= cfg.kv_high_threshold)  # NaN counts as high
        if not high:
            st.kv_high_since_s, st.kv_high_halvings, st.kv_high_limit = None, 0, None
            return caps
        if st.kv_high_since_s is None:
            st.kv_high_since_s = t - stats.tick_s if math.isfinite(stats.tick_s) else t
        held = t - st.kv_high_since_s
        due = int(held // cfg.kv_high_duration_s) if cfg.kv_high_duration_s > 0 else 1
        if due > st.kv_high_halvings:
            base = st.kv_high_limit or tuple(in_force)
            st.kv_high_limit = tuple(max(1, c // 2) for c in base)
            st.kv_high_halvings = due
        if st.kv_high_limit is None:
            return caps
        return self._limit(caps, st.kv_high_limit, "kv_high", overrides)

    def _p99(self, stats: DeploymentStats, t: float, caps: list[int], in_force: list[int],
             overrides: list[Override]) -> list[int]:
        cfg = self.config
        st = self.state
        w = stats.window
        breach = False
        if "tpot" in cfg.p99_metrics and w.tpot_p99_all_s > self._sla_tpot_s:
            breach = True
        if "ttft" in cfg.p99_metrics and w.ttft_p99_all_s > self._sla_ttft_s:
            breach = True
        if breach:
            cooling = (st.p99_active and st.p99_decreased_at_s is not None
                       and t - st.p99_decreased_at_s < cfg.p99_cooldown_s)
            if not cooling:
                if cfg.p99_fallback == "no_batching":
                    limit = (1,) * self._n_buckets
                else:
                    base = st.p99_limit if st.p99_active and st.p99_limit else tuple(in_force)
                    limit = tuple(max(min(cfg.p99_floor_cap, c), c // 2) for c in base)
                st.p99_limit, st.p99_decreased_at_s = limit, t
            st.p99_active, st.p99_ok_since_s = True, None
        elif st.p99_active:
            if st.p99_ok_since_s is None:
                st.p99_ok_since_s = t
            if t - st.p99_ok_since_s >= cfg.p99_hold_s:
                st.p99_active, st.p99_ok_since_s, st.p99_limit = False, None, None
                st.p99_decreased_at_s = None
        if st.p99_active and st.p99_limit is not None:
            return self._limit(caps, st.p99_limit, "p99", overrides)
        return caps

    def _efficiency(self, stats: DeploymentStats, caps: list[int], in_force: list[int],
                    overrides: list[Override]) -> list[int]:
        cfg = self.config
        efficiency = stats.batch_efficiency
        if math.isnan(efficiency):  # nothing computed in the tick: nothing wasted
            efficiency = 1.0
        self.state.efficiency_active = not (efficiency >= cfg.efficiency_threshold)
        if not self.state.efficiency_active:
            return caps
        limit = [max(1, int(c * cfg.efficiency_factor)) for c in in_force]
        return self._limit(caps, limit, "efficiency", overrides)

    def flags(self) -> tuple[float, ...]:
        """Rule activity as 0/1 floats (warmup, kv_high, p99, efficiency, kv_budget) for the
        observation."""
        st = self.state
        return (float(st.warmup_active), float(st.kv_high_limit is not None),
                float(st.p99_active), float(st.efficiency_active), float(st.kv_budget_blocked))
