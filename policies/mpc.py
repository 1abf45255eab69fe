"""``mpc``: a model-predictive controller over a digital twin of the deployment.

Every ``every_s`` seconds it forks its twin (:mod:`rlbatch.serving.twin`), replaces the
future arrivals by a replay of the arrivals it OBSERVED in the last ``window_s`` seconds
(shifted forward, tiled over the horizon: it never reads a future arrival), rolls each
candidate action ``horizon_s`` seconds forward and keeps the best; between decisions it holds
it. It sits behind the default guard like every rule controller; each candidate is rolled out
as the guard would let it through at the next tick (a copy of the guard, in its current state,
checks it against the last tick's stats), held over the horizon.

Candidates are :class:`~rlbatch.control.action_codec.TotalShareCodec` actions (a total cap,
what ``static:N`` sets, plus per-bucket shares of it), so a student can clone them exactly:

1. every total of ``totals`` (default 4..256 doubling) with no per-bucket cap;
2. the incumbent and its neighbours one step up and down the total ladder;
3. around the best of those: per-bucket trims (long-prompt buckets held to a share of the
   total) and the neighbouring totals of the codec's finer ladder;
4. with several pools, around the best: every bucket to the least-loaded engine of any pool
   (what the static caps do), and short / long buckets split between the pools.

Score of a rollout: requests that met the SLA (weighted per bucket by ``1 / attainment``
observed so far: requests finished in SLA over finished + late-queued, decayed, floored, so a
starving bucket's service counts more) minus those that missed it (finished late, refused, or
doomed at the horizon: no first token past the TTFT limit, or a TPOT already above the limit;
a request served from the FP8 pool counts 1.5% less, the reward's quality cost);
the queues left at the horizon are projected forward at the rate each bucket was served
(:func:`rollout_score`), so a cap that lets the backlog grow pays for it within a short horizon.

Fairness (``fair``, on by default): a candidate with per-bucket trims stays in the running
only if its rollouts miss, in every bucket, at most 2% of that bucket's decided requests (at
least one request) more than the same total and routes without trims
(:func:`~policies.mpc_candidates.fair_keys`); those untrimmed references are rolled out for
every candidate, so they join the candidates (up to five more rollouts a decision without
route splits). Trims may shed load where it costs the trimmed bucket nothing. Without this
rule, on a deployment with KV room to spare (an H100 or H200 serving Llama-3.1-8B), the best
60 s rollout was often a trim of the 1k-2k bucket, which starved it over the run (6% SLA
attainment against the best static's 78%; docs/notebook/BENCHMARKS-archive.md).

Choice: among candidates within ``switch_margin`` + 1% of the replayed requests of the best
score, the largest total (then the fewest trims); while requests already wait past the TTFT
limit the total never shrinks, unless most requests finish past the SLA's TPOT (then the batch
itself makes them late). Both rules come from Azure 0.75, where a smaller total scored a
little better over 60 s in a backlog and then let it grow for minutes (2.45 -> 3.14 goodput/s).
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.mpc_candidates import Key, fair_keys, splits, trims, untrimmed
from policies.mpc_score import score_rollout
from policies.rules import GuardedController
from rlbatch.control.action_codec import SHARE_LADDER, TOTAL_LADDER, TotalShareCodec
from rlbatch.control.discipline import PLAIN, AdmissionDiscipline, QueueOrder
from rlbatch.control.guard import GuardConfig
from rlbatch.control.types import (
    ControlAction,
    DeploymentInfo,
    DeploymentStats,
    balanced_route,
    meets_sla,
)
from rlbatch.request import Request
from rlbatch.serving.twin import StatsTwin, Twin, replay, roll_out
from rlbatch.settings import apply


@dataclass(frozen=True)
class MpcConfig:
    """Knobs of the controller.

    :param horizon_s: how far each candidate is rolled out.
    :param every_s: decision interval (the choice is held in between).
    :param window_s: observed arrivals replayed (the last ``window_s`` seconds).
    :param totals: the totals always tried (caps of ``static:N``).
    :param trims: also try per-bucket trims around the best total.
    :param attainment_floor: weights are ``1 / max(attainment, floor)``.
    :param memory_s: time constant of the observed attainment (decay).
    :param switch_margin: leave the incumbent only for a score higher by this many
        (weighted) requests.
    :param backlog: extra cost of a request left unfinished at the horizon (a candidate
        that drains a backlog beats one that lets it stand, even when both miss the same
        requests within the horizon).
    :param project_s: project the queues left at the horizon this far forward (see
        :func:`rollout_score`; 0: off).
    :param stress: also roll out on a busier stream (see ``_arrival_streams``) and
        average the two scores: a small cap that only survives the calm loses.
    :param stress_memory_s: how far back the busiest window is looked for.
    :param stress_rate: how much busier the stress stream is (see ``_arrival_streams``).
    :param tolerance: scores within this fraction of the replayed requests (plus
        ``switch_margin``) of the best count as ties.
    :param weigh_misses: fairness weights apply to misses too (default: to met requests
        only; see :func:`rollout_score`).
    :param no_shrink_when_late: while requests wait in admission past the TTFT limit, never
        lower the total (a smaller total looks fine over a short horizon, where every
        candidate misses the same queued requests, and then lets the backlog grow for
        minutes: measured on Azure 0.75).
    :param shrink_past_tpot: ``no_shrink_when_late`` gives way while most requests finish
        past the SLA's TPOT limit (over half of them, counted with the attainment's decay):
        the batch itself then makes them miss, and holding the total kept ``mpc`` at 256 for
        whole runs of long-context RAG at 1 s / 50 ms, every request late (0.00 goodput/s;
        the best constant, 24, 4.94). The window's TPOT P99 past the limit instead let the
        total go where the hold was right: Azure at 1.25x the knee on A100 / Llama-3.1-8B,
        5.68 -> 5.21 goodput/s.
    :param sticky: among ties keep the incumbent (default: the largest total).
    :param routing: with several pools, also try routes around the best candidate: every
        bucket to the least-loaded engine of any pool, and short / long buckets split between
        the pools (:func:`splits`). Off by default: every bucket keeps the route it starts
        with, the least-loaded engine of any pool. On two pools the splits win their 60 s
        rollouts and lose the run (they starved the 1k-2k bucket on held-back Azure:
        docs/notebook/BENCHMARKS-archive.md).
    :param fp8_cost: quality cost of a request served from the FP8 pool, in requests (the
        reward's ``w_fp8``, the guide's <= 1.5%).
    :param guarded: behind the guard (default); ``False`` applies the chosen candidate as
        it is, like ``static:N`` (for comparisons with the unguarded statics).
    :param fair: a candidate with per-bucket trims is kept only if, in its rollouts, no
        bucket misses more requests than under the same total without trims (what a static
        cap does) by more than ``fair_slack`` of that bucket's decided requests (at least
        ``fair_min_requests``): trims may shed load only where they cost the trimmed bucket
        nothing, so they cannot buy goodput by starving a bucket (the must-check compares
        every bucket with the best static's).
    :param fair_slack: see ``fair``.
    :param fair_min_requests: see ``fair``.
    """

    horizon_s: float = 60.0
    every_s: float = 10.0
    window_s: float = 60.0
    totals: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256)
    trims: bool = True
    attainment_floor: float = 0.1
    memory_s: float = 300.0
    switch_margin: float = 1.0
    guarded: bool = True
    backlog: float = 0.0
    project_s: float = 60.0
    stress: bool = False
    stress_memory_s: float = 600.0
    stress_rate: float = 1.25
    tolerance: float = 0.01
    sticky: bool = False
    weigh_misses: bool = False
    no_shrink_when_late: bool = True
    shrink_past_tpot: bool = True
    routing: bool = False
    fp8_cost: float = 0.015
    fair: bool = True
    fair_slack: float = 0.02
    fair_min_requests: float = 1.0

    def __post_init__(self) -> None:
        if not (self.horizon_s > 0 and self.every_s > 0 and self.window_s > 0):
            raise ValueError(f"horizon_s, every_s and window_s must be > 0, got "
                             f"{self.horizon_s}, {self.every_s}, {self.window_s}")
        if not self.totals or any(t not in TOTAL_LADDER for t in self.totals):
            raise ValueError(f"mpc totals must be on the codec's ladder {TOTAL_LADDER}, got "
                             f"{self.totals}")
        if not 0 < self.attainment_floor <= 1:
            raise ValueError(f"attainment_floor must be in (0, 1], got {self.attainment_floor}")
        if not (self.fair_slack >= 0 and self.fair_min_requests >= 0):
            raise ValueError(f"fair_slack and fair_min_requests must be >= 0, got "
                             f"{self.fair_slack}, {self.fair_min_requests}")


class MpcController(GuardedController):
    """The ``mpc`` controller (see the module docstring).

    :param config: its knobs.
    :param guard: the guard configuration (default guard).
    :param name: the command-line name.
    :param order: the order of admission's queues, in its rollouts as in the run (a teacher
        in the order its student serves in labels with the order's effect).
    """

    reports_proposals = True

    def __init__(self, config: MpcConfig | None = None, guard: GuardConfig | None = None,
                 name: str = "mpc", order: QueueOrder = "deadline") -> None:
        super().__init__(name, guard, order)
        self.config = config or MpcConfig()
        self.twin: Twin | None = None
        self._bound: Twin | None = None
        self.codec: TotalShareCodec | None = None
        self.incumbent: Key = (0, (), ())
        self.last_proposal: ControlAction | None = None
        self.last_scores: dict[Key, float] = {}
        self.last_near: list[Key] = []
        """The candidates the last decision counted as tied with the best (after the
        no-shrink rule): a student can be fitted to all of them (``--labels near``)."""
        self.last_missed: dict[Key, list[float]] = {}
        """Per candidate of the last decision, per bucket, the requests its rollouts missed
        (and ``last_decided``: met + missed), summed over the arrival streams."""
        self.last_decided: dict[Key, list[float]] = {}
        self.decision_s: list[float] = []
        self.choices: Counter[int] = Counter()
        self.route_choices: Counter[str] = Counter()
        self._balanced: tuple[int, ...] = ()
        self._next_decision_s = 0.0
        self._met: list[float] = []
        self._done: list[float] = []
        self._late: list[int] = []
        self._tpot_missed = 0.0
        self._scale = 0
        self._last_stats: DeploymentStats | None = None

    # ------------------------------------------------------------------ twin
    def bind(self, twin: Twin) -> bool:
        """Use ``twin`` (the exact fork of a simulated deployment) for the next run; without
        one the controller rebuilds a :class:`~rlbatch.serving.twin.StatsTwin` from what it
        sees."""
        self._bound = twin
        return True

    @property
    def discipline(self) -> AdmissionDiscipline:
        """The guard's KV budget in its order; unguarded (``guarded=false``), a plain vLLM
        server's."""
        return super().discipline if self.config.guarded else PLAIN

    def on_reset(self, info: DeploymentInfo) -> None:
        n = len(info.buckets)
        self.codec = TotalShareCodec(TOTAL_LADDER, SHARE_LADDER, info.pool_names, n)
        self._balanced = (self.codec.routes.index(balanced_route(info.pool_names)),) * n
        self.incumbent = (TOTAL_LADDER.index(64), (len(SHARE_LADDER) - 1,) * n, self._balanced)
        self.twin = self._bound
        self._bound = None
        if self.twin is None:
            try:
                self.twin = StatsTwin(info)
            except (ValueError, OSError):  # no profile for this GPU / model: hold
                self.twin = None
        self.last_proposal = None
        self.last_scores = {}
        self.last_near = []
        self.last_missed = {}
        self.last_decided = {}
        self.decision_s = []
        self.choices = Counter()
        self.route_choices = Counter()
        self._next_decision_s = 0.0
        self._met = [0.0] * n
        self._done = [0.0] * n
        self._late = [0] * n
        self._tpot_missed = 0.0

    def reset(self, info: DeploymentInfo) -> ControlAction:
        action = super().reset(info)
        return action if self.config.guarded else self.propose(None)

    def decide(self, stats: DeploymentStats) -> ControlAction:
        return super().decide(stats) if self.config.guarded else self.propose(stats)

    # ------------------------------------------------------------------ decisions
    def action(self, key: Key) -> ControlAction:
        """The ControlAction of a candidate key."""
        assert self.codec is not None
        ti, shares, routes = key
        return self.codec.decode([ti, *(x for s, r in zip(shares, routes, strict=True)
                                        for x in (s, r))])

    def propose(self, stats: DeploymentStats | None) -> ControlAction:
        assert self.info is not None
        if stats is not None:
            self._observe(stats)
            if self.twin is not None and stats.time_s >= self._next_decision_s:
                t0 = time.perf_counter()
                self.incumbent = self._decide(stats.time_s)
                self.decision_s.append(time.perf_counter() - t0)
                self._next_decision_s = stats.time_s + self.config.every_s - 1e-9
            self.choices[TOTAL_LADDER[self.incumbent[0]]] += 1
            if len(self.info.pools) > 1:
                self.route_choices[self.route_label(self.incumbent)] += 1
        self.last_proposal = self.action(self.incumbent)
        return self.last_proposal

    def _observe(self, stats: DeploymentStats) -> None:
        assert self.info is not None
        self._last_stats = stats
        if self.twin is not None:
            self.twin.observe(stats)
        decay = math.exp(-stats.tick_s / self.config.memory_s)
        sla = self.info.sla
        self._met = [m * decay for m in self._met]
        self._done = [d * decay for d in self._done]
        self._tpot_missed *= decay
        for rec in stats.finished:
            self._done[rec.bucket] += 1
            if meets_sla(rec, sla):
                self._met[rec.bucket] += 1
            elif not rec.rejected and rec.tpot_s > sla.tpot_s:
                self._tpot_missed += 1
        for b, count in enumerate(stats.rejected):
            self._done[b] += count
        waits = stats.oldest_wait_s or (0.0,) * len(stats.queued)
        self._late = [q if w > sla.ttft_s else 0 for q, w in zip(stats.queued, waits,
                                                                  strict=True)]

    def weights(self) -> list[float]:
        """Per bucket, ``1 / max(observed attainment, floor)``."""
        floor = self.config.attainment_floor
        return [1.0 / max(floor, (m + 1.0) / (d + late + 1.0))
                for m, d, late in zip(self._met, self._done, self._late, strict=True)]

    def _decide(self, now_s: float) -> Key:
        cfg = self.config
        assert self.twin is not None and self.info is not None
        streams = self._arrival_streams(now_s)
        weights = self.weights()
        last = self._last_stats
        scores: dict[Key, float] = {}
        missed: dict[Key, list[float]] = {}
        decided: dict[Key, list[float]] = {}
        n = len(self.info.buckets)
        top = len(SHARE_LADDER) - 1

        def score(key: Key) -> float:
            if key not in scores:
                assert self.twin is not None and self.info is not None
                action = self.action(key)
                # as the pipeline will let it through at the next tick, from its state now
                guarded = (copy.deepcopy(self.pipeline).decide(action, last)[0] if cfg.guarded
                           else action)
                total = 0.0
                lost = [0.0] * n
                done = [0.0] * n
                for arrivals in streams:
                    result = roll_out(self.twin.fork(now_s, arrivals), guarded, now_s,
                                      now_s + cfg.horizon_s, self.discipline)
                    out = score_rollout(result, self.info.sla, weights, cfg.backlog,
                                        cfg.weigh_misses, cfg.project_s, cfg.fp8_cost)
                    total += out.total
                    for b in range(n):
                        lost[b] += out.missed[b]
                        done[b] += out.met[b] + out.missed[b]
                scores[key] = total / len(streams)
                missed[key] = lost
                decided[key] = done
            return scores[key]

        def fair(candidates: dict[Key, float]) -> dict[Key, float]:
            """The candidates with their untrimmed references (scored here, so they join
            the candidates), less the trims that cost a bucket more than the slack."""
            if not cfg.fair:
                return candidates
            for key in list(candidates):
                score(untrimmed(key, top))
            keep = fair_keys(candidates, missed, decided, top, cfg.fair_slack,
                             cfg.fair_min_requests)
            return {k: v for k, v in candidates.items() if k in keep}

        inc_t, inc_s, inc_r = self.incumbent
        first = [(TOTAL_LADDER.index(t), (top,) * n, inc_r) for t in cfg.totals]
        first += [self.incumbent] + [(t, inc_s, inc_r) for t in (inc_t - 1, inc_t + 1)
                                     if 0 <= t < len(TOTAL_LADDER)]
        for key in first:
            score(key)
        best = self._best(fair(scores))
        if cfg.trims:
            bt, bs, br = best
            second = [(bt, trim, br) for trim in trims(n, top)]
            second += [(t, bs, br) for t in (bt - 1, bt + 1) if 0 <= t < len(TOTAL_LADDER)]
            for key in second:
                score(key)
            best = self._best(fair(scores))
        if cfg.routing and len(self.info.pools) > 1:
            assert self.codec is not None
            bt, bs, _ = best
            for routes in (self._balanced, *splits(self.codec.routes, n)):
                score((bt, bs, routes))
            best = self._best(fair(scores))
        self.last_scores = scores
        self.last_missed = missed
        self.last_decided = decided
        return best

    def _arrival_streams(self, now_s: float) -> list[list[Request]]:
        """The futures each candidate is rolled out on: the last ``window_s`` of observed
        arrivals replayed, and (``stress``) a busier one: the busiest ``window_s`` seen in
        the last ``stress_memory_s`` when it is ``stress_rate`` times busier, else the recent
        window replayed ``stress_rate`` times faster (the load may rise)."""
        cfg = self.config
        assert self.twin is not None
        window = min(cfg.window_s, now_s)
        recent = self.twin.observed_arrivals(now_s - window, now_s)
        streams = [replay(recent, now_s, window, cfg.horizon_s)]
        if cfg.stress and recent:
            seen = self.twin.observed_arrivals(now_s - cfg.stress_memory_s, now_s)
            peak = busiest(seen, window)
            if len(peak) >= len(recent) * cfg.stress_rate:
                lo, speed = peak[0].arrival_s, 1.0
            else:
                peak, lo, speed = recent, now_s - window, cfg.stress_rate
            shifted = [Request(r.request_id, now_s - window + (r.arrival_s - lo) / speed,
                               r.prompt_tokens, r.max_output_tokens) for r in peak]
            streams.append(replay(shifted, now_s, window / speed, cfg.horizon_s))
        self._scale = len(streams[0])
        return streams

    def _best(self, scores: dict[Key, float]) -> Key:
        """Among the candidates within ``switch_margin`` + ``tolerance`` x (requests in the
        replay) of the best score (while requests wait past the TTFT limit and most finish
        within the SLA's TPOT, only those that keep the incumbent's total, else the incumbent
        or its untrimmed version): with ``sticky`` the incumbent if it is one, else the
        largest total, then the fewest trims (a too-small cap is the costly mistake when the
        load rises)."""
        cfg = self.config
        top = max(scores.values())
        slack = cfg.switch_margin + cfg.tolerance * self._scale
        near = [k for k, v in scores.items() if v >= top - slack]
        if (cfg.no_shrink_when_late and any(self._late)
                and not (cfg.shrink_past_tpot and self._tpot_missed > 0.5 * sum(self._done))):
            # the fallback holds the incumbent's total: the incumbent, or (when fairness
            # ruled its trims out) the same total without them, which is always scored
            held = [k for k in (self.incumbent, untrimmed(self.incumbent, len(SHARE_LADDER) - 1))
                    if k in scores]
            near = [k for k in near if k[0] >= self.incumbent[0]] or held[:1]
        self.last_near = near
        if self.incumbent in near and cfg.sticky:
            return self.incumbent
        return max(near, key=lambda k: (k[0], sum(k[1]), k[2] == self._balanced, scores[k]))

    # ------------------------------------------------------------------ reports
    def row_extras(self) -> dict[str, Any]:
        """Decision time and choices for the evaluation row."""
        times = sorted(self.decision_s)
        n = len(times)
        return {
            "mpc_decisions": n,
            "mpc_decision_ms_mean": 1e3 * sum(times) / n if n else math.nan,
            "mpc_decision_ms_p95": 1e3 * times[min(n - 1, int(0.95 * n))] if n else math.nan,
            "mpc_totals_chosen": dict(sorted(self.choices.items())),
            **({"mpc_routes_chosen": dict(self.route_choices.most_common())}
               if self.route_choices else {}),
        }

    def route_label(self, key: Key) -> str:
        """A candidate's routes as text, e.g. ``fp16/fp16/fp8/fp8``."""
        assert self.codec is not None
        return "/".join(self.codec.routes[r] for r in key[2])


def busiest(arrivals: Sequence[Request], window_s: float) -> Sequence[Request]:
    """The ``window_s``-long run of ``arrivals`` (sorted) holding the most requests."""
    best_lo, best_n, lo = 0, 0, 0
    for hi, r in enumerate(arrivals):
        while arrivals[lo].arrival_s < r.arrival_s - window_s:
            lo += 1
        if hi - lo + 1 > best_n:
            best_lo, best_n = lo, hi - lo + 1
    return arrivals[best_lo:best_lo + best_n]



@dataclass(frozen=True)
class MpcSettings(MpcConfig):
    """Settings of ``mpc``: the planner's knobs (:class:`MpcConfig`) and its guard.

    :param guard: the guard its candidates are checked behind and its actions pass.
    :param order: the order of admission's queues (its rollouts use it too); ignored
        unguarded, where admission is a plain vLLM server's.
    """

    guard: GuardConfig = GuardConfig()  # noqa: RUF009 (frozen, compared by value)
    order: QueueOrder = "deadline"


def mpc_factory(arg: str, settings: Mapping[str, Any]) -> MpcController:
    """``mpc``; settings: :class:`MpcSettings` (the fields of :class:`MpcConfig` and
    ``guard``), e.g. ``mpc[horizon_s=60,every_s=10,totals=8,16,32,64,guarded=false]``.

    :raises ValueError: an argument after ``mpc:``, or a bad setting.
    """
    if arg:
        raise ValueError(f"mpc takes settings in brackets, e.g. mpc[horizon_s=60]; got "
                         f"mpc:{arg}")
    cfg = apply(MpcSettings(), settings)
    return MpcController(cfg, cfg.guard, order=cfg.order)
