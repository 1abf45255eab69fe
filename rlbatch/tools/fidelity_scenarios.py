"""The workloads of ``rlbatch fidelity``: loads relative to the calibrated capacity, a
conversation workload with shared prefixes, and trace slices scaled to a small model.

The simulator is held to the live engine at every load, so the default scenarios
(:data:`SCENARIOS`) place Poisson traffic of the Azure-like length mix (prompts scaled to the
tiny model's context) at a fraction of the capacity the calibrated simulator predicts for it
(:func:`capacity`): ``light`` (0.25), ``knee`` (0.85), ``overload`` (1.3), and a conversation
workload whose turns share their history (``shared-prefix``,
:func:`rlbatch.workload.conversations`) at half its capacity, replayed on a live engine with
prefix caching on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlbatch.engine.vllm import VllmEngine
from rlbatch.paths import traces_dir
from rlbatch.profiles.calibrated import CalibratedProfile
from rlbatch.tools.fidelity import simulate
from rlbatch.workload import Workload, azure_like_mix, build_workload, conversations, poisson

__all__ = [
    "DEFAULT_GENERATOR",
    "SCENARIOS",
    "Scenario",
    "capacity",
    "default_trace",
    "scale_workload",
    "scenario_workload",
]


def default_trace() -> Path:
    """The Azure conversation trace: ``$RLBATCH_TRACES_DIR`` or ``../shared/data/traces``
    beside the repository."""
    return traces_dir() / "azure_conv_2023.csv"


DEFAULT_GENERATOR = "poisson:rate=8,duration=20,mix=azure-like"


@dataclass(frozen=True)
class Scenario:
    """One fidelity scenario.

    :param name: its name.
    :param load: arrival rate as a fraction of the simulated capacity for its workload.
    :param duration_s: arrival window.
    :param prefix_caching: a conversation workload with shared prefixes, on an engine with
        prefix caching (else Poisson traffic of the Azure-like mix).
    """

    name: str
    load: float
    duration_s: float
    prefix_caching: bool = False


SCENARIOS: dict[str, Scenario] = {
    "light": Scenario("light", 0.25, 20.0),
    "knee": Scenario("knee", 0.85, 15.0),
    "overload": Scenario("overload", 1.3, 10.0),
    "shared-prefix": Scenario("shared-prefix", 0.5, 20.0, prefix_caching=True),
}

_CAPACITY_PROBE_S = 6.0
"""Arrival window of the saturating run :func:`capacity` simulates."""


def scale_workload(workload: Workload, prompt_scale: float, max_model_len: int,
                   max_requests: int | None = None, output_scale: float = 1.0) -> Workload:
    """Scale prompt lengths by ``prompt_scale`` and output lengths by ``output_scale`` (at
    least 1 token each; outputs at most half the context) and cut prompts so prompt + output
    fit ``max_model_len``; arrivals unchanged. Prefix ids are dropped (they name 512-token
    blocks of the unscaled prompts).

    :param workload: the source workload.
    :param prompt_scale: factor on prompt lengths (> 0).
    :param max_model_len: the engine's context.
    :param max_requests: keep only the first N requests.
    :param output_scale: factor on output lengths (> 0).
    """
    if not (prompt_scale > 0 and output_scale > 0):
        raise ValueError(f"length scales must be > 0, got prompt {prompt_scale}, output "
                         f"{output_scale}")
    rows = []
    cut = 0
    for req in workload.requests[:max_requests]:
        output = max(1, min(round(req.max_output_tokens * output_scale), max_model_len // 2))
        prompt = max(1, round(req.prompt_tokens * prompt_scale))
        if prompt + output > max_model_len:
            prompt = max_model_len - output
            cut += 1
        rows.append((req.arrival_s, prompt, output, None))
    transforms = (*workload.transforms, f"prompts x{prompt_scale:g}",
                  f"outputs x{output_scale:g}",
                  f"prompts cut to fit {max_model_len} tokens: {cut}")
    if max_requests is not None:
        transforms = (*transforms, f"first {max_requests} requests")
    return build_workload(rows, name=workload.name, source=workload.source,
                          transforms=transforms)


def _maker(scenario: Scenario, max_model_len: int, prompt_scale: float,
           seed: int) -> Callable[[float, float], Workload]:
    """``(rate, duration) -> Workload`` of the scenario's kind (rate: requests per second for
    Poisson traffic, conversations per second for the conversation workload)."""
    if scenario.prefix_caching:
        return lambda rate, duration: conversations(rate, duration,
                                                    max_model_len=max_model_len, seed=seed)
    return lambda rate, duration: scale_workload(
        poisson(rate, duration, azure_like_mix(), seed=seed), prompt_scale, max_model_len)


def capacity(profile: CalibratedProfile, engine: VllmEngine, scenario: Scenario, *,
             prompt_scale: float = 0.25, seed: int = 0) -> float:
    """The rate (in the scenario's unit) at which the simulated stand-in of ``engine``
    saturates: it is offered far more than it can serve for a few seconds, and the requests
    it completes meanwhile, per second, over the requests offered per unit of rate. The
    simulated engine has run every iteration size once before (a server that has run a
    while; with a bounded primitive cache only the recent ones stay cheap).

    :param profile: the calibrated profile.
    :param engine: the live engine (its pool, KV blocks and budgets).
    :param scenario: the scenario (its workload kind).
    :param prompt_scale: factor on the Azure-like prompts.
    :param seed: workload seed.
    """
    make = _maker(scenario, engine.max_model_len, prompt_scale, seed)
    probe = make(1.0, 60.0)
    per_unit = len(probe.requests) / 60.0  # requests per second at rate 1
    mean_output = sum(r.max_output_tokens for r in probe.requests) / len(probe.requests)
    # far beyond what max_num_seqs sequences can serve at ~1 ms per decode step
    rate = 4.0 * engine.configured_max_num_seqs * 1000.0 / mean_output / per_unit
    workload = make(rate, _CAPACITY_PROBE_S)
    # a server that has run a while: every iteration size run once before
    sizes = range(1, engine.config.max_num_batched_tokens + 1)
    outcome = simulate(profile, engine, workload.requests, drain_s=0.0, token_counts=sizes)
    done = sum(1 for r in outcome.records
               if not r.rejected and r.finish_s <= _CAPACITY_PROBE_S)
    return done / _CAPACITY_PROBE_S / per_unit


def scenario_workload(scenario: Scenario, rate: float, max_model_len: int, *,
                      prompt_scale: float = 0.25, seed: int = 0) -> Workload:
    """The scenario's workload at ``rate`` (requests or conversations per second).

    :param scenario: the scenario.
    :param rate: arrival rate, in the scenario's unit.
    :param max_model_len: the engine's context.
    :param prompt_scale: factor on the Azure-like prompts.
    :param seed: workload seed.
    """
    workload = _maker(scenario, max_model_len, prompt_scale, seed)(rate, scenario.duration_s)
    return build_workload(
        [(r.arrival_s, r.prompt_tokens, r.max_output_tokens, r.prefix_ids)
         for r in workload.requests], name=scenario.name, source=workload.source,
        transforms=(*workload.transforms, f"rate {rate:.3g}"))
