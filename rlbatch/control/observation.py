"""The observation vector: built from one DeploymentStats snapshot, for PPO and the sidecar.

The env and the sidecar both call :class:`ObservationBuilder`; nothing else builds
observations. Every feature is finite and clipped to ``[0, CLIP]``; NaN readings become 0
(latency: "no completions in the window") or 1 (memory: "assume full").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rlbatch.control.tpot_fit import TRAFFIC_TAU_S, TpotFit, TrafficMeans
from rlbatch.control.types import DeploymentInfo, DeploymentStats
from rlbatch.profiles.capacity import REFERENCE_OUTPUT_TOKENS, REFERENCE_PROMPT_TOKENS

CLIP = 10.0

PER_BUCKET_FEATURES: tuple[str, ...] = (
    "queue_len",         # log1p(queued) / log1p(1000)
    "arrival_rate",      # log1p(arrivals per s) / log1p(100)
    "running",           # requests inside engines / ladder max
    "cap",               # cap in force / ladder max
    "pool",              # pool in force: index / (pools - 1); any pool: 0.5; 0 with one pool
    "ttft_p99",          # window TTFT P99 / SLA TTFT
    "tpot_p99",          # window TPOT P99 / SLA TPOT
    "oldest_wait",       # wait of the queue head / SLA TTFT
)
GLOBAL_FEATURES: tuple[str, ...] = (
    "kv_cache_usage",    # max over engines, fraction
    "kv_committed",      # committed KV (prompt + max output) / pool, max over engines
    "gpu_memory_used",   # used / total, max over engines
    "preemption_rate",   # log1p(preemptions per s)
    "throughput",        # log1p(output tokens per s) / log1p(10000)
    "batch_efficiency",  # 1 - recomputed / computed tokens in the tick
    "sla_attainment",    # window completions meeting the SLA / completions (1 if none)
    "warmup_progress",   # time / warm-up length, clipped to 1
    "guard_warmup",      # guard flags: 0/1
    "guard_kv_high",
    "guard_p99",
    "guard_efficiency",
    "guard_kv_budget",
)


TREND_PER_BUCKET_FEATURES: tuple[str, ...] = (
    "arrival_rate_ema",  # log1p(smoothed arrivals per s) / log1p(100)
    "departure_rate_ema",  # log1p(smoothed completions + rejections per s) / log1p(100)
    "queue_growth",      # 0.5 + 0.5 tanh(smoothed d(queue)/dt / 5 per s): 0.5 = steady
)
TREND_GLOBAL_FEATURES: tuple[str, ...] = (
    "running_total",     # requests inside engines, all buckets / TOTAL_NORM
    "total_cap",         # engine-wide cap in force (max_num_seqs) / TOTAL_NORM
    "load_ratio",        # log1p(smoothed arrivals / smoothed departures)
    "doomed_rate",       # log1p(smoothed requests past their TTFT deadline per s)
)
CAPACITY_GLOBAL_FEATURES: tuple[str, ...] = (
    "capacity",          # log1p(reference capacity, requests per s) / log1p(100)
    "kv_reference_seqs",  # reference requests one engine's KV pool holds / TOTAL_NORM
)
TRAFFIC_GLOBAL_FEATURES: tuple[str, ...] = (
    "prefill_share",     # smoothed prompt tokens / (prompt + output tokens) computed
    "output_tokens",     # log1p(smoothed mean output tokens of finished requests) / log1p(2048)
    "ttft_p99_all",      # window TTFT P99, all buckets / SLA TTFT
    "tpot_p99_all",      # window TPOT P99, all buckets / SLA TPOT
    "busy",              # engine time in iterations / tick, mean over engines
    "sla_ttft",          # the SLA's TTFT / 5 s
    "sla_tpot",          # the SLA's TPOT / 0.15 s
)
"""What kind of traffic is served and against which SLA (version 5): a prefill-heavy stream
(code completion: long prompts, a few output tokens) slows every decode step of a big batch,
a decode-heavy one (chat) needs the batch; the SLA itself is an input, so one policy serves
any SLA within its trained range."""
SLA_TTFT_NORM_S = 5.0
SLA_TPOT_NORM_S = 0.15
OUTPUT_TOKENS_NORM = 2048.0
PREFIX_GLOBAL_FEATURES: tuple[str, ...] = (
    "prefix_hit_rate",   # smoothed prompt tokens found in the prefix cache / looked up
)
"""How much of the prompts the engines find cached (version 6): long prompts that share a
prefix (RAG over one corpus, multi-turn chat) cost little prefill, so the batch that suits
them is not the one that suits long prompts computed in full (code completion)."""
TPOT_FIT_GLOBAL_FEATURES: tuple[str, ...] = (
    "tpot_fit_total",    # share of the total ladder whose predicted TPOT meets the SLA
)
"""Where the TPOT limit binds (version 7): the step-time model of the deployment's profile
predicts one engine's iteration time with N sequences decoding at the traffic's mean context
while the prefill computed per second stays what it is (:mod:`rlbatch.control.tpot_fit`);
the feature is the share of :data:`~rlbatch.control.tpot_fit.TPOT_FIT_LADDER` whose
prediction stays within the SLA's TPOT (0: not even the smallest total). A big batch of long
contexts (RAG, reports) misses a tight TPOT where a chat batch of the same size meets it; the
teacher sees that in its rollouts, the other features only once the batch has already
missed."""
OBS_VERSIONS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)
"""1: the snapshot features; 2: plus trends (smoothed rates, queue growth, totals), which
need state across ticks; 3: version 2's features with every rate, queue and throughput in
units of the deployment's reference capacity (:mod:`rlbatch.profiles.capacity`) instead of
absolute, plus the capacity itself, so that one policy reads load the same way on every
GPU and model; 4: version 3 without the action in force (:data:`ACTION_FEATURES`); 5:
version 4 plus :data:`TRAFFIC_GLOBAL_FEATURES` (the traffic's kind and the SLA); 6: version 5
plus :data:`PREFIX_GLOBAL_FEATURES`; 7: version 6 plus :data:`TPOT_FIT_GLOBAL_FEATURES`, which
needs the deployment's GPU and model profiles."""
ACTION_FEATURES: tuple[str, ...] = ("cap", "pool", "total_cap")
"""Features that restate the action in force (per bucket ``cap`` and ``pool``, and the
``total_cap``), which version 4 leaves out. A student cloned from a teacher whose actions
persist for many ticks learns to copy the action in force, which predicts the next label
best almost everywhere and worst where it matters: where the teacher changes its mind, so
the student follows it late (the copycat problem of behaviour cloning from histories)."""
TOTAL_NORM = 256.0
TREND_TAU_S = TRAFFIC_TAU_S
"""Time constant of the smoothed rates: about the latency window (the TPOT fit's too)."""


def _restates_action(name: str) -> bool:
    return name.rpartition("/")[2] in ACTION_FEATURES


def observation_size(num_buckets: int, version: int = 1) -> int:
    if version >= 7:
        return observation_size(num_buckets, 6) + len(TPOT_FIT_GLOBAL_FEATURES)
    if version >= 6:
        return observation_size(num_buckets, 5) + len(PREFIX_GLOBAL_FEATURES)
    if version >= 5:
        return observation_size(num_buckets, 4) + len(TRAFFIC_GLOBAL_FEATURES)
    if version >= 4:
        n_per_bucket = sum(f in ACTION_FEATURES for f in PER_BUCKET_FEATURES)
        n_global = sum(f in ACTION_FEATURES for f in (*GLOBAL_FEATURES, *TREND_GLOBAL_FEATURES))
        return observation_size(num_buckets, 3) - num_buckets * n_per_bucket - n_global
    size = num_buckets * len(PER_BUCKET_FEATURES) + len(GLOBAL_FEATURES)
    if version >= 2:
        size += num_buckets * len(TREND_PER_BUCKET_FEATURES) + len(TREND_GLOBAL_FEATURES)
    if version >= 3:
        size += len(CAPACITY_GLOBAL_FEATURES)
    return size


def feature_names(bucket_names: tuple[str, ...], version: int = 1) -> list[str]:
    """Name of every observation index, in order."""
    if version >= 7:
        return feature_names(bucket_names, 6) + list(TPOT_FIT_GLOBAL_FEATURES)
    if version >= 6:
        return feature_names(bucket_names, 5) + list(PREFIX_GLOBAL_FEATURES)
    if version >= 5:
        return feature_names(bucket_names, 4) + list(TRAFFIC_GLOBAL_FEATURES)
    if version >= 4:
        return [n for n in feature_names(bucket_names, 3) if not _restates_action(n)]
    names = [f"{b}/{f}" for b in bucket_names for f in PER_BUCKET_FEATURES]
    names += list(GLOBAL_FEATURES)
    if version >= 2:
        names += [f"{b}/{f}" for b in bucket_names for f in TREND_PER_BUCKET_FEATURES]
        names += list(TREND_GLOBAL_FEATURES)
    if version >= 3:
        names += list(CAPACITY_GLOBAL_FEATURES)
    return names


@dataclass(eq=False)
class ObservationBuilder:
    """Turns stats into the normalised float32 observation.

    :param info: the deployment (buckets, pools, SLA).
    :param max_cap: the cap ladder's top (normaliser for caps and running counts).
    :param warmup_s: warm-up length (normaliser for the progress feature).
    :param version: feature set (:data:`OBS_VERSIONS`); version 2 keeps smoothed rates, so
        one builder serves one run: call :meth:`reset` at its start.
    :raises ValueError: an unknown version, or version 3 without the deployment's capacity.
    """

    info: DeploymentInfo
    max_cap: int
    warmup_s: float = 300.0
    version: int = 1
    _trend: dict[str, list[float]] = field(default_factory=dict, init=False, repr=False,
                                           compare=False)
    _sla: list[float] = field(default_factory=list, init=False, repr=False, compare=False)
    _capacity: list[float] = field(default_factory=list, init=False, repr=False,
                                   compare=False)
    _keep: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _tpot_fit: TpotFit | None = field(default=None, init=False, repr=False, compare=False)
    _means: TrafficMeans = field(default_factory=lambda: TrafficMeans(TREND_TAU_S), init=False,
                                 repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.version not in OBS_VERSIONS:
            raise ValueError(f"observation version must be one of {OBS_VERSIONS}, got "
                             f"{self.version}")
        if self.version >= 3 and not self.info.capacity_rps > 0:
            raise ValueError(
                "observation version 3 states load in units of the deployment's reference "
                "capacity, which is unknown here (DeploymentInfo.capacity_rps = 0): give a "
                "calibrated profile (live engines) or --capacity-rps / profile names for "
                "--gpu and --model (sidecar)")
        if self.version >= 3:  # constant for the deployment: computed once
            kv_tokens = max(self.info.num_kv_blocks.values(), default=0) * self.info.block_size
            seqs = kv_tokens / (REFERENCE_PROMPT_TOKENS + REFERENCE_OUTPUT_TOKENS)
            self._capacity = [
                min(math.log1p(self.info.capacity_rps) / math.log1p(100.0), CLIP),
                min(seqs / TOTAL_NORM, CLIP)]
        if self.version >= 5:  # the SLA is constant for the run too
            self._sla = [self.info.sla.ttft_s / SLA_TTFT_NORM_S,
                         self.info.sla.tpot_s / SLA_TPOT_NORM_S]
        if self.version >= 7:
            self._tpot_fit = TpotFit.for_deployment(self.info)
        if self.version >= 4:  # built in version 3's layout, then the action dropped
            names = feature_names(self.info.buckets.names, 3)
            self._keep = np.array([i for i, n in enumerate(names) if not _restates_action(n)])
        self.reset()

    @property
    def size(self) -> int:
        return observation_size(len(self.info.buckets), self.version)

    def reset(self) -> None:
        """Forget the smoothed rates (start of a run)."""
        n_b = len(self.info.buckets)
        self._trend.clear()
        self._trend.update(arrivals=[0.0] * n_b, departures=[0.0] * n_b,
                           growth=[0.0] * n_b, queued=[0.0] * n_b, doomed=[0.0],
                           prefix_queries=[0.0], prefix_hits=[0.0])
        self._means.reset()

    def initial(self) -> np.ndarray:
        """Observation before the first tick: idle deployment, nothing measured."""
        obs = np.zeros(observation_size(len(self.info.buckets), min(self.version, 3)),
                       dtype=np.float32)
        g = len(self.info.buckets) * len(PER_BUCKET_FEATURES)
        obs[g + GLOBAL_FEATURES.index("batch_efficiency")] = 1.0
        obs[g + GLOBAL_FEATURES.index("sla_attainment")] = 1.0
        if self.version >= 2:
            total = self.info.default_max_num_seqs
            t0 = g + len(GLOBAL_FEATURES) + len(self.info.buckets) * len(
                TREND_PER_BUCKET_FEATURES)
            obs[t0 + TREND_GLOBAL_FEATURES.index("total_cap")] = min(total / TOTAL_NORM, CLIP)
        if self.version >= 3:
            obs[-len(CAPACITY_GLOBAL_FEATURES):] = self._capacity
        obs = obs if self._keep is None else obs[self._keep]
        if self.version >= 5:
            traffic = [0.0] * (len(TRAFFIC_GLOBAL_FEATURES) - len(self._sla)) + self._sla
            obs = np.concatenate([obs, np.clip(traffic, 0.0, CLIP).astype(np.float32)])
        if self.version >= 6:  # nothing looked up yet: nothing found cached
            obs = np.concatenate([obs, np.zeros(len(PREFIX_GLOBAL_FEATURES), np.float32)])
        if self._tpot_fit is not None:  # an idle engine at the reference lengths
            obs = np.concatenate([obs, np.array([self._tpot_fit.share(
                0.0, REFERENCE_PROMPT_TOKENS, REFERENCE_OUTPUT_TOKENS)], np.float32)])
        return obs

    def _rate(self, per_s: float) -> float:
        """A rate as a feature: absolute (log-scaled) before version 3, else a fraction of the
        deployment's capacity."""
        per_s = max(per_s, 0.0)
        if self.version >= 3:
            return per_s / self.info.capacity_rps
        return math.log1p(per_s) / math.log1p(100.0)

    def build(self, stats: DeploymentStats, guard_flags: tuple[float, ...]) -> np.ndarray:
        info = self.info
        n_b = len(info.buckets)
        tick = stats.tick_s if stats.tick_s > 0 else 1.0
        sla = info.sla
        pools = info.pool_names
        running = stats.in_engines_per_bucket
        out: list[float] = []
        w = stats.window
        relative = self.version >= 3
        # Version 3: a queue as the SLA TTFTs the deployment needs to serve it.
        queue_unit = info.capacity_rps * sla.ttft_s if relative else 1.0
        log_q = math.log1p(100.0) if relative else math.log1p(1000.0)
        for b in range(n_b):
            cap = stats.action.caps[b]
            pool = stats.action.pools[b]
            out.append(math.log1p(max(stats.queued[b], 0) / queue_unit) / log_q)
            out.append(self._rate(stats.arrived[b] / tick))
            out.append(running[b] / self.max_cap)
            out.append((self.max_cap if cap is None else cap) / self.max_cap)
            out.append(route_feature(pools, pool))
            out.append(w.ttft_p99_s[b] / sla.ttft_s)
            out.append(w.tpot_p99_s[b] / sla.tpot_s)
            out.append((stats.oldest_wait_s[b] if stats.oldest_wait_s else 0.0) / sla.ttft_s)
        preempt = stats.preemptions / tick
        decode = stats.decode_tokens / tick
        efficiency = stats.batch_efficiency
        completed = sum(w.completed)
        out.extend([
            stats.kv_cache_usage_max,
            stats.kv_committed_max,
            stats.gpu_memory_used_max,
            math.log1p(max(preempt, 0.0)),
            (max(decode, 0.0) / (info.capacity_rps * REFERENCE_OUTPUT_TOKENS) if relative
             else math.log1p(max(decode, 0.0)) / math.log1p(10000.0)),
            1.0 if math.isnan(efficiency) else efficiency,  # nothing computed: nothing wasted
            sum(w.sla_met) / completed if completed else 1.0,
            min(stats.time_s / self.warmup_s, 1.0) if self.warmup_s > 0 else 1.0,
            *guard_flags,
        ])
        if self.version >= 2:
            out.extend(self._trends(stats, tick))
        if self.version >= 3:
            out.extend(self._capacity)
        n_kept = len(out)
        if self.version >= 5:
            out.extend(self._traffic(stats, tick))
        if self.version >= 6:
            out.append(self._prefix_hit_rate(stats, tick))
        if self._tpot_fit is not None:
            out.append(self._tpot_fit_share(stats))
        raw = np.array(out, dtype=np.float64)
        # Memory readings that are not numbers must not look like an empty cache.
        g = n_b * len(PER_BUCKET_FEATURES)
        memory = raw[g:g + 3]
        memory[np.isnan(memory)] = 1.0
        np.nan_to_num(raw, copy=False, nan=0.0, posinf=CLIP, neginf=0.0)
        obs = np.clip(raw, 0.0, CLIP).astype(np.float32)
        if self._keep is None:
            return obs
        return np.concatenate([obs[:n_kept][self._keep], obs[n_kept:]])

    def _traffic(self, stats: DeploymentStats, tick: float) -> list[float]:
        means = self._means
        means.update(stats, tick)
        computed = means.prefill_per_s + means.decode_per_s
        mean_output = (means.outputs_per_s / means.finished_per_s
                       if means.finished_per_s > 1e-9 else 0.0)
        busy = [min(es.busy_s / tick, 1.0) for es in stats.engines]
        sla = self.info.sla
        return [means.prefill_per_s / computed if computed > 1e-9 else 0.0,
                math.log1p(mean_output) / math.log1p(OUTPUT_TOKENS_NORM),
                stats.window.ttft_p99_all_s / sla.ttft_s,
                stats.window.tpot_p99_all_s / sla.tpot_s,
                sum(busy) / len(busy) if busy else 0.0,
                *self._sla]

    @property
    def tpot_fit(self) -> TpotFit | None:
        """Version 7's TPOT predictor (None below version 7)."""
        return self._tpot_fit

    def tpot_fit_inputs(self, engines: int = 1) -> tuple[float, float, float]:
        """What the TPOT fit reads after the last :meth:`build`
        (:meth:`~rlbatch.control.tpot_fit.TrafficMeans.fit_inputs`)."""
        return self._means.fit_inputs(engines)

    def _tpot_fit_share(self, stats: DeploymentStats) -> float:
        # reads the smoothed rates _traffic updated this tick
        assert self._tpot_fit is not None
        return self._tpot_fit.share(*self.tpot_fit_inputs(len(stats.engines)))

    def _prefix_hit_rate(self, stats: DeploymentStats, tick: float) -> float:
        # smoothed as a ratio of smoothed counts: a tick with one short lookup must not swing it
        tr = self._trend
        alpha = 1.0 - math.exp(-tick / TREND_TAU_S)
        queries = sum(max(es.prefix_cache_queries, 0) for es in stats.engines)
        hits = sum(max(es.prefix_cache_hits, 0) for es in stats.engines)
        tr["prefix_queries"][0] += alpha * (queries / tick - tr["prefix_queries"][0])
        tr["prefix_hits"][0] += alpha * (hits / tick - tr["prefix_hits"][0])
        if tr["prefix_queries"][0] <= 1e-9:
            return 0.0
        return min(tr["prefix_hits"][0] / tr["prefix_queries"][0], 1.0)

    def _trends(self, stats: DeploymentStats, tick: float) -> list[float]:
        tr = self._trend
        n_b = len(self.info.buckets)
        alpha = 1.0 - math.exp(-tick / TREND_TAU_S)
        finished = [0] * n_b
        for rec in stats.finished:
            finished[rec.bucket] += 1
        doomed = sum(stats.doomed)
        # Version 3: queue growth in units of capacity (5 per s is about the reference A100's).
        growth_unit = self.info.capacity_rps if self.version >= 3 else 5.0
        per_bucket: list[float] = []
        for b in range(n_b):
            arrivals = max(stats.arrived[b], 0) / tick
            departures = (finished[b] + max(stats.rejected[b], 0)) / tick
            growth = (stats.queued[b] - tr["queued"][b]) / tick
            tr["arrivals"][b] += alpha * (arrivals - tr["arrivals"][b])
            tr["departures"][b] += alpha * (departures - tr["departures"][b])
            tr["growth"][b] += alpha * (growth - tr["growth"][b])
            tr["queued"][b] = float(stats.queued[b])
            per_bucket += [self._rate(tr["arrivals"][b]), self._rate(tr["departures"][b]),
                           0.5 + 0.5 * math.tanh(tr["growth"][b] / growth_unit)]
        tr["doomed"][0] += alpha * (doomed / tick - tr["doomed"][0])
        total = stats.action.max_num_seqs or self.info.default_max_num_seqs
        arr, dep = sum(tr["arrivals"]), sum(tr["departures"])
        ratio = arr / dep if dep > 1e-6 else (CLIP if arr > 1e-6 else 1.0)
        return [*per_bucket, stats.running_total / TOTAL_NORM, total / TOTAL_NORM,
                math.log1p(ratio),
                (self._rate(tr["doomed"][0]) if self.version >= 3
                 else math.log1p(max(tr["doomed"][0], 0.0)))]


def route_feature(pools: tuple[str, ...], route: str) -> float:
    """A bucket's route as one number: the pool's index / (pools - 1), 0.5 for the least-loaded
    engine of any pool, 0 with one pool."""
    if len(pools) < 2:
        return 0.0
    if route in pools:
        return pools.index(route) / (len(pools) - 1)
    return 0.5
