"""ControlLoop: tick times, conservation of requests, wall-clock sources, shadow actions."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbatch.control.types import ControlAction, DeploymentInfo
from rlbatch.engine.base import Engine
from rlbatch.engine.stats import EngineStats
from rlbatch.request import Request
from rlbatch.serving.admission import Admission, AdmissionConfig
from rlbatch.serving.deployment import Deployment, assemble_deployment
from rlbatch.serving.loop import ControlLoop
from tests.factories import BUCKETS, sim_engine

TICK_S = 0.5


def _deployment(n_engines: int = 1, config: AdmissionConfig | None = None) -> Deployment:
    engines: list[Engine] = [sim_engine(i) for i in range(n_engines)]
    return assemble_deployment(
        engines, buckets=BUCKETS, admission=config or AdmissionConfig(), gpu="test",
        model="test", max_model_len=512, block_size=16, default_max_num_seqs=8,
        max_num_batched_tokens=256, tick_s=TICK_S)


def _action(caps: tuple[int | None, ...] = (2, 2, 2)) -> ControlAction:
    return ControlAction(caps, ("fp16",) * 3)


request_st = st.tuples(st.floats(0.0, 3.0), st.integers(1, 300), st.integers(1, 300))


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(request_st, min_size=1, max_size=25),
       caps=st.tuples(*(st.one_of(st.none(), st.integers(1, 3)),) * 3),
       n_engines=st.integers(1, 2))
def test_replay_ticks_conserve_requests(rows: list[tuple[float, int, int]],
                                        caps: tuple[int | None, ...], n_engines: int) -> None:
    requests = [Request(i, t, p, o) for i, (t, p, o) in enumerate(sorted(rows))]
    loop = ControlLoop(_deployment(n_engines), requests, _action(caps), drain_s=60.0)
    while True:
        stats = loop.tick()
        assert stats.time_s == loop.ticks * TICK_S and stats.tick_s == TICK_S
        # every arrival so far is finished, rejected, queued or inside an engine
        assert loop.arrived_total == len(loop.records) + loop.source.unfinished()
        assert sum(stats.queued) == loop.source.admission.num_queued()
        if loop.finished:
            break
    assert loop.source.done()
    assert sorted(r.request_id for r in loop.records) == list(range(len(requests)))
    assert loop.totals.finished == sum(not r.rejected for r in loop.records)
    assert loop.rejected_total == sum(r.rejected for r in loop.records)
    row = loop.summary()
    assert row["completed"] + row["rejected"] == row["submitted"] == len(requests)
    assert row["unfinished"] == 0


def test_drain_deadline_leaves_the_rest_unfinished() -> None:
    requests = [Request(i, 0.0, 100, 300) for i in range(20)]
    loop = ControlLoop(_deployment(), requests, _action((1, 1, 1)), drain_s=0.5)
    while not loop.finished:
        loop.tick()
    assert loop.time_s == 0.5 and loop.ticks == 1
    row = loop.summary()
    assert row["unfinished"] == 20 - row["completed"] > 0


def test_keep_records_false_keeps_only_totals() -> None:
    requests = [Request(i, 0.1 * i, 20, 5) for i in range(5)]
    loop = ControlLoop(_deployment(), requests, _action(), keep_records=False)
    while not loop.finished:
        loop.tick()
    assert loop.records == [] and loop.totals.finished == 5
    with pytest.raises(ValueError, match="keep_records"):
        loop.summary()


class _LiveSource:
    """A wall-clock source: requests reach admission by themselves (as in the sidecar)."""

    def __init__(self) -> None:
        dep = _deployment()
        self.info: DeploymentInfo = dep.info
        self.admission: Admission = dep.admission
        self.engines = dep.engines
        self.runs: list[float] = []

    def apply(self, action: ControlAction) -> None:
        self.admission.apply(action)

    def run_until(self, t_s: float) -> None:
        self.runs.append(t_s)

    def snapshot(self) -> tuple[EngineStats, ...]:
        return tuple(e.snapshot() for e in self.engines)

    def done(self) -> bool:
        return False

    def unfinished(self) -> int:
        return self.admission.num_queued()


def test_wall_clock_source_ticks_at_the_times_given() -> None:
    source = _LiveSource()
    loop = ControlLoop(source, None, _action((1, 1, 1)), keep_records=False)
    assert loop.deadline_s == float("inf")
    for i in range(3):
        source.admission.submit(Request(i, 0.0, 10, 5))
    source.admission.refuse(Request(3, 0.0, 70, 5))
    first = loop.tick(now_s=10.0)
    assert (first.time_s, first.tick_s) == (10.0, TICK_S)  # the first interval: tick_s
    assert first.arrived == (3, 1, 0) and first.rejected == (0, 1, 0) and first.queued == (3, 0, 0)
    assert source.admission.cancel(1)
    second = loop.tick(now_s=10.75)
    assert second.tick_s == pytest.approx(0.75) and second.arrived == (0, 0, 0)
    assert source.runs == [10.0, 10.75]
    assert (loop.submitted, loop.cancelled_total, loop.finished) == (4, 1, False)


def test_a_stream_needs_a_replay_source() -> None:
    with pytest.raises(TypeError, match="cannot replay"):
        ControlLoop(_LiveSource(), [Request(0, 0.0, 1, 1)], _action())


def test_shadow_action_is_reported_not_enforced() -> None:
    dep = _deployment()
    loop = ControlLoop(dep, [Request(0, 0.0, 10, 5)], _action((2, 2, 2)))
    shadow = _action((1, None, 4))
    loop.apply(shadow, enforce=False)
    assert loop.tick().action == shadow and dep.admission.caps == (2, 2, 2)
    loop.apply(shadow)
    assert dep.admission.caps == shadow.caps


def _stream(n: int) -> Sequence[Request]:
    return [Request(i, 0.05 * i, 30 + 40 * (i % 4), 8) for i in range(n)]


def test_same_stream_same_stats() -> None:
    def run() -> list[tuple[object, ...]]:
        loop = ControlLoop(_deployment(2), _stream(30), _action((2, None, 1)))
        out: list[tuple[object, ...]] = []
        while not loop.finished:
            s = loop.tick()
            out.append((s.time_s, s.queued, s.arrived, s.running_per_bucket, s.window))
        return out

    assert run() == run()
