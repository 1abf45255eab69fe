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


# ---------------------------------------------------------------- TTFT-deadline accounting
# SLA TTFT 2 s, 10 ms steps: a 300-token request holds the engine for exactly 3 s.

@pytest.mark.parametrize(("caps", "max_num_seqs"), [
    ((1, 1, 1), None),     # the two late ones wait in the admission queue
    ((None,) * 3, 1),      # ... or inside the engine (engine-wide cap of 1)
])
def test_doomed_counted_exactly_once_in_the_tick_their_deadline_passes(
        caps: tuple[int | None, ...], max_num_seqs: int | None) -> None:
    requests = [Request(i, 0.0, 10, 300) for i in range(3)]
    action = ControlAction(caps, ("fp16",) * 3, max_num_seqs=max_num_seqs)
    loop = ControlLoop(_deployment(), requests, action, drain_s=60.0)
    doomed: list[tuple[int, ...]] = []
    pending: list[tuple[int, ...]] = []
    unserved: list[tuple[float, float]] = []
    while not loop.finished:
        s = loop.tick()
        doomed.append(s.doomed)
        pending.append(s.doomed_pending)
        unserved.append((s.time_s, s.oldest_unserved_s))
    # tick 5 ends at 2.5 s, the first tick time past the deadline (0 + 2 s); request 0 had
    # its first token at 0.01 s, requests 1 and 2 none yet: both doomed then, never again
    assert doomed[4] == (2, 0, 0)
    assert sum(d[0] for d in doomed) == 2 and all(d[1:] == (0, 0) for d in doomed)
    # request 1 finishes at 6.0 s (tick 12), request 2 at 9.0 s (tick 18)
    assert pending[4] == pending[10] == (2, 0, 0)
    assert pending[11] == pending[16] == (1, 0, 0) and pending[17] == (0, 0, 0)
    assert sorted(r.ttft_s > 2.0 for r in loop.records) == [False, True, True]
    assert loop.unfinished_by_bucket() == loop.unbooked_by_bucket() == (0, 0, 0)
    # requests 1 and 2 (arrived at 0 s) get their first tokens from the iterations that
    # start at 3.0 s and 6.0 s (an engine's last iteration may end after the tick time): until
    # the tick ending 6.0 s one of them is the oldest unserved, before its deadline and after
    assert unserved == [(t, t if t < 6.0 else 0.0) for t, _ in unserved]
    assert unserved[-1][0] > 6.5


def test_a_late_completion_is_not_doomed_again() -> None:
    # a 1-token request behind a 3 s one: its only token (and completion) comes at 3.01 s,
    # in the tick ending 3.5 s; the tick ending 2.5 s already doomed it
    requests = [Request(0, 0.0, 10, 300), Request(1, 0.0, 10, 1)]
    loop = ControlLoop(_deployment(), requests, _action((1, 1, 1)), drain_s=60.0)
    total = [0, 0, 0]
    while not loop.finished:
        for b, n in enumerate(loop.tick().doomed):
            total[b] += n
    assert total == [1, 0, 0]
    late = [r for r in loop.records if r.request_id == 1]
    assert late[0].ttft_s > 2.0


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(request_st, min_size=1, max_size=25),
       caps=st.tuples(*(st.one_of(st.none(), st.integers(1, 3)),) * 3),
       n_engines=st.integers(1, 2))
def test_every_ttft_miss_is_doomed_once(rows: list[tuple[float, int, int]],
                                        caps: tuple[int | None, ...], n_engines: int) -> None:
    requests = [Request(i, t, p, o) for i, (t, p, o) in enumerate(sorted(rows))]
    loop = ControlLoop(_deployment(n_engines), requests, _action(caps), drain_s=60.0)
    doomed = [0, 0, 0]
    while not loop.finished:
        s = loop.tick()
        for b, n in enumerate(s.doomed):
            doomed[b] += n
        assert s.deadlines_tracked
        # everything doomed so far either finished late or is still pending
        late_done = [0, 0, 0]
        for r in loop.records:
            if not r.rejected and r.ttft_s > loop.info.sla.ttft_s:
                late_done[r.bucket] += 1
        assert [d - p for d, p in zip(doomed, s.doomed_pending, strict=True)] == late_done
    assert loop.unfinished_by_bucket() == (0, 0, 0)


def test_unfinished_at_the_end_split_into_doomed_and_unbooked() -> None:
    requests = [Request(i, 0.0, 10, 300) for i in range(5)] + [Request(5, 2.9, 100, 300)]
    loop = ControlLoop(_deployment(), requests, _action((1, 1, 1)), drain_s=0.1)
    while not loop.finished:
        s = loop.tick()
    assert loop.time_s == 3.0
    # request 0 finished at 3.0 s; 1-4 queued since 0 s (doomed); 5 arrived at 2.9 s and
    # runs in bucket 1 (not doomed yet)
    assert [r.request_id for r in loop.records] == [0]
    assert loop.unfinished_by_bucket() == (4, 1, 0)
    assert s.doomed_pending == (4, 0, 0)
    assert loop.unbooked_by_bucket() == (0, 1, 0)


def test_deadlines_not_tracked_without_a_stream() -> None:
    source = _LiveSource()
    loop = ControlLoop(source, None, _action((1, 1, 1)), keep_records=False)
    source.admission.submit(Request(0, 0.0, 10, 5))
    s = loop.tick(now_s=10.0)
    assert s.doomed == () and not s.deadlines_tracked and source.admission.accepted is None
    with pytest.raises(ValueError, match="track"):
        loop.unbooked_by_bucket()
