"""Admission: outcomes, caps, queue bounds, cancellation, routing; nothing is ever lost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbatch.control.discipline import AdmissionDiscipline, KvBudget
from rlbatch.control.types import ANY_POOL, ControlAction, route_choices
from rlbatch.engine.base import Engine
from rlbatch.engine.sim import SimEngine
from rlbatch.request import Request
from rlbatch.serving.admission import (
    Admission,
    AdmissionConfig,
    Admitted,
    Queued,
    Rejected,
)
from tests.factories import BUCKETS, sim_engine

MAX_LEN = 512
POOLS = ("fp16", "fp8")


def _admission(config: AdmissionConfig | None = None) -> tuple[Admission, list[SimEngine]]:
    engines = [sim_engine(0, "fp16"), sim_engine(1, "fp16"), sim_engine(2, "fp8")]
    as_engines: list[Engine] = list(engines)
    return Admission(as_engines, BUCKETS, MAX_LEN, config or AdmissionConfig()), engines


def _action(caps: tuple[int | None, ...], pools: tuple[str, ...] = ("fp16",) * 3
            ) -> ControlAction:
    return ControlAction(caps, pools)


# ---------------------------------------------------------------- outcomes
def test_capped_bucket_queues_and_admit_respects_the_cap() -> None:
    adm, (e0, _, _) = _admission()
    adm.apply(_action((2, 2, 2)))
    outcomes = [adm.submit(Request(i, 0.0, 10, 5)) for i in range(3)]
    assert outcomes == [Queued(0)] * 3
    assert adm.admit(e0) == 2 and e0.num_unfinished(0) == 2
    assert adm.queued() == (1, 0, 0)


def test_uncapped_bucket_goes_to_the_least_loaded_engine() -> None:
    adm, (e0, e1, _) = _admission()
    e0.add_request(Request(99, 0.0, 10, 5), 0, 10, False)
    assert adm.submit(Request(0, 0.0, 10, 5)) == Admitted(0, 1)
    assert adm.submit(Request(1, 0.0, 10, 5)) == Admitted(0, 0)  # tie: lowest id
    assert (e0.num_unfinished_total(), e1.num_unfinished_total()) == (2, 1)


def test_too_long_is_rejected_with_a_record_or_truncated() -> None:
    adm, _ = _admission()
    out = adm.submit(Request(7, 1.5, 500, 100))
    assert out == Rejected(2, "too_long")
    (rec,) = adm.take_rejected()
    assert rec.rejected and rec.request_id == 7 and rec.finish_s == 1.5
    assert adm.take_rejected() == []
    trunc, (e0, _, _) = _admission(AdmissionConfig(over_length="truncate"))
    assert isinstance(trunc.submit(Request(8, 0.0, 500, 100)), Admitted)
    (rec,) = _finish_all(e0)
    assert rec.truncated and rec.prompt_tokens == MAX_LEN - 100
    # no room for even one prompt token: rejected under truncate too
    assert trunc.submit(Request(9, 0.0, 10, MAX_LEN)) == Rejected(0, "too_long")


def test_queue_bound_applies_to_capped_and_uncapped_buckets() -> None:
    adm, engines = _admission(AdmissionConfig(max_queue_len=2))
    adm.apply(_action((1, None, None)))
    assert [type(adm.submit(Request(i, 0.0, 10, 5))).__name__ for i in range(3)] == [
        "Queued", "Queued", "Rejected"]
    # Uncapped bucket 1: requests wait inside the pool's engines until an iteration runs
    # them; the bound counts those.
    outs = [adm.submit(Request(i, 0.0, 100, 5)) for i in range(10, 13)]
    assert outs == [Admitted(1, 0), Admitted(1, 1), Rejected(1, "queue_full")]
    assert sum(e.num_waiting(1) for e in engines[:2]) == 2
    engines[0].step(1e9)  # the engine starts its request: a waiting slot frees up
    assert engines[0].num_waiting(1) == 0
    assert adm.submit(Request(13, 0.0, 100, 5)) == Admitted(1, 0)
    assert adm.take_counters().rejected == (1, 1, 0)


def test_refuse_and_cancel_are_counted() -> None:
    adm, _ = _admission()
    adm.apply(_action((1, 1, 1)))
    assert adm.refuse(Request(0, 0.0, 10, 5)) == Rejected(0, "unavailable")
    adm.submit(Request(1, 0.0, 70, 5))
    assert adm.cancel(1) and not adm.cancel(1) and not adm.cancel(42)
    c = adm.take_counters()
    assert (c.arrived, c.rejected, c.cancelled) == ((1, 1, 0), (1, 0, 0), (0, 1, 0))
    assert adm.take_counters().arrived == (0, 0, 0)
    assert [r.request_id for r in adm.rejected] == [0]


def test_least_loaded_honours_cap_and_exclusions() -> None:
    adm, (e0, e1, e2) = _admission()
    adm.apply(_action((1, None, None)))
    e1.add_request(Request(90, 0.0, 10, 5), 0, 10, False)
    e0.add_request(Request(91, 0.0, 70, 5), 1, 70, False)
    e0.add_request(Request(92, 0.0, 70, 5), 1, 70, False)
    assert adm.least_loaded("fp16") is e1
    assert adm.least_loaded("fp16", bucket=0) is e0  # e1 is at bucket 0's cap
    assert adm.least_loaded("fp16", bucket=0, exclude={0}) is None
    assert adm.least_loaded("fp8") is e2


def test_any_pool_routes_to_the_least_loaded_engine_of_every_pool() -> None:
    """``any``: uncapped arrivals and queued capped ones go to whichever engine of either pool
    holds the fewest requests; a pool name keeps them in that pool."""
    adm, (e0, e1, e2) = _admission()
    adm.apply(_action((None, 1, None), (ANY_POOL, ANY_POOL, "fp16")))
    e0.add_request(Request(90, 0.0, 10, 5), 0, 10, False)
    e1.add_request(Request(91, 0.0, 10, 5), 0, 10, False)
    assert adm.submit(Request(0, 0.0, 10, 5)) == Admitted(0, 2)  # the fp8 engine is idle
    assert adm.submit(Request(1, 0.0, 10, 5)) == Admitted(0, 0)  # all hold one: lowest id
    assert adm.submit(Request(2, 0.0, 200, 5)) == Admitted(2, 1)  # pinned to fp16
    assert adm.submit(Request(3, 0.0, 70, 5)) == Queued(1)
    assert adm.admit(e2) == 1 and e2.num_unfinished(1) == 1  # any engine may take it
    assert adm.least_loaded(ANY_POOL) is e0  # two requests each: lowest id
    assert adm.least_loaded(ANY_POOL, bucket=1, exclude={0}) is e1  # e2 is at the cap
    assert list(adm.engines_of(ANY_POOL)) == [e0, e1, e2]
    assert route_choices(POOLS) == (*POOLS, ANY_POOL) and route_choices(("fp16",)) == ("fp16",)
    with pytest.raises(ValueError, match="routes to pool 'fp32'"):
        adm.apply(_action((None,) * 3, ("fp32",) * 3))


def _finish_all(engine: SimEngine) -> list:  # type: ignore[type-arg]
    while not engine.is_idle():
        engine.step(1e9)
    return list(engine.snapshot().finished)


# ---------------------------------------------------------------- property: nothing lost
caps_st = st.tuples(*(st.one_of(st.none(), st.integers(1, 3)),) * 3)
submit_st = st.tuples(st.just("submit"), st.integers(1, 300), st.integers(1, 600))
op_st = st.one_of(
    submit_st, submit_st, submit_st,
    st.tuples(st.just("refuse"), st.integers(1, 300), st.just(1)),
    st.tuples(st.just("admit"), st.integers(0, 2), st.just(0)),
    st.tuples(st.just("admit_pool"), st.integers(0, 1), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(0, 60), st.just(0)),
    st.tuples(st.just("run"), st.integers(0, 2), st.integers(1, 5)),
    st.tuples(st.just("apply"), caps_st, st.tuples(*(st.sampled_from(POOLS),) * 3)),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op_st, min_size=20, max_size=80),
       over_length=st.sampled_from(("reject", "truncate")),
       bound=st.one_of(st.none(), st.integers(1, 3)), initial=caps_st)
def test_admission_never_exceeds_a_cap_and_never_loses_a_request(
        ops: list[tuple], over_length: str, bound: int | None,  # type: ignore[type-arg]
        initial: tuple[int | None, ...]) -> None:
    adm, engines = _admission(AdmissionConfig(over_length, bound))  # type: ignore[arg-type]
    adm.apply(_action(initial))
    submitted: list[int] = []
    finished: set[int] = set()
    cancelled: set[int] = set()
    arrivals = 0
    for op in ops:
        kind = op[0]
        before = [[e.num_unfinished(b) for b in range(3)] for e in engines]
        if kind in ("submit", "refuse"):
            rid = len(submitted)
            submitted.append(rid)
            arrivals += 1
            req = Request(rid, float(rid), op[1], op[2])
            n_rejected = len(adm.rejected)
            out = adm.submit(req) if kind == "submit" else adm.refuse(req)
            assert len(adm.rejected) == n_rejected + isinstance(out, Rejected)
            if isinstance(out, Queued):
                assert any(item[0] is req for item in adm.queues[out.bucket])
                assert adm.caps[out.bucket] is not None
            elif isinstance(out, Admitted):
                assert adm.caps[out.bucket] is None
                assert engines[out.engine_id].pool == adm.routes[out.bucket]
        elif kind == "admit":
            adm.admit(engines[op[1]])
        elif kind == "admit_pool":
            adm.admit_pool(POOLS[op[1]])
        elif kind == "cancel" and submitted:
            rid = submitted[op[1] % len(submitted)]
            was_queued = any(item[0].request_id == rid for q in adm.queues for item in q)
            assert adm.cancel(rid) == was_queued
            if was_queued:
                cancelled.add(rid)
        elif kind == "run":
            eng = engines[op[1]]
            for _ in range(op[2]):
                if not eng.is_idle():
                    eng.step(eng.now_s + 0.02)
            finished.update(r.request_id for r in eng.snapshot().finished)
        elif kind == "apply":
            adm.apply(ControlAction(op[1], op[2]))
        # a cap never lets an engine grow a bucket past it
        for e, row in zip(engines, before, strict=True):
            for b, cap in enumerate(adm.caps):
                if cap is not None and kind in ("admit", "admit_pool"):
                    assert e.num_unfinished(b) <= max(row[b], cap)
        if bound is not None:
            assert all(len(q) <= bound for q in adm.queues)
        # every request is queued, inside an engine, finished, rejected or cancelled
        queued = {item[0].request_id for q in adm.queues for item in q}
        rejected = {r.request_id for r in adm.rejected}
        inside = sum(e.num_unfinished_total() for e in engines)
        assert len(queued) + inside + len(finished) + len(rejected) + len(cancelled) == len(
            submitted)
        assert not (queued & rejected) and not (queued & finished) and not (queued & cancelled)
        assert not (finished & rejected) and not (cancelled & (finished | rejected))
    counters = adm.take_counters()
    assert sum(counters.arrived) == arrivals
    assert sum(counters.rejected) == len(adm.rejected)
    assert sum(counters.cancelled) == len(cancelled)


# ---------------------------------------------------------------- KV budget
WHOLE_POOL = AdmissionDiscipline("fifo", KvBudget(1.0, "final"))


def test_kv_budget_counts_whole_blocks_so_the_admitted_set_never_preempts() -> None:
    # 4 x (65 + 200) = 1,060 tokens fit 67 blocks (1,072 tokens) as a token sum, but each
    # request ends on 17 blocks (272 tokens): only 3 fit, and the 4th waits for one to finish.
    engine = sim_engine(0, "fp16", blocks=67, kv_reserve="oracle")
    adm = Admission([engine], BUCKETS, MAX_LEN, AdmissionConfig())
    adm.configure(WHOLE_POOL, 2.0)  # a KV budget of the whole pool
    adm.apply(ControlAction((8,) * 3, ("fp16",) * 3))  # capped: queued, budgeted
    for i in range(4):
        adm.submit(Request(i, 0.0, 65, 200))
    adm.admit(engine)
    assert engine.num_unfinished_total() == 3 and adm.num_queued() == 1
    assert engine.committed_tokens() == 3 * 272
    finished = []
    while engine.num_unfinished_total() or adm.num_queued():
        engine.step(1e9)
        finished += engine.snapshot().finished
        adm.admit(engine)
    assert sorted(r.request_id for r in finished) == [0, 1, 2, 3]
    assert sum(r.preemptions for r in finished) == 0 and engine.committed_tokens() == 0


def test_kv_budget_reserves_the_declared_max_tokens_cut_to_the_context() -> None:
    # max_tokens=400 declared: 65 + 400 = 465 -> 30 blocks each, so 2 fit in 67 blocks
    # (each still generates 200); max_tokens past the context commits the context (512).
    engine = sim_engine(0, "fp16", blocks=67, kv_reserve="declared")
    adm = Admission([engine], BUCKETS, MAX_LEN, AdmissionConfig())
    adm.configure(WHOLE_POOL, 2.0)
    adm.apply(ControlAction((8,) * 3, ("fp16",) * 3))
    for i in range(3):
        adm.submit(Request(i, 0.0, 65, 200, max_tokens=400))
    adm.admit(engine)
    assert engine.num_unfinished_total() == 2 and engine.committed_tokens() == 2 * 480
    assert engine.kv_tokens_to_admit(Request(9, 0.0, 65, 200, max_tokens=10_000), 0,
                                     65) == 512
    # no max_tokens declared: vLLM lets it run to the end of the context
    assert engine.kv_tokens_to_admit(Request(9, 0.0, 65, 200), 0, 65) == 512
    assert engine.kv_tokens_to_admit(Request(9, 0.0, 65, 100, max_tokens=200), 0, 65) == 272
