"""Predicted TPOT per batch size, from the deployment's step-time model and its traffic.

A big batch of long contexts (RAG, report generation) misses a tight TPOT where a chat batch
of the same size meets it: each decode step reads every running sequence's KV, and the
prompts that arrive meanwhile are prefilled in the same iterations. :class:`TpotFit` predicts
one engine's iteration time with ``N`` sequences decoding at the traffic's mean context while
the prefill computed per second stays what it is; :class:`TrafficMeans` keeps the smoothed
traffic it reads. Observation version 7 states the share of the total ladder that fits
(:mod:`rlbatch.control.observation`); the guard's ``tpot_fit`` rule caps the total at the
largest that fits (:mod:`rlbatch.control.guard`). Both read the same two classes. The rule
may also scale the prediction by how much slower (or faster) the engine's iterations have run
than predicted (:class:`FitCalibration`).
"""

from __future__ import annotations

import math

from rlbatch.control.action_codec import TOTAL_LADDER
from rlbatch.control.types import DeploymentInfo, DeploymentStats
from rlbatch.profiles.capacity import REFERENCE_OUTPUT_TOKENS, REFERENCE_PROMPT_TOKENS
from rlbatch.profiles.step_time import StepTimeModel

TRAFFIC_TAU_S = 30.0
"""Time constant of the smoothed traffic: about the latency window."""
TPOT_FIT_LADDER: tuple[int, ...] = TOTAL_LADDER
"""The totals :meth:`TpotFit.share` counts: the ones a student's total action chooses among."""


class TrafficMeans:
    """The traffic the fit reads, smoothed over ``tau_s``: prompt and output tokens computed
    per second, and requests finished per second with their prompt and output tokens.

    :param tau_s: time constant of the exponential smoothing.
    """

    def __init__(self, tau_s: float = TRAFFIC_TAU_S) -> None:
        self.tau_s = tau_s
        self.prefill_per_s = self.decode_per_s = 0.0
        self.finished_per_s = self.outputs_per_s = self.prompts_per_s = 0.0

    def reset(self) -> None:
        """Forget everything (start of a run)."""
        self.prefill_per_s = self.decode_per_s = 0.0
        self.finished_per_s = self.outputs_per_s = self.prompts_per_s = 0.0

    def update(self, stats: DeploymentStats, tick_s: float) -> None:
        """Fold in one tick of ``tick_s`` seconds."""
        alpha = 1.0 - math.exp(-tick_s / self.tau_s)
        self.prefill_per_s += alpha * (max(stats.prefill_tokens, 0) / tick_s
                                       - self.prefill_per_s)
        self.decode_per_s += alpha * (max(stats.decode_tokens, 0) / tick_s - self.decode_per_s)
        finished = [rec for rec in stats.finished if not rec.rejected]
        self.finished_per_s += alpha * (len(finished) / tick_s - self.finished_per_s)
        self.outputs_per_s += alpha * (sum(r.output_tokens for r in finished) / tick_s
                                       - self.outputs_per_s)
        self.prompts_per_s += alpha * (sum(r.prompt_tokens for r in finished) / tick_s
                                       - self.prompts_per_s)

    def fit_inputs(self, engines: int = 1) -> tuple[float, float, float]:
        """What :class:`TpotFit` reads: prompt tokens per second to prefill per engine, and
        the mean prompt and output tokens of finished requests (the reference lengths before
        any finished)."""
        if self.finished_per_s > 1e-9:
            prompt = self.prompts_per_s / self.finished_per_s
            output = self.outputs_per_s / self.finished_per_s
        else:
            prompt, output = float(REFERENCE_PROMPT_TOKENS), float(REFERENCE_OUTPUT_TOKENS)
        return self.prefill_per_s / max(engines, 1), prompt, output


