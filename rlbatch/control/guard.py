"""The Guard: hard rules that override any policy on OOM risk and SLA breach.

Every rule is the tuning guide's (../shared/guide/), with its numbers as defaults; each can be
switched off and re-parameterised. ``Guard.check(proposed, stats)`` returns
``(safe_action, overrides)``: the same code runs behind PPO in the Gymnasium env, behind the
rule controllers in evaluation, and in the sidecar.

Two levers: per-bucket caps and the engine-wide total (``max_num_seqs``). A proposal without
a total (``max_num_seqs=None``: the engine default) keeps the original behaviour: a bucket
without a cap gets the ladder max, and the rules lower per-bucket caps. A proposal with a
total keeps it (within ``[1, max_total_cap]``) and its uncapped buckets stay uncapped
(unlimited within the total); every limiting rule then lowers the total too, the only lever
when no bucket has a cap.

Rules, applied in this order to the proposed caps (each only ever lowers a cap):

``sanitize``
    caps outside ``[1, ladder max]``, a total outside ``[1, max_total_cap]``, or a missing
    proposal are clamped, unknown pools replaced by the first pool: whatever a policy emits,
    the result is a valid action.
``warmup``
    for the first ``warmup_s`` (5 min) after an engine start caps (and the total) start at
    ``warmup_start_cap`` (4) and may grow by ``warmup_step`` (4) per ``warmup_step_s``
    (1 min). Applies when the deployment reports a cold start (``DeploymentInfo.cold_start``:
    live engines; simulated runs only with ``--cold-start``, since simulated engines are warm
    from t=0 and trace slices start mid-service).
``kv_high``
    KV cache usage above ``kv_high_threshold`` (80%) for ``kv_high_duration_s`` (10 s)
    halves every cap in force (and the total), again for every further period it stays high;
    released when usage falls back below the threshold. (KV usage, not nvidia-smi memory: vLLM
    pre-allocates its pool, so device memory sits near ``gpu_memory_utilization`` whatever
    the load.)
``p99``
    a sliding-window P99 above the SLA falls back, at most once per ``p99_cooldown_s`` (the
    window needs time to show the effect). By default the rule watches TPOT, the latency a
    batch size inflates; TTFT breaches under overload come from queueing, where shrinking
    caps only lowers throughput (``p99_metrics`` adds ``ttft``). Fallbacks:

    - ``proportional`` (default) acts where the breach comes from
      (:mod:`rlbatch.control.p99_trim`): it trims the buckets whose prompts are long against
      the traffic (their prefills slow every decode) while they surge (a flood of long
      reports; a steady share of long prompts is served) in proportion to the overshoot, or the
      total when the batch itself is too slow, and nothing when the tail comes from the
      traffic's own bulk (no cap removes that without queueing it); back within SLA the
      limits grow back by ``p99_recover_step`` per ``p99_cooldown_s``: no cliff.
    - ``halve``: multiplicative decrease of every cap in force (and the total), floor
      ``p99_floor_cap``, held until the P99 has been back within SLA for ``p99_hold_s``.
    - ``no_batching``: the guide's literal "fall back to no batching" (cap 1, total 1), held
      like ``halve``.
``efficiency``
    batch efficiency (useful / computed tokens: preemption recompute is waste) below
    ``efficiency_threshold`` (70%) shrinks caps (and the total) by ``efficiency_factor``.
``kv_budget``
    admission keeps the committed KV (each admitted request counted at prompt + the output
    it is expected to reach, whole blocks; see :mod:`rlbatch.engine.reserve`) within
    ``kv_budget.fraction`` of the KV pool (default the whole pool). The budget is a setting
    of admission for the whole run (:class:`~rlbatch.control.discipline.KvBudget`, its one
    home); the guard states it (:class:`~rlbatch.control.pipeline.DecisionPipeline.
    discipline`), counts the ticks it held a request back and, under a total, caps uncapped
    buckets at the total so that their requests go through admission and its budget. The
    guide's ">= 20% headroom for context growth" is reserved per request here: a request is
    counted at a high quantile of its bucket's recent outputs, and at twice what it has
    generated once it runs longer, so the admitted set rarely outgrows the pool; when the
    traffic turns to longer answers, the bucket's history forgets the outputs from before
    the turn as soon as its recent completions show it (a queue held through the turn and
    released at once otherwise enters counted at the old traffic's outputs). A flat 80%
    on top of that reserved the growth twice and cost up to 40% goodput at the knee
    (BENCHMARKS.md). The engines can count the declared ``max_tokens`` instead
    (``declared``: exact, but clients that send none or a generous one starve the pool) or,
    in a trace replay, the real output (``oracle``, a bound for comparisons); ``kv_high``
    still watches the usage itself. By default (``commit="peak"``) the budget holds the peak
    of the projected KV, not the sum of the counts: a request about to finish and one just
    admitted never hold their full KV at once. Counting the sum (``final``) held an FP16
    engine to 74-84 requests in held-back Azure's opening surge where vLLM alone runs
    121-141 (BENCHMARKS.md).

``tpot_fit`` (off unless set; the shipped policies and ``train.py``'s recipe set it)
    the SLA's TPOT before it is missed: the step-time model of the deployment's GPU and model
    profiles (:class:`~rlbatch.control.tpot_fit.TpotFit`) predicts one engine's iteration
    time with N sequences decoding at the traffic's smoothed mean context while the prefill
    computed per second stays what it is, and the total is held at the largest N whose
    prediction meets ``tpot_fit_margin`` times the SLA's TPOT (a proposal without a total:
    each bucket's cap, a weaker bound, since the buckets together may run more). Nothing is held
    when not even one sequence meets it (a smaller batch cannot bring the TPOT within the SLA
    then, it only queues). The ``p99`` rule acts once the window shows a breach, which on
    long contexts comes one batch too late: on RAG at 1 s / 50 ms the TPOT limit sits between
    24 and 32 running and one ladder step decides three times the goodput (BENCHMARKS.md).
    Needs the deployment's GPU and model profiles. On two pools the first pool's fit caps
    every engine unless ``tpot_fit_per_pool``: then each pool has its own fit, from its
    precision, and its own calibration, the total is the largest ceiling, and the action
    lowers it for the other pool's engines (``ControlAction.pool_max_num_seqs``). One ceiling
    holds the FP8 engine of an FP16 + FP8 deployment at the FP16 engine's limit: on RAG at
    2 s / 100 ms it runs 46-50 sequences where it meets the TPOT at 54-83, and the queue grows;
    a ceiling per pool clears it (+8-12%). At a 50-ms TPOT it gains 14-22% on RAG and 10% on
    reports; at 100 ms it loses 1-5% on code completion, where the fit is too loose and the
    FP16 ceiling's conservatism paid; at 150 ms nothing moves. So it is off by default
    (BENCHMARKS.md section 24).
    The prediction is scaled by how much slower than predicted the engines' iterations have
    run (``tpot_fit_calibrated``, :class:`~rlbatch.control.tpot_fit.FitCalibration`): the fit
    misses by a factor that depends on the traffic (on code completion the iterations run
    1.35-1.75x the predicted time, p10-p90 over the ticks; on long contexts 1.04-1.11x), which
    a fixed margin cannot cover both ways. And the limit sits lower for short outputs, whose
    TPOT spreads more around the engine's mean iteration time (``tpot_fit_spread``,
    :func:`~rlbatch.control.tpot_fit.spread_slowdown`). The defaults (margin 1.05, spread 2.5,
    calibrated) are the best geo-mean of a guarded constant's goodput over the best static's
    on the training traffic at three SLAs (1 s / 50 ms, 2 s / 100 ms, 5 s / 150 ms;
    ``experiments/tune_gradient.py``, BENCHMARKS.md section 21). The scaled prediction holds
    nothing either where it fits nothing, for the same reason: an engine that slow with one
    sequence decoding is slowed by its prefills, which a smaller batch does not remove (on
    code completion at 1 s / 50 ms, 9 ticks of 1,801 in one run, none in others); holding a
    total of 1 there would throttle a live engine whose profile is far off to one sequence.
    The ceiling is recomputed every tick; ``kv_high``, ``p99`` and ``efficiency`` scale the
    limits in force as they stood before it, so that a halving and the ceiling do not
    compound: on report generation at 2 s / 100 ms the KV pool sits at the budget's 83-85%
    usage, and ``kv_high`` halved the ceiling's 78 to 39, under the 48 sequences the KV lets
    run (1.29 goodput/s against 1.33 without the ceiling; BENCHMARKS.md section 22).

``max_seq_len`` truncation / rejection is enforced at admission (``GuardConfig.max_seq_len``
and ``over_length`` feed the deployment's ``max_model_len``); truncated and rejected requests
are counted in every evaluation row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from rlbatch.control.discipline import DEFAULT_KV_BUDGET, KvBudget
from rlbatch.control.p99_trim import ProportionalTrim, nominal_lengths
from rlbatch.control.tpot_fit import (
    TRAFFIC_TAU_S,
    FitCalibration,
    TpotFit,
    TrafficMeans,
    quantised_slowdown,
    spread_slowdown,
)
from rlbatch.control.types import ANY_POOL, ControlAction, DeploymentInfo, DeploymentStats

DEFAULT_LADDER: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
RULES: tuple[str, ...] = ("sanitize", "warmup", "kv_high", "p99", "efficiency", "kv_budget",
                          "tpot_fit")
P99_FALLBACKS: tuple[str, ...] = ("proportional", "halve", "no_batching")
Caps = list[int | None]


@dataclass(frozen=True)
class GuardConfig:
    """Every rule switchable and parameterised; defaults are the tuning guide's numbers.

    :param ladder: the cap ladder; per-bucket caps are kept within ``[1, max(ladder)]``.
    :param max_total_cap: the largest total (``max_num_seqs``) a proposal may set.
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
    :param p99_fallback: ``proportional`` (trim where the breach comes from), ``halve``
        (multiplicative decrease of every cap) or ``no_batching`` (cap 1).
    :param p99_floor_cap: lowest cap the ``halve`` fallback goes to.
    :param p99_hold_s: ``halve`` / ``no_batching``: P99 must be back within SLA this long
        before the fallback lifts.
    :param p99_cooldown_s: after a decrease, wait this long before decreasing again: the
        window P99 needs time to show the effect of smaller caps (halving every tick on a
        30 s window drives caps to the floor before the first decrease is even visible).
    :param p99_long_ratio: ``proportional``: a bucket is trimmed for a TPOT breach when its
        nominal prompt length is at least this multiple of the traffic's mean.
    :param p99_recover_step: ``proportional``: how much each trimmed limit grows per tick
        once the P99 is back within SLA.
    :param p99_surge_ratio: ``proportional``: a long bucket is trimmed only while it surges,
        its arrival rate over the last ~30 ticks above this multiple of its rate over the
        last ~600 (0: whenever it is long). Long prompts that are a steady part of the
        traffic are served as a static cap would serve them: trimming them only trades their
        SLA for the short buckets' (BENCHMARKS.md).
    :param efficiency: enable the batch-efficiency monitor.
    :param efficiency_threshold: efficiency below which caps shrink.
    :param efficiency_factor: multiplier applied to the caps in force.
    :param kv_budget: the committed-KV admission budget (``None``: off).
    :param max_seq_len: longest prompt + output admitted (``None``: the model's context).
    :param over_length: ``truncate`` or ``reject`` requests longer than ``max_seq_len``.
    :param tpot_fit: enable the predicted-TPOT ceiling on the total.
    :param tpot_fit_margin: the ceiling's limit as a multiple of the SLA's TPOT.
    :param tpot_fit_calibrated: scale the ceiling's prediction by the engines' observed over
        predicted iteration time.
    :param tpot_fit_spread: the ceiling's allowance for a request's TPOT spreading around the
        engine's mean iteration time, which shrinks with its output length
        (:func:`~rlbatch.control.tpot_fit.spread_slowdown`; 0: none).
    :param tpot_fit_per_pool: on two pools, a ceiling per pool from its own precision's fit
        (the default ``False``: the first pool's ceiling caps every engine).
    """

    ladder: tuple[int, ...] = DEFAULT_LADDER
    max_total_cap: int = 256
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
    p99_fallback: Literal["proportional", "halve", "no_batching"] = "proportional"
    p99_floor_cap: int = 4
    p99_hold_s: float = 30.0
    p99_cooldown_s: float = 10.0
    p99_long_ratio: float = 2.0
    p99_recover_step: int = 1
    p99_surge_ratio: float = 2.0
    efficiency: bool = True
    efficiency_threshold: float = 0.7
    efficiency_factor: float = 0.75
    kv_budget: KvBudget | None = DEFAULT_KV_BUDGET
    max_seq_len: int | None = None
    over_length: Literal["truncate", "reject"] = "truncate"
    tpot_fit: bool = False
    tpot_fit_margin: float = 1.05
    tpot_fit_calibrated: bool = True
    tpot_fit_spread: float = 2.5
    tpot_fit_per_pool: bool = False

    def __post_init__(self) -> None:
        if not self.ladder or any(c < 1 for c in self.ladder) or list(self.ladder) != sorted(
                set(self.ladder)):
            raise ValueError(f"ladder must be strictly increasing positive ints, got "
                             f"{self.ladder}")
        if self.max_total_cap < 1:
            raise ValueError(f"max_total_cap must be >= 1, got {self.max_total_cap}")
        for name in ("warmup_s", "warmup_step_s", "kv_high_duration_s", "p99_hold_s",
                     "p99_cooldown_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.warmup_start_cap < 1 or self.warmup_step < 0:
            raise ValueError(f"warm-up needs start cap >= 1 and step >= 0, got "
                             f"{self.warmup_start_cap}, {self.warmup_step}")
        if not 0 < self.kv_high_threshold <= 1:
            raise ValueError(f"kv_high_threshold must be in (0, 1], got {self.kv_high_threshold}")
        if self.kv_budget is not None and not isinstance(self.kv_budget, KvBudget):
            raise ValueError(f"kv_budget must be a KvBudget or None, got {self.kv_budget!r}")
        if not 0 <= self.efficiency_threshold <= 1 or not 0 < self.efficiency_factor <= 1:
            raise ValueError(f"efficiency threshold must be in [0, 1] and factor in (0, 1], got "
                             f"{self.efficiency_threshold}, {self.efficiency_factor}")
        if set(self.p99_metrics) - {"ttft", "tpot"}:
            raise ValueError(f"p99_metrics must be among ('ttft', 'tpot'), got "
                             f"{self.p99_metrics}")
        if self.p99_fallback not in P99_FALLBACKS:
            raise ValueError(f"p99_fallback must be one of {P99_FALLBACKS}, got "
                             f"{self.p99_fallback!r}")
        if self.p99_floor_cap < 1:
            raise ValueError(f"p99_floor_cap must be >= 1, got {self.p99_floor_cap}")
        if not self.p99_long_ratio >= 1:
            raise ValueError(f"p99_long_ratio must be >= 1, got {self.p99_long_ratio}")
        if not self.p99_surge_ratio >= 0:
            raise ValueError(f"p99_surge_ratio must be >= 0, got {self.p99_surge_ratio}")
        if self.p99_recover_step < 1:
            raise ValueError(f"p99_recover_step must be >= 1, got {self.p99_recover_step}")
        if not 0 < self.tpot_fit_margin <= 2:
            raise ValueError(f"tpot_fit_margin must be in (0, 2], got {self.tpot_fit_margin}")
        if not 0 <= self.tpot_fit_spread <= 10:
            raise ValueError(f"tpot_fit_spread must be in [0, 10], got {self.tpot_fit_spread}")
        if self.over_length not in ("truncate", "reject"):
            raise ValueError(f"over_length must be 'truncate' or 'reject', got "
                             f"{self.over_length!r}")

    @property
    def max_cap(self) -> int:
        return self.ladder[-1]


@dataclass(frozen=True)
class Override:
    """One rule lowering (or fixing) one bucket's cap or pool, or the total.

    :param rule: the rule's name (one of ``RULES``).
    :param bucket: bucket index, ``None`` for a deployment-wide effect (the total cap).
    :param before: value proposed.
    :param after: value enforced.
    """

    rule: str
    bucket: int | None
    before: int | str | None
    after: int | str | None


@dataclass
class GuardState:
    """What the guard remembers between ticks (exposed for observation flags).

    A ``*_limit`` holds one limit per bucket (``None``: no limit on that bucket), a
    ``*_total`` the limit on the total (``None``: none). ``ceiling_lowered`` holds the caps
    and total given out at the last tick and the same before the ``tpot_fit`` ceiling, when
    the ceiling lowered them: the rules that scale what is in force start from the latter.
    """

    kv_high_since_s: float | None = None
    kv_high_halvings: int = 0
    kv_high_limit: tuple[int | None, ...] | None = None
    kv_high_total: int | None = None
    p99_active: bool = False
    p99_ok_since_s: float | None = None
    p99_decreased_at_s: float | None = None
    p99_limit: tuple[int | None, ...] | None = None
    p99_total: int | None = None
    efficiency_active: bool = False
    warmup_active: bool = False
    kv_budget_blocked: bool = False
    tpot_fit_total: int | None = None
    tpot_fit_slowdown: float = 1.0
    tpot_fit_pool_totals: tuple[tuple[str, int], ...] = ()
    ceiling_lowered: tuple[tuple[int | None, ...], int | None, tuple[int | None, ...],
                           int | None] | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))


def _scale(values: Sequence[int | None], fn: Callable[[int], int]) -> tuple[int | None, ...]:
    """``fn`` applied to every limit; ``None`` (no limit) stays ``None``."""
    return tuple(None if v is None else fn(v) for v in values)



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
        self._trim = self._new_trim((512.0, 1536.0, 3072.0, 6144.0))
        self._tpot_fits: dict[str, TpotFit] = {}
        self._fit_key: tuple[object, ...] | None = None
        self._traffic = TrafficMeans(TRAFFIC_TAU_S)
        self._calibrations: dict[str, FitCalibration] = {}

    def reset(self, info: DeploymentInfo) -> None:
        """Start of a run: forget all state.

        :raises ValueError: the ``tpot_fit`` rule is on and the deployment's GPU or model is
            not a known profile.
        """
        self.state = GuardState()
        self._pools = info.pool_names
        self._n_buckets = len(info.buckets)
        self._sla_ttft_s = info.sla.ttft_s
        self._sla_tpot_s = info.sla.tpot_s
        self._cold_start = info.cold_start
        self._trim = self._new_trim(nominal_lengths(info))
        self._traffic.reset()
        self._tpot_fits = self._fits_for(info) if self.config.tpot_fit else {}
        self._calibrations = {pool: FitCalibration(TRAFFIC_TAU_S) for pool in self._tpot_fits}

    def _fits_for(self, info: DeploymentInfo) -> dict[str, TpotFit]:
        # kept across runs of the same deployment and SLA: their memos outlive an episode
        pools = info.pool_names if self.config.tpot_fit_per_pool else info.pool_names[:1]
        key = (info.gpu, info.model, pools, info.max_num_batched_tokens,
               info.default_max_num_seqs, info.sla.tpot_s * self.config.tpot_fit_margin)
        if self._fit_key != key or not self._tpot_fits:
            self._tpot_fits = {pool: TpotFit.for_deployment(info, key[-1], pool)
                               for pool in pools}
            self._fit_key = key
        return self._tpot_fits

    def _new_trim(self, lengths: tuple[float, ...]) -> ProportionalTrim:
        cfg = self.config
        return ProportionalTrim(lengths, self._sla_tpot_s, cfg.p99_long_ratio,
                                cfg.p99_recover_step, cfg.p99_hold_s, cfg.p99_cooldown_s,
                                cfg.max_total_cap, cfg.p99_surge_ratio)

    @property
    def overrides_total(self) -> int:
        return sum(self.state.counts.values())

    def fallback_action(self) -> ControlAction:
        """Safe caps when no observation can be had (e.g. a metrics scrape failed)."""
        cfg = self.config
        cap = max(1, min(cfg.warmup_start_cap, cfg.max_cap))
        return ControlAction((cap,) * self._n_buckets, (self._pools[0],) * self._n_buckets)

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
        caps, total, pools = self._sanitize(proposed, overrides)
        t = stats.time_s if stats is not None and math.isfinite(stats.time_s) else 0.0
        t = max(t, 0.0)
        in_force, in_total = self._in_force(stats, caps, total)

        # warm-up ramp
        self.state.warmup_active = False
        if cfg.warmup and self._cold_start and t < cfg.warmup_s:
            steps = int(t // cfg.warmup_step_s) if cfg.warmup_step_s > 0 else 0
            limit = min(cfg.max_cap, cfg.warmup_start_cap + cfg.warmup_step * steps)
            self.state.warmup_active = True
            per_bucket = tuple(None if c is None else limit for c in caps)
            caps, total = self._limit(caps, total, per_bucket, limit, "warmup", overrides)

        if stats is not None:
            self._trim.observe(stats)
            if cfg.kv_high:
                caps, total = self._kv_high(stats, t, caps, total, in_force, in_total,
                                            overrides)
            if cfg.p99:
                caps, total = self._p99(stats, t, caps, total, in_force, in_total, overrides)
            if cfg.efficiency:
                caps, total = self._efficiency(stats, caps, total, in_force, in_total,
                                               overrides)
            before_ceiling: tuple[Caps, int | None] | None = None
            if self._tpot_fits:
                before_ceiling = (list(caps), total)
                caps, total = self._tpot_fit_rule(stats, caps, total, overrides)
            self.state.kv_budget_blocked = (bool(stats.kv_budget_blocked)
                                            and cfg.kv_budget is not None)
            if self.state.kv_budget_blocked:
                overrides.append(Override("kv_budget", None, None, None))

        for o in overrides:
            self.state.counts[o.rule] += 1
        caps = self._caps_under(caps, total)
        self.state.ceiling_lowered = None
        if stats is not None and before_ceiling is not None:
            unceiled = (self._caps_under(*before_ceiling), before_ceiling[1])
            if unceiled != (caps, total):
                self.state.ceiling_lowered = (tuple(caps), total, tuple(unceiled[0]),
                                              unceiled[1])
        assert len(caps) == n
        pool_ceilings = () if total is None or stats is None else tuple(
            (pool, cap) for pool, cap in self.state.tpot_fit_pool_totals if cap < total)
        return ControlAction(tuple(caps), tuple(pools), total, pool_ceilings), overrides

    def _caps_under(self, caps: Caps, total: int | None) -> Caps:
        """The bucket caps as given out under ``total``."""
        if total is None:
            return list(caps)
        # Uncapped buckets would go straight into the engines, past the KV budget: with one,
        # cap them at the total instead (the same limit, through admission and its budget).
        # A limit set against a total that a later rule lowered (an uncapped bucket trimmed
        # to 170 of 171, then the ceiling at 169) is bound by the total alone.
        uncapped = total if self.config.kv_budget is not None else None
        return [uncapped if c is None else min(c, total) for c in caps]

    # ------------------------------------------------------------------ rules
    def _sanitize(self, proposed: ControlAction | None,
                  overrides: list[Override]) -> tuple[Caps, int | None, list[str]]:
        cfg = self.config
        n = self._n_buckets
        if proposed is None or len(proposed.caps) != n:
            overrides.append(Override("sanitize", None, None, cfg.warmup_start_cap))
            return [min(cfg.max_cap, cfg.warmup_start_cap)] * n, None, [self._pools[0]] * n
        total = proposed.max_num_seqs
        if total is not None:
            safe_total = min(max(int(total), 1), cfg.max_total_cap)
            if safe_total != total:
                overrides.append(Override("sanitize", None, total, safe_total))
            total = safe_total
        caps: Caps = []
        pools: list[str] = []
        for b, (cap, pool) in enumerate(zip(proposed.caps, proposed.pools, strict=True)):
            safe_cap: int | None
            if cap is None:  # within a total: unlimited; else the original ladder max
                safe_cap = None if total is not None else cfg.max_cap
            else:
                safe_cap = min(max(int(cap), 1), cfg.max_cap)
            if safe_cap != cap:
                overrides.append(Override("sanitize", b, cap, safe_cap))
            safe_pool = pool if pool in self._pools or pool == ANY_POOL else self._pools[0]
            if safe_pool != pool:
                overrides.append(Override("sanitize", b, pool, safe_pool))
            caps.append(safe_cap)
            pools.append(safe_pool)
        return caps, total, pools

    def _in_force(self, stats: DeploymentStats | None, caps: Caps,
                  total: int | None) -> tuple[Caps, int | None]:
        """The caps and total of the action in force during the last tick (an uncapped
        bucket counts as the ladder max unless a total was in force)."""
        if stats is None or len(stats.action.caps) != self._n_buckets:
            return list(caps), total
        in_caps, in_total = stats.action.caps, stats.action.max_num_seqs
        lowered = self.state.ceiling_lowered
        if lowered is not None and lowered[:2] == (in_caps, in_total):
            # the tpot_fit ceiling is recomputed every tick: scaling it would compound a
            # halving with it (the module docstring's tpot_fit entry)
            in_caps, in_total = lowered[2], lowered[3]
        if in_total is not None:
            return list(in_caps), in_total
        return [self.config.max_cap if c is None else c for c in in_caps], None

    def _limit(self, caps: Caps, total: int | None, limit: Sequence[int | None],
               limit_total: int | None, rule: str,
               overrides: list[Override]) -> tuple[Caps, int | None]:
        out: Caps = []
        for b, (cap, lim) in enumerate(zip(caps, limit, strict=True)):
            # an uncapped bucket is bound by the total alone: a limit at or above it is none
            unbound = total if cap is None else cap
            if lim is not None and (unbound is None or unbound > lim):
                overrides.append(Override(rule, b, cap, lim))
                cap = lim
            out.append(cap)
        if limit_total is not None and total is not None and total > limit_total:
            overrides.append(Override(rule, None, total, limit_total))
            total = limit_total
        return out, total

    def _kv_high(self, stats: DeploymentStats, t: float, caps: Caps, total: int | None,
                 in_force: Caps, in_total: int | None,
                 overrides: list[Override]) -> tuple[Caps, int | None]:
        cfg = self.config
        st = self.state
        usage = stats.kv_cache_usage_max
        high = not (usage <= cfg.kv_high_threshold)  # NaN counts as high
        if not high:
            st.kv_high_since_s, st.kv_high_halvings = None, 0
            st.kv_high_limit, st.kv_high_total = None, None
            return caps, total
        if st.kv_high_since_s is None:
            tick = stats.tick_s if 0.0 < stats.tick_s <= t else 0.0  # NaN, < 0, > t: none
            st.kv_high_since_s = t - tick
        held = t - st.kv_high_since_s
        due = int(held // cfg.kv_high_duration_s) if cfg.kv_high_duration_s > 0 else 1
        if due > st.kv_high_halvings:
            base = st.kv_high_limit or tuple(in_force)
            base_total = st.kv_high_total if st.kv_high_limit is not None else in_total
            st.kv_high_limit = _scale(base, lambda c: max(1, c // 2))
            st.kv_high_total = None if base_total is None else max(1, base_total // 2)
            st.kv_high_halvings = due
        if st.kv_high_limit is None:
            return caps, total
        return self._limit(caps, total, st.kv_high_limit, st.kv_high_total, "kv_high",
                           overrides)

    def _p99(self, stats: DeploymentStats, t: float, caps: Caps, total: int | None,
             in_force: Caps, in_total: int | None,
             overrides: list[Override]) -> tuple[Caps, int | None]:
        cfg = self.config
        st = self.state
        w = stats.window
        overshoot = 0.0  # P99 / limit of the worst watched metric over its limit
        if "tpot" in cfg.p99_metrics and w.tpot_p99_all_s > self._sla_tpot_s:
            overshoot = w.tpot_p99_all_s / self._sla_tpot_s
        if "ttft" in cfg.p99_metrics and w.ttft_p99_all_s > self._sla_ttft_s:
            overshoot = max(overshoot, w.ttft_p99_all_s / self._sla_ttft_s)
        if cfg.p99_fallback == "proportional":
            st.p99_limit, st.p99_total = self._trim.update(stats, t, overshoot, caps, total,
                                                           in_force, in_total)
            st.p99_active = st.p99_limit is not None or st.p99_total is not None
            if st.p99_active and st.p99_limit is None:
                st.p99_limit = (None,) * self._n_buckets
        elif overshoot > 0:
            cooling = (st.p99_active and st.p99_decreased_at_s is not None
                       and t - st.p99_decreased_at_s < cfg.p99_cooldown_s)
            if not cooling:
                if cfg.p99_fallback == "no_batching":
                    st.p99_limit, st.p99_total = (1,) * self._n_buckets, 1
                else:
                    fresh = not (st.p99_active and st.p99_limit)
                    base = tuple(in_force) if fresh or st.p99_limit is None else st.p99_limit
                    base_total = in_total if fresh else st.p99_total
                    floor = cfg.p99_floor_cap
                    st.p99_limit = _scale(base, lambda c: max(min(floor, c), c // 2))
                    st.p99_total = (None if base_total is None
                                    else max(min(floor, base_total), base_total // 2))
                st.p99_decreased_at_s = t
            st.p99_active, st.p99_ok_since_s = True, None
        elif st.p99_active:
            if st.p99_ok_since_s is None:
                st.p99_ok_since_s = t
            if t - st.p99_ok_since_s >= cfg.p99_hold_s:
                st.p99_active, st.p99_ok_since_s = False, None
                st.p99_limit, st.p99_total, st.p99_decreased_at_s = None, None, None
        if st.p99_active and st.p99_limit is not None:
            return self._limit(caps, total, st.p99_limit, st.p99_total, "p99", overrides)
        return caps, total

    def _efficiency(self, stats: DeploymentStats, caps: Caps, total: int | None,
                    in_force: Caps, in_total: int | None,
                    overrides: list[Override]) -> tuple[Caps, int | None]:
        cfg = self.config
        efficiency = stats.batch_efficiency
        if math.isnan(efficiency):  # nothing computed in the tick: nothing wasted
            efficiency = 1.0
        self.state.efficiency_active = not (efficiency >= cfg.efficiency_threshold)
        if not self.state.efficiency_active:
            return caps, total
        factor = cfg.efficiency_factor
        limit = _scale(in_force, lambda c: max(1, int(c * factor)))
        limit_total = None if in_total is None else max(1, int(in_total * factor))
        return self._limit(caps, total, limit, limit_total, "efficiency", overrides)

    def _tpot_fit_rule(self, stats: DeploymentStats, caps: Caps, total: int | None,
                       overrides: list[Override]) -> tuple[Caps, int | None]:
        tick = stats.tick_s if stats.tick_s > 0 and math.isfinite(stats.tick_s) else 1.0
        self._traffic.update(stats, tick)
        cfg = self.config
        inputs = self._traffic.fit_inputs(len(stats.engines))
        by_pool: dict[str, int] = {}
        slowdowns: list[float] = []
        spread = (spread_slowdown(inputs[2], cfg.tpot_fit_spread) if cfg.tpot_fit_spread > 0
                  else None)
        for pool, fit in self._tpot_fits.items():
            slowdown = 1.0
            if cfg.tpot_fit_calibrated:
                calibration = self._calibrations[pool]
                calibration.update(fit, stats, inputs, tick, pool)
                slowdown = calibration.slowdown
            if spread is not None:
                slowdown = quantised_slowdown(slowdown * spread)
            slowdowns.append(slowdown)
            # a pool where not even one sequence fits holds nothing (the module docstring)
            if largest := fit.largest_total(*inputs, cfg.max_total_cap, slowdown):
                by_pool[pool] = largest
        # the total is the largest any pool runs; admission lowers it for the other pools
        largest = max(by_pool.values(), default=0)
        self.state.tpot_fit_total = largest or None
        self.state.tpot_fit_slowdown = slowdowns[0]
        self.state.tpot_fit_pool_totals = tuple((p, n) for p, n in by_pool.items()
                                                if n < largest)
        if not largest:
            return caps, total
        # under a total the total is the bound; without one each cap is (per bucket: the
        # engine may still run up to buckets x largest)
        per_bucket = (None if total is not None else largest,) * self._n_buckets
        return self._limit(caps, total, per_bucket, largest, "tpot_fit", overrides)

    def flags(self) -> tuple[float, ...]:
        """Rule activity as 0/1 floats (warmup, kv_high, p99, efficiency, kv_budget) for the
        observation."""
        st = self.state
        return (float(st.warmup_active), float(st.kv_high_limit is not None),
                float(st.p99_active), float(st.efficiency_active), float(st.kv_budget_blocked))
