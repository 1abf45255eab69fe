"""The digital twin (deployment fork) and the ``mpc`` controller."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from policies.mpc import MpcConfig, MpcController, mpc_factory
from policies.mpc_candidates import Key, fair_keys, splits, trims, untrimmed
from policies.mpc_score import rollout_score, score_rollout
from rlbatch.control.action_codec import TOTAL_LADDER
from rlbatch.control.controllers import make_controller
from rlbatch.control.discipline import AdmissionDiscipline, KvBudget
from rlbatch.control.types import ANY_POOL, SLA, ControlAction, DeploymentStats
from rlbatch.engine.base import Engine
from rlbatch.engine.stats import FinishedRequest
from rlbatch.request import Request
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import Deployment, DeploymentSpec, assemble_deployment
from rlbatch.serving.loop import ControlLoop
from rlbatch.serving.run import run
from rlbatch.serving.twin import (
    DeploymentTwin,
    Rollout,
    StatsTwin,
    replay,
    roll_out,
)
from rlbatch.tools.evaluate import EvalJob, run_jobs
from rlbatch.workload import Workload, build_workload
from tests.factories import BUCKETS, sim_engine

CAPPED = ControlAction((2, None, 1), ("fp16",) * 3, 4)
BUDGET = AdmissionDiscipline("fifo", KvBudget(0.8, "final"))


def _capped(d: Deployment) -> None:
    """Caps, a total and a KV budget of 0.8 of the pool in force on ``d``."""
    d.admission.configure(BUDGET, math.inf)
    d.apply(CAPPED)


def _deployment() -> Deployment:
    engines: list[Engine] = [sim_engine(i) for i in range(2)]
    return assemble_deployment(
        engines, buckets=BUCKETS, admission=AdmissionConfig(), gpu="test", model="test",
        max_model_len=512, block_size=16, default_max_num_seqs=8,
        max_num_batched_tokens=256, tick_s=0.5)


def _requests(n: int = 80, every_s: float = 0.05) -> list[Request]:
    return [Request(i, i * every_s, 20 + (37 * i) % 200, 5 + (11 * i) % 40) for i in range(n)]


def _records(d: Deployment) -> list[tuple[object, ...]]:
    recs = [r for es in d.snapshot() for r in es.finished] + d.admission.take_rejected()
    return sorted(r.comparable() for r in recs)


def _state(d: Deployment) -> tuple[object, ...]:
    return (d.admission.queued(), d.unfinished(), d.submitted,
            tuple(e.now_s for e in d.engines),
            tuple(tuple(e.pending()) for e in d.engines))  # type: ignore[attr-defined]


def test_fork_runs_forward_exactly_like_the_original() -> None:
    d = _deployment()
    d.load(_requests())
    _capped(d)
    d.run_until(1.0)
    _records(d)
    f = d.fork()
    assert _state(f) == _state(d)
    assert f.admission.discipline == BUDGET and f.admission.kv_budget_fraction == 0.8
    d.run_until(6.0)
    f.run_until(6.0)
    assert _state(f) == _state(d)
    assert _records(f) == _records(d)
    assert d.admission.take_counters() == f.admission.take_counters()


def test_running_a_fork_never_changes_the_original() -> None:
    ref, d = _deployment(), _deployment()
    for x in (ref, d):
        x.load(_requests())
        _capped(x)
        x.run_until(1.0)
    f = d.fork()
    f.load([Request(900 + i, 1.0 + 0.01 * i, 300, 50) for i in range(40)])
    f.apply(ControlAction((None,) * 3, ("fp16",) * 3, 1))
    f.run_until(8.0)
    f.admission.take_counters()
    for x in (ref, d):
        x.run_until(6.0)
    assert _state(d) == _state(ref)
    assert _records(d) == _records(ref)
    assert d.admission.take_counters() == ref.admission.take_counters()


def test_arrived_since_and_the_twin_see_only_past_arrivals() -> None:
    d = _deployment()
    d.load(_requests())
    d.run_until(1.0)
    seen = DeploymentTwin(d).observed_arrivals(0.5, 1.0)
    assert seen and all(0.5 <= r.arrival_s <= 1.0 for r in seen)
    assert max(r.arrival_s for r in d.arrived_since(0.0)) <= max(e.now_s for e in d.engines)


def test_replay_shifts_the_observed_window_past_now_and_tiles_it() -> None:
    seen = [Request(0, 8.0, 10, 5), Request(1, 9.5, 20, 5)]
    out = replay(seen, 10.0, 2.0, 5.0)
    assert [r.arrival_s for r in out] == [10.0 + 1.5, 12.0, 13.5, 14.0]
    assert replay([], 10.0, 2.0, 5.0) == []


def test_rollout_score_counts_doomed_and_backlog() -> None:
    sla = SLA(ttft_s=2.0, tpot_s=0.1)
    result = Rollout(start_s=0.0, end_s=10.0, finished=[],
                     pending=[(0, 9.0, -1.0, 0, 10),    # no first token yet, 1 s old: open
                              (0, 5.0, -1.0, 0, 10),    # no first token after 5 s: doomed
                              (1, 9.0, 9.5, 3, 3)],     # TPOT (10-9.5)/2 > 0.1: doomed
                     queued=[(1, 9.9), (1, 1.0)])       # one open, one doomed
    assert rollout_score(result, sla, [1.0, 2.0]) == -1.0 - 2.0 - 2.0
    assert rollout_score(result, sla, [1.0, 2.0], backlog=0.5) == -5.0 - 0.5 * (2 + 2 * 3)
    # projected: nothing of bucket 0 was served, so its queued request never gets its turn,
    # and the 1 arrival / 10 s held up for the next 5 s counts too
    starved = Rollout(start_s=0.0, end_s=10.0, finished=[], pending=[], queued=[(0, 9.9)])
    assert rollout_score(starved, sla, [1.0, 1.0]) == 0.0
    assert rollout_score(starved, sla, [1.0, 1.0], project_s=5.0) == -1.0 - 0.5


def test_score_rollout_counts_met_and_missed_per_bucket() -> None:
    sla = SLA(ttft_s=2.0, tpot_s=0.1)
    ok = FinishedRequest(request_id=0, bucket=0, pool="fp16", arrival_s=1.0, prompt_tokens=10,
                         output_tokens=5, ttft_s=0.1, tpot_s=0.01, e2e_s=0.2, finish_s=1.2)
    late = FinishedRequest(request_id=1, bucket=1, pool="fp16", arrival_s=1.0,
                           prompt_tokens=10, output_tokens=5, ttft_s=3.0, tpot_s=0.01,
                           e2e_s=3.1, finish_s=4.1)
    result = Rollout(start_s=0.0, end_s=10.0, finished=[ok, late],
                     pending=[(0, 5.0, -1.0, 0, 10),    # doomed
                              (0, 9.0, -1.0, 0, 10)],   # still open
                     queued=[(1, 9.9), (1, 1.0)])       # one open, one doomed
    out = score_rollout(result, sla, [1.0, 2.0])
    assert out.met == (1.0, 0.0)
    assert out.missed == (1.0, 2.0)
    assert out.total == rollout_score(result, sla, [1.0, 2.0]) == 1.0 - 1.0 - 2.0 - 2.0
    # the projected arrivals that the leftover queue holds up count as a fraction
    starved = Rollout(start_s=0.0, end_s=10.0, finished=[], pending=[], queued=[(0, 9.9)])
    assert score_rollout(starved, sla, [1.0], project_s=5.0).missed == (1.0 + 0.5,)


def test_fair_keys_drop_only_trims_that_cost_a_bucket_more_than_the_slack() -> None:
    plain: Key = (5, (3, 3), (0, 0))
    harmless: Key = (5, (3, 1), (0, 0))   # sheds bucket 1 load, bucket 1 loses 1 more
    starving: Key = (5, (1, 3), (0, 0))   # bucket 0 loses 3 more of its 100
    other: Key = (4, (3, 0), (0, 0))      # its reference (4, (3, 3)) loses as many
    missed = {plain: [10.0, 5.0], harmless: [4.0, 6.0], starving: [13.0, 0.0],
              other: [2.0, 9.0], untrimmed(other, 3): [2.0, 9.0]}
    decided = {plain: [100.0, 50.0], untrimmed(other, 3): [100.0, 50.0]}
    decided |= {k: [0.0, 0.0] for k in (harmless, starving, other)}  # unread
    keys = [plain, harmless, starving, other]
    assert fair_keys(keys, missed, decided, 3, 0.02, 1.0) == {plain, harmless, other}
    # the slack scales with the reference's decided requests
    assert fair_keys(keys, missed, decided, 3, 0.03, 1.0) == set(keys)
    assert fair_keys(keys, missed, decided, 3, 0.0, 0.0) == {plain, other}
    assert untrimmed(starving, 3) == plain


def test_fair_mpc_never_chooses_a_starving_trim_that_it_would_otherwise() -> None:
    # Llama-3.1-8B on an H100 has KV room to spare, so in this overload trimming a bucket
    # is what frees the batch: unfiltered, the best rollout often starves the trimmed one
    rows = [(i / 20.0, [300, 1500, 3000, 3900][(7 * i) % 4] if i % 3 else 1500,
             100 + (31 * i) % 300) for i in range(600)]
    c = mpc_factory("", {"horizon_s": 20, "every_s": 5, "window_s": 10, "fair": True})
    decide = c._decide
    unfair_best = 0
    chosen: list[Key] = []

    def spy(now_s: float) -> Key:
        nonlocal unfair_best
        key = decide(now_s)
        keep = fair_keys(c.last_scores, c.last_missed, c.last_decided, 3, 0.02, 1.0)
        unfair_best += c._best(dict(c.last_scores)) not in keep
        assert key in keep
        chosen.append(key)
        return key

    c._decide = spy  # type: ignore[method-assign]
    spec = DeploymentSpec(gpu="h100-80g", model="llama-3.1-8b",
                          admission=AdmissionConfig(over_length="truncate"))
    run(_workload(rows), c, spec, drain_s=30.0)
    assert len(chosen) == 12 and unfair_best >= 3


def test_no_shrink_holds_the_total_when_fairness_rules_the_incumbent_out() -> None:
    c = MpcController()
    c.on_reset(_deployment().info)
    trimmed: Key = (7, (3, 1, 0), (0, 0, 0))
    c.incumbent, c._late, c._scale = trimmed, [0, 3, 0], 100
    # the fair candidates (the incumbent is not one of them): only smaller totals are near
    scores: dict[Key, float] = {(5, (3, 3, 3), (0, 0, 0)): 50.0,
                               (7, (3, 3, 3), (0, 0, 0)): 10.0}
    assert c._best(scores) == (7, (3, 3, 3), (0, 0, 0))
    assert c._best({**scores, trimmed: 9.0}) == trimmed


@pytest.mark.parametrize(("shrink_past_tpot", "tpot_missed", "expected_total"),
                         [(True, 6.0, 5), (True, 5.0, 7), (False, 6.0, 7)])
def test_no_shrink_gives_way_when_the_batch_makes_tpot_miss(
        shrink_past_tpot: bool, tpot_missed: float, expected_total: int) -> None:
    c = MpcController(MpcConfig(shrink_past_tpot=shrink_past_tpot))
    c.on_reset(_deployment().info)
    c.incumbent = (7, (3, 3, 3), (0, 0, 0))
    c._late, c._scale = [0, 3, 0], 100
    c._done, c._tpot_missed = [4.0, 4.0, 2.0], tpot_missed  # over half of 10 finished: 6
    scores: dict[Key, float] = {(5, (3, 3, 3), (0, 0, 0)): 50.0, c.incumbent: 10.0}
    assert c._best(scores)[0] == expected_total


def test_candidates_cover_small_totals_and_are_codec_actions() -> None:
    c = MpcController(MpcConfig(horizon_s=4.0, every_s=2.0, window_s=2.0))
    d = _deployment()
    c.bind(DeploymentTwin(d))
    loop = ControlLoop(d, _requests(), c.reset(d.info))
    for _ in range(4):
        loop.apply(c.decide(loop.tick()))
    totals = {TOTAL_LADDER[k[0]] for k in c.last_scores}
    assert {4, 8, 16, 32, 64, 128, 256} <= totals
    assert c.action((TOTAL_LADDER.index(4), (3, 3, 3), (0, 0, 0))) == ControlAction(
        (None,) * 3, ("fp16",) * 3, 4)
    assert c.last_proposal is not None and c.last_proposal.max_num_seqs in TOTAL_LADDER
    assert trims(4, 3) == [(3, 3, 2, 1), (3, 2, 1, 0), (3, 3, 3, 0)]


@pytest.mark.parametrize("routing", [False, True])
def test_two_pools_try_short_long_splits_only_when_asked(routing: bool) -> None:
    assert splits(("fp16", "fp8", ANY_POOL), 3) == [(0, 1, 1), (0, 0, 1), (1, 0, 0), (1, 1, 0)]
    assert splits(("fp16",), 3) == []
    engines: list[Engine] = [sim_engine(0, "fp16"), sim_engine(1, "fp8")]
    d = assemble_deployment(
        engines, buckets=BUCKETS, admission=AdmissionConfig(), gpu="test", model="test",
        max_model_len=512, block_size=16, default_max_num_seqs=8,
        max_num_batched_tokens=256, tick_s=0.5)
    c = MpcController(MpcConfig(horizon_s=4.0, every_s=2.0, window_s=2.0, routing=routing))
    c.bind(DeploymentTwin(d))
    first = c.reset(d.info)
    assert first.pools == (ANY_POOL,) * 3  # the incumbent: least loaded
    loop = ControlLoop(d, _requests(), first)
    for _ in range(4):
        loop.apply(c.decide(loop.tick()))
    routes = {k[2] for k in c.last_scores}
    tried = {(2, 2, 2), *splits(("fp16", "fp8", ANY_POOL), 3)} if routing else {(2, 2, 2)}
    assert routes == tried
    assert sum(c.route_choices.values()) == 4 and c.row_extras()["mpc_routes_chosen"]
    if not routing:
        assert c.route_choices == {f"{ANY_POOL}/{ANY_POOL}/{ANY_POOL}": 4}


def test_rollout_score_charges_the_fp8_quality_cost() -> None:
    sla = SLA(ttft_s=2.0, tpot_s=0.1)

    def rec(pool: str) -> FinishedRequest:
        return FinishedRequest(request_id=0, bucket=0, pool=pool, arrival_s=1.0,
                               prompt_tokens=10, output_tokens=5, ttft_s=0.1, tpot_s=0.01,
                               e2e_s=0.2, finish_s=1.2)

    result = Rollout(start_s=0.0, end_s=10.0, finished=[rec("fp16"), rec("fp8")], pending=[],
                     queued=[])
    assert rollout_score(result, sla, [2.0], fp8_cost=0.015) == pytest.approx(2.0 + 2 * 0.985)
    assert rollout_score(result, sla, [2.0]) == 4.0


def _workload(rows: Sequence[tuple[float, int, int]]) -> Workload:
    return build_workload([(t, p, o, None) for t, p, o in rows], name="w", source="test")


def _decisions(workload: Workload, until_s: float) -> list[tuple[float, object, object]]:
    c = mpc_factory("", {"horizon_s": 20, "every_s": 5, "window_s": 10})
    seen: list[tuple[float, object, object]] = []
    decide = c._decide

    def spy(now_s: float) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        key = decide(now_s)
        if now_s < until_s:
            seen.append((now_s, key, dict(c.last_scores)))
        return key

    c._decide = spy  # type: ignore[method-assign]
    spec = DeploymentSpec(admission=AdmissionConfig(over_length="truncate"))
    run(workload, c, spec, drain_s=30.0)
    return seen


def test_mpc_never_reads_future_arrivals() -> None:
    steady = [(0.4 * i, 200 + (97 * i) % 1500, 50 + (31 * i) % 300) for i in range(100)]
    burst = [(32.0 + 0.001 * i, 3000, 500) for i in range(400)]
    calm = _decisions(_workload(steady), 32.0)
    stormy = _decisions(_workload(steady + burst), 32.0)
    assert len(calm) == 7  # decisions at t = 1, 6, ..., 31
    assert stormy == calm


def test_mpc_rebuilds_a_stats_twin_without_a_bound_one() -> None:
    spec = DeploymentSpec(admission=AdmissionConfig(over_length="truncate"))
    from rlbatch.serving.builders import build_deployment
    d = build_deployment(spec)
    c = MpcController(MpcConfig(horizon_s=10.0, every_s=5.0, window_s=10.0))
    loop = ControlLoop(d, _workload([(0.2 * i, 300, 100) for i in range(100)]).requests,
                       c.reset(d.info))
    stats: DeploymentStats | None = None
    for _ in range(12):
        stats = loop.tick()
        loop.apply(c.decide(stats))
    assert isinstance(c.twin, StatsTwin)
    assert len(c.decision_s) == 3 and c.last_scores
    assert stats is not None
    fork = c.twin.fork(stats.time_s, [])
    assert fork.unfinished() == d.unfinished()
    result = roll_out(fork, c.action(c.incumbent), stats.time_s, stats.time_s + 30.0)
    assert result.finished


def test_mpc_in_an_evaluation_through_make_controller() -> None:
    assert isinstance(make_controller("mpc"), MpcController)
    with pytest.raises(ValueError, match="unknown setting 'bogus'; MpcSettings has horizon_s"):
        make_controller("mpc[bogus=1]")
    with pytest.raises(ValueError, match="mpc takes settings in brackets"):
        make_controller("mpc:fair=0")
    fair = make_controller("mpc[fair=false,fair_slack=0.05,fair_min_requests=2]")
    assert isinstance(fair, MpcController)
    assert (fair.config.fair, fair.config.fair_slack, fair.config.fair_min_requests) == (
        False, 0.05, 2.0)
    with pytest.raises(ValueError, match="fair_slack"):
        MpcConfig(fair_slack=-0.1)
    spec = DeploymentSpec(admission=AdmissionConfig(over_length="truncate"))
    job = EvalJob("mpc[horizon_s=10,every_s=5]", "poisson:rate=2,duration=30", 1.0, spec, None,
                  None, 0, 60.0)
    (row,) = run_jobs([job], quiet=True)
    assert row["controller"] == "mpc[horizon_s=10,every_s=5]"
    assert row["mpc_decisions"] >= 6 and row["mpc_decision_ms_mean"] > 0
    assert row["completed"] + row["rejected"] + row["unfinished"] == row["submitted"] > 0
    # the totals in force, tick by tick, are the ones it chose (through the guard)
    ticks = row["max_num_seqs_ticks"]
    assert sum(ticks.values()) > 30 and set(ticks) <= {str(t) for t in TOTAL_LADDER}


@pytest.mark.parametrize(("spec", "order"), [
    ("mpc", "deadline"), ("mpc[order=fifo]", "fifo"), ("mpc[order=deadline]", "deadline")])
def test_mpc_plans_and_serves_in_its_order(spec: str, order: str) -> None:
    mpc = make_controller(spec)
    assert isinstance(mpc, MpcController)
    assert mpc.order == order == mpc.discipline.order
    assert make_controller(f"{spec[:-1]},guarded=false]" if "[" in spec
                           else "mpc[guarded=false]").discipline.order == "fifo"
    with pytest.raises(ValueError, match="order"):
        make_controller("mpc[order=lifo]")


def test_mpc_without_a_twin_or_known_profiles_holds_its_action() -> None:
    d = _deployment()  # gpu "test": no profile to rebuild a twin from (sidecar default)
    c = MpcController()
    first = c.reset(d.info)
    loop = ControlLoop(d, _requests(), first)
    actions = {c.decide(loop.tick()) for _ in range(12)}
    assert c.twin is None and not c.decision_s and len(actions) == 1