class TpotFit:
    """Predicted TPOT per total on one engine, from the deployment's step-time model.

    An iteration with ``N`` sequences decoding at mean context ``c`` (prompt plus half the
    output) also computes the prompt tokens that arrive meanwhile: with ``r`` prompt tokens
    per second to compute, an iteration of ``t`` seconds carries ``r * t`` of them (at most
    the token budget), so ``t`` is the fixed point of ``t = step(r * t, N, N * c)``. TPOT is
    about that ``t``. Results are memoised on the inputs rounded to two significant digits.

    :param step_model: one engine's step-time model.
    :param max_num_batched_tokens: the engine's token budget per iteration.
    :param tpot_s: the TPOT limit the fit counts against (the SLA's times a margin).
    """

    ITERATIONS = 6

    def __init__(self, step_model: StepTimeModel, max_num_batched_tokens: int,
                 tpot_s: float) -> None:
        self.step_model = step_model
        self.max_num_batched_tokens = max_num_batched_tokens
        self.tpot_s = tpot_s
        self._memo: dict[tuple[float, float, float], float] = {}
        self._largest: dict[tuple[float, float, float, int, float], int] = {}

    def __deepcopy__(self, memo: dict[int, object]) -> TpotFit:
        # immutable but for its memos, which are pure caches: copies (mpc's candidate
        # pipelines) share it instead of copying up to 2 x 65,536 entries each
        return self

    @classmethod
    def for_deployment(cls, info: DeploymentInfo, tpot_s: float | None = None,
                       pool: str | None = None) -> TpotFit:
        """The fit of one pool of the deployment, from its GPU and model profiles.

        :param info: the deployment.
        :param tpot_s: the limit (default: the SLA's TPOT).
        :param pool: the pool whose precision the fit models (default: the first).
        :raises ValueError: the GPU or model is not a known profile.
        """
        from rlbatch.profiles.specs import ProfileError, load_gpu, load_model
        from rlbatch.profiles.step_time import RooflineStepTimeModel, pool_precision

        try:
            gpu, model = load_gpu(info.gpu), load_model(info.model)
        except (ProfileError, OSError) as e:
            raise ValueError(
                f"the TPOT fit (observation version 7, the guard's tpot_fit rule) predicts "
                f"TPOT from the deployment's GPU and model profiles; {info.gpu!r} / "
                f"{info.model!r} is not one ({e}): give profile names or files for --gpu "
                f"and --model") from None
        if pool is None:
            pool = info.pool_names[0] if info.pool_names else "fp16"
        step_model = RooflineStepTimeModel(
            gpu, model, precision=pool_precision(pool),
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_num_seqs=max(info.default_max_num_seqs, 1))
        return cls(step_model, info.max_num_batched_tokens,
                   info.sla.tpot_s if tpot_s is None else tpot_s)

    def tpot_s_at(self, total: int, prefill_tokens_per_s: float, prompt_tokens: float,
                  output_tokens: float) -> float:
        """Predicted iteration time with ``total`` sequences decoding."""
        context = max(prompt_tokens, 0.0) + max(output_tokens, 0.0) / 2
        decode_tokens = max(round(total * context), 0)
        t = self.step_model.step_time_s(0, 0.0, total, decode_tokens)
        for _ in range(self.ITERATIONS):
            chunk = min(int(max(prefill_tokens_per_s, 0.0) * t),
                        max(self.max_num_batched_tokens - total, 0))
            # a chunk of a prompt of mean length attends to half the prompt on average
            work = chunk * (max(prompt_tokens, 1.0) / 2)
            t = self.step_model.step_time_s(chunk, work, total, decode_tokens)
        return t

    def share(self, prefill_tokens_per_s: float, prompt_tokens: float,
              output_tokens: float) -> float:
        """Share of :data:`TPOT_FIT_LADDER` whose predicted TPOT meets the limit."""
        key = (_two_digits(prefill_tokens_per_s), _two_digits(prompt_tokens),
               _two_digits(output_tokens))
        if (hit := self._memo.get(key)) is not None:
            return hit
        fits = 0
        for total in TPOT_FIT_LADDER:  # the time grows with the total: stop at the first miss
            if self.tpot_s_at(total, *key) > self.tpot_s:
                break
            fits += 1
        value = fits / len(TPOT_FIT_LADDER)
        if len(self._memo) < 1 << 16:
            self._memo[key] = value
        return value

    def largest_total(self, prefill_tokens_per_s: float, prompt_tokens: float,
                      output_tokens: float, max_total: int, slowdown: float = 1.0) -> int:
        """The largest total in ``[1, max_total]`` whose predicted TPOT, times ``slowdown``,
        meets the limit, 0 when not even one sequence does (bisection: the time grows with
        the total)."""
        key = (_two_digits(prefill_tokens_per_s), _two_digits(prompt_tokens),
               _two_digits(output_tokens), max_total, slowdown)
        if (hit := self._largest.get(key)) is not None:
            return hit
        limit_s = self.tpot_s / slowdown

        def fits(n: int) -> bool:
            return self.tpot_s_at(n, *key[:3]) <= limit_s

        if max_total < 1:
            low = 0
        elif fits(max_total):
            low = max_total
        else:
            low, high = 0, max_total  # low fits (0 vacuously), high does not
            while high - low > 1:
                mid = (low + high) // 2
                low, high = (mid, high) if fits(mid) else (low, mid)
        if len(self._largest) < 1 << 16:
            self._largest[key] = low
        return low


