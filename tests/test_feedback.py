"""``gradient``: the feedback rule on the total, from the windowed TPOT / TTFT P99 against the
SLA, and the code-completion length mix it is measured on."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from policies.feedback import GradientController, GradientSettings
from rlbatch.buckets import Buckets
from rlbatch.control.controllers import make_controller
from rlbatch.control.discipline import AdmissionDiscipline, KvBudget
from rlbatch.control.types import SLA, DeploymentInfo, DeploymentStats
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload.lengths import code_completion_mix
from rlbatch.workload.spec import resolve_workload
from tests.factories import deployment_stats, engine_stats, record, window

INFO = DeploymentInfo(buckets=Buckets(), pools={"fp16": 1}, gpu="a100-80g", model="llama-2-7b",
                      default_max_num_seqs=256, max_num_batched_tokens=2048,
                      num_kv_blocks={"fp16": 2000}, block_size=16, max_model_len=4096,
                      tick_s=1.0, sla=SLA(ttft_s=2.0, tpot_s=0.1))


def _stats(t: float, *, tpot: float = math.nan, ttft: float = math.nan,
           queued: int = 0) -> DeploymentStats:
    engine = engine_stats(running=(4, 0, 0, 0), waiting=(0,) * 4)
    stats = deployment_stats((engine,), n=4, win=window(4, ttft=ttft, tpot=tpot),
                             queued=(queued, 0, 0, 0))
    return replace(stats, time_s=t)


def _controller(**settings: object) -> GradientController:
    # the arithmetic below is written for these constants, not for the tuned defaults
    pinned: dict[str, object] = {"tpot_target": 0.9, "increase": 4, "cooldown_s": 5.0,
                                 **settings}
    controller = GradientController(GradientSettings(**pinned))  # type: ignore[arg-type]
    controller.reset(INFO)
    return controller


def test_a_tpot_breach_multiplies_the_total_by_the_gradient_once_per_cooldown() -> None:
    c = _controller(start_total=64, tpot_target=0.9, cooldown_s=5.0)
    # TPOT P99 0.12 s against a target of 0.09 s: x0.75
    assert c.propose(_stats(1.0, tpot=0.12, queued=3)).max_num_seqs == 48
    assert c.propose(_stats(2.0, tpot=0.12, queued=3)).max_num_seqs == 48  # cooling down
    assert c.propose(_stats(6.0, tpot=0.12, queued=3)).max_num_seqs == 36
    # never more than min_gradient at once, never under min_total
    assert c.propose(_stats(11.0, tpot=10.0)).max_num_seqs == 18
    for t in (16.0, 21.0, 26.0):
        c.propose(_stats(t, tpot=10.0))
    assert c.total == 4.0


def test_the_total_grows_while_requests_wait_within_the_targets() -> None:
    c = _controller(start_total=64, increase=4, max_total=72)
    assert c.propose(_stats(1.0, tpot=0.05, queued=2)).max_num_seqs == 68
    assert c.propose(_stats(2.0, tpot=math.nan, queued=2)).max_num_seqs == 72  # no signal
    assert c.propose(_stats(3.0, tpot=0.05, queued=2)).max_num_seqs == 72  # at max_total
    assert c.propose(_stats(4.0, tpot=0.05)).max_num_seqs == 72  # nothing waits: it stays


def test_a_ttft_breach_counts_only_while_nothing_waits() -> None:
    c = _controller(start_total=64)
    # queueing (requests wait): a smaller batch would deepen it, so the total grows
    assert c.propose(_stats(1.0, tpot=0.05, ttft=6.0, queued=5)).max_num_seqs == 68
    # nothing waits, TTFT P99 3.6 s against 1.8 s: prefill contention, x0.5
    assert c.propose(_stats(2.0, tpot=0.05, ttft=3.6)).max_num_seqs == 34


def test_gradient_is_a_total_controller_in_deadline_order_behind_the_guard() -> None:
    c = make_controller("gradient[increase=8,order=fifo]")
    assert isinstance(c, GradientController) and c.settings.increase == 8
    assert c.discipline == AdmissionDiscipline("fifo", KvBudget())
    first = c.reset(INFO)
    assert first.max_num_seqs == 64 and first.caps == (64,) * 4  # uncapped within the total
    assert make_controller("gradient").discipline.order == "deadline"
    for bad in ("gradient[min_total=0]", "gradient[tpot_target=1.5]", "gradient[min_gradient=1]",
                "gradient[max_total=512]", "gradient:3"):
        with pytest.raises(ValueError):
            make_controller(bad)


def test_on_code_completion_overload_the_total_falls_and_on_light_load_it_does_not() -> None:
    spec = DeploymentSpec()
    totals: dict[str, list[int]] = {"heavy": [], "light": []}
    for name, rate in (("heavy", 8.0), ("light", 0.5)):
        workload = resolve_workload("bursty:rate=1,duration=120,mix=code", 0, rate_scale=rate)
        run(workload, make_controller("gradient"), spec, drain_s=60.0,
            on_tick=lambda s, n=name: totals[n].append(s.action.max_num_seqs or 0))
    assert min(totals["heavy"]) <= 16  # TPOT over the SLA at a large batch: it reads that
    assert min(totals["light"]) == 64  # within the SLA, nothing waits long: it holds


def test_the_code_mix_matches_the_published_medians() -> None:
    prompts, outputs = code_completion_mix().sample(np.random.default_rng(0), 20_000)
    assert 1200 <= float(np.median(prompts)) <= 1500  # 1,500 before the 4k-context redraw
    assert float(np.median(outputs)) == 13.0
    assert 24 <= float(outputs.mean()) <= 32  # published mean 28
    assert int((prompts + outputs).max()) <= 4096


def _with_finished(stats: DeploymentStats, *, late: int, slow: int) -> DeploymentStats:
    """``stats`` whose tick finished ``late`` requests past the TTFT limit and ``slow``
    within it but over the TPOT limit."""
    records = tuple(record(i, 0, ttft=3.0, tpot=0.05) for i in range(late)) + tuple(
        record(100 + i, 0, ttft=0.5, tpot=0.2) for i in range(slow))
    engine = replace(stats.engines[0], finished=records)
    return replace(stats, engines=(engine,))


def test_misses_signal_lowers_the_total_only_while_tpot_misses_outnumber_ttft_misses() -> None:
    c = _controller(start_total=64, signal="misses", window_s=10.0, cooldown_s=0.0)
    # the TPOT P99 is over its target, but the queue costs more requests: the total grows
    assert c.propose(_with_finished(_stats(1.0, tpot=0.12, queued=3), late=5, slow=2)
                     ).max_num_seqs == 68
    # slow decoding now costs more (2 + 7 against 5 in the window): x0.75
    assert c.propose(_with_finished(_stats(2.0, tpot=0.12, queued=3), late=0, slow=7)
                     ).max_num_seqs == 51
    # the p99 signal would have lowered it at the first tick already
    p99 = _controller(start_total=64, cooldown_s=0.0)
    assert p99.propose(_with_finished(_stats(1.0, tpot=0.12, queued=3), late=5, slow=2)
                       ).max_num_seqs == 48
    # the window forgets: 11 s later only the new tick counts
    assert c.propose(_with_finished(_stats(13.0, tpot=0.12, queued=3), late=1, slow=0)
                     ).max_num_seqs == 55
    with pytest.raises(ValueError, match="signal"):
        make_controller("gradient[signal=loud]")
    with pytest.raises(ValueError, match="window_s"):
        make_controller("gradient[window_s=0]")