class FitCalibration:
    """How much slower the engines' iterations ran than the fit predicts, smoothed: the
    observed mean iteration time of each engine that ran one in a tick, over the fit's
    prediction at that engine's running count from the smoothed traffic the rule reads.

    The fit's error is not noise that a margin covers: it depends on the traffic. Bursty
    prompts (code completion) are prefilled in a few long iterations that the smoothed prefill
    rate spreads thin: the iterations run 1.35-1.75x the predicted time there (p10-p90 over
    the ticks), 1.04-1.11x on long contexts (BENCHMARKS.md section 21). The ratio is smoothed
    in log space over ``tau_s`` and quantised to steps of :attr:`STEP` (the fit's memo keys on
    it); ticks without an iteration leave it as it was. On the sidecar an engine's iteration
    time is the interval's mean inter-token latency (:mod:`rlbatch.sidecar.upstream`).

    :param tau_s: time constant of the smoothing.
    """

    STEP = 0.02
    """Quantum of the log ratio (2%)."""
    RANGE = (0.25, 4.0)
    """The ratio is clipped to this range: one odd tick cannot stop or free the total."""

    def __init__(self, tau_s: float = TRAFFIC_TAU_S) -> None:
        self.tau_s = tau_s
        self.log_ratio = 0.0

    def reset(self) -> None:
        """Forget everything (start of a run)."""
        self.log_ratio = 0.0

    def update(self, fit: TpotFit, stats: DeploymentStats,
               inputs: tuple[float, float, float], tick_s: float,
               pool: str | None = None) -> None:
        """Fold in one tick's engines (those of ``pool`` only, when given: the fit models
        one pool's precision, and an FP8 engine's iterations are not an FP16 one's).

        :param inputs: what the fit reads, as the rule reads it this tick
            (:meth:`TrafficMeans.fit_inputs`).
        """
        logs = []
        for es in stats.engines:
            running = sum(es.running)
            if (pool is not None and es.pool != pool) or es.iterations < 1 or running < 1:
                continue
            predicted = fit.tpot_s_at(running, *inputs)
            ratio = es.busy_s / es.iterations / predicted if predicted > 0 else math.nan
            if ratio > 0 and math.isfinite(ratio):
                logs.append(math.log(ratio))
        if not logs:
            return
        low, high = (math.log(x) for x in self.RANGE)
        observed = min(max(sum(logs) / len(logs), low), high)
        self.log_ratio += (1.0 - math.exp(-tick_s / self.tau_s)) * (observed - self.log_ratio)

    @property
    def slowdown(self) -> float:
        """The smoothed ratio, quantised: what :meth:`TpotFit.largest_total` scales by."""
        return quantised_slowdown(math.exp(self.log_ratio))


def quantised_slowdown(x: float) -> float:
    """``x`` rounded to a step of :attr:`FitCalibration.STEP` in log space (the fit's memo keys
    on the slowdown it scales by)."""
    step = FitCalibration.STEP
    return round(math.exp(round(math.log(x) / step) * step), 6)


def spread_slowdown(output_tokens: float, spread: float) -> float:
    """How much lower the engine's mean iteration time must sit for a request's TPOT to meet
    the limit: ``1 / (1 - spread / sqrt(output_tokens))``, at most 4.

    A request's TPOT is the mean of its output's iteration times, so it spreads around the
    engine's mean iteration time about as one over the root of its output length: a
    60-token RAG answer misses a limit that the engine's mean meets where a 450-token report
    meets it. ``spread`` is the iteration times' coefficient of variation times the quantile
    of requests to cover.

    :param output_tokens: the traffic's mean output tokens.
    :param spread: 0 for no allowance.
    """
    if spread <= 0:
        return 1.0
    return 1.0 / max(1.0 - spread / math.sqrt(max(output_tokens, 1.0)), 0.25)


def _two_digits(x: float) -> float:
    if not (math.isfinite(x) and x > 0):
        return 0.0
    return float(f"{x:.2g}")
