"""Deadline order in admission's queues: requests that can still meet their TTFT go first."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from envs.batch_size import BatchSizeEnv
from policies.ppo import PpoController, ppo_factory
from policies.rules import fixed_factory
from policies.training.finetune import recipe_env_kwargs
from rlbatch.buckets import Buckets
from rlbatch.control.controllers import make_controller
from rlbatch.control.discipline import (
    PPO_QUEUE_ORDER,
    AdmissionDiscipline,
    KvBudget,
    check_queue_order,
)
from rlbatch.control.types import SLA, ControlAction, DeploymentInfo
from rlbatch.engine.base import Engine
from rlbatch.engine.config import EngineConfig
from rlbatch.engine.sim import SimEngine
from rlbatch.request import Request
from rlbatch.serving.admission import (
    Admission,
    AdmissionConfig,
    Admitted,
    Queued,
)
from rlbatch.serving.arrival_queue import turns_late_at
from rlbatch.serving.builders import build_deployment
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.loop import ControlLoop
from rlbatch.serving.run import run
from rlbatch.sidecar.control_tick import describe_action
from rlbatch.workload.base import build_workload
from tests.factories import BUCKETS, ConstantStep, sim_engine

MAX_LEN = 512
LATE_AFTER_S = 2.0


def _one_engine(blocks: int = 64) -> tuple[Admission, SimEngine]:
    engine = sim_engine(0, "fp16", blocks=blocks, kv_reserve="oracle")
    engines: list[Engine] = [engine]
    return Admission(engines, BUCKETS, MAX_LEN, AdmissionConfig()), engine


def _serve(adm: Admission, caps: tuple[int | None, ...],
           late_after_s: float | None = LATE_AFTER_S, budget: float | None = None) -> None:
    """Put ``caps`` in force under FIFO (``late_after_s=None``) or deadline order, with a KV
    budget counting the final KV when ``budget`` is a fraction."""
    kv_budget = None if budget is None else KvBudget(budget, "final")
    order = "fifo" if late_after_s is None else "deadline"
    adm.configure(AdmissionDiscipline(order, kv_budget),
                  math.inf if late_after_s is None else late_after_s)
    adm.apply(ControlAction(caps, ("fp16",) * 3))


def _admitted(adm: Admission, submitted: int) -> list[int]:
    """The ids of the first ``submitted`` requests no longer in admission's queues."""
    queued = {item[0].request_id for q in adm.queues for item in q}
    return [rid for rid in range(submitted) if rid not in queued]


# ---------------------------------------------------------------- the order
@pytest.mark.parametrize(("late_after_s", "first"), [(None, 0), (LATE_AFTER_S, 2)])
def test_an_on_time_request_goes_before_late_ones_of_its_bucket(
        late_after_s: float | None, first: int) -> None:
    adm, engine = _one_engine()
    _serve(adm, (1, 1, 1), late_after_s)
    for rid, arrival in enumerate((0.0, 0.5, 3.0, 3.5)):
        adm.submit(Request(rid, arrival, 10, 5))
    engine.advance_idle(4.0)  # requests 0 and 1 waited over 2 s: late; 2 and 3 on time
    assert adm.admit(engine) == 1
    assert _admitted(adm, 4) == [first]


def _entry_order(adm: Admission, engine: SimEngine, monkeypatch: pytest.MonkeyPatch
                 ) -> list[int]:
    """The ids :meth:`Admission.admit` hands ``engine``, in order."""
    order: list[int] = []
    original = engine.add_request

    def add(request: Request, bucket: int, prompt_tokens: int, truncated: bool) -> None:
        order.append(request.request_id)
        original(request, bucket, prompt_tokens, truncated)

    monkeypatch.setattr(engine, "add_request", add)
    adm.admit(engine)
    return order


def test_on_time_requests_go_before_older_late_ones_of_other_buckets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    adm, engine = _one_engine()
    _serve(adm, (8, 8, 8))
    adm.submit(Request(0, 0.0, 10, 5))    # bucket 0, late at 4 s
    adm.submit(Request(1, 1.0, 200, 5))   # bucket 2, late
    adm.submit(Request(2, 2.5, 100, 5))   # bucket 1, on time
    adm.submit(Request(3, 3.0, 10, 5))    # bucket 0, on time
    engine.advance_idle(4.0)
    # on time, oldest first; then late, oldest first
    assert _entry_order(adm, engine, monkeypatch) == [2, 3, 0, 1]


def test_fifo_is_oldest_head_first_whatever_waited(monkeypatch: pytest.MonkeyPatch) -> None:
    adm, engine = _one_engine()
    _serve(adm, (8, 8, 8), None)
    adm.submit(Request(0, 0.0, 10, 5))
    adm.submit(Request(1, 2.5, 100, 5))
    engine.advance_idle(4.0)
    assert _entry_order(adm, engine, monkeypatch) == [0, 1]


@pytest.mark.parametrize(("late_after_s", "in_engine"), [(None, 12), (LATE_AFTER_S, 8)])
def test_deadline_order_gives_an_engine_no_more_than_it_runs_at_once(
        late_after_s: float | None, in_engine: int) -> None:
    # max_num_seqs 8: under deadline order the other 4 wait in admission, in order, and stay
    # there until a request finishes (FIFO hands the engine all 12, as the caps allow)
    adm, engine = _one_engine(blocks=400)
    _serve(adm, (16, 16, 16), late_after_s)
    for rid in range(12):
        adm.submit(Request(rid, 0.1 * rid, 10, 5))
    engine.advance_idle(1.2)
    adm.admit(engine)
    assert engine.num_unfinished_total() == in_engine
    assert adm.num_queued() == 12 - in_engine
    assert not adm.budget_blocked
    if late_after_s is not None:
        assert adm.leaves_running(Request(12, 1.2, 10, 5), engine, True)
        assert _admitted(adm, 12) == list(range(8))
        while engine.num_unfinished_total() == 8:
            engine.step(1e9)
        left = engine.num_unfinished_total()
        adm.admit(engine)  # the freed places, and no more
        assert engine.num_unfinished_total() == min(8, left + 4)


@pytest.mark.parametrize(("late_after_s", "outcome"),
                         [(None, Admitted(1, 0)), (LATE_AFTER_S, Queued(1))])
def test_under_deadline_order_uncapped_buckets_queue_and_the_engine_limit_holds(
        late_after_s: float | None, outcome: Admitted | Queued) -> None:
    # an uncapped bucket goes straight into the engine in FIFO; under deadline order it
    # waits in its queue like the others, so that a capped bucket's request is not held
    # behind it forever and the engine gets no more than its max_num_seqs (4)
    engine = sim_engine(0, "fp16", blocks=400, max_num_seqs=4)
    adm = Admission([engine], BUCKETS, MAX_LEN, AdmissionConfig())
    _serve(adm, (8, None, None), late_after_s)
    assert adm.submit(Request(0, 0.0, 100, 5)) == outcome
    if late_after_s is None:
        return
    for rid in range(1, 6):
        adm.submit(Request(rid, 0.1 * rid, 100, 5))
    adm.submit(Request(6, 0.65, 10, 5))  # the capped bucket, after 0-5 and before 7
    adm.submit(Request(7, 0.7, 100, 5))
    engine.advance_idle(1.0)
    adm.admit(engine)
    assert engine.num_unfinished_total() == 4 and _admitted(adm, 8) == [0, 1, 2, 3]
    entered = []
    while adm.num_queued():
        engine.step(1e9)
        queued = {item[0].request_id for q in adm.queues for item in q}
        adm.admit(engine)
        entered += sorted(queued - {item[0].request_id for q in adm.queues for item in q})
        assert engine.num_unfinished_total() <= 4
    assert entered == [4, 5, 6, 7]  # in arrival order, across the two buckets


def test_a_request_submitted_late_is_queued_in_arrival_order() -> None:
    # the sidecar sizes a prompt before submitting it, so submissions can be out of order
    adm, _ = _one_engine()
    _serve(adm, (1, 1, 1))
    for rid, arrival in ((0, 1.0), (1, 3.0), (2, 0.5), (3, 2.0)):
        assert adm.submit(Request(rid, arrival, 10, 5)) == Queued(0)
    assert [item[0].request_id for item in adm.queues[0]] == [2, 0, 3, 1]


def test_an_sla_without_a_ttft_limit_has_no_late_requests() -> None:
    adm, _ = _one_engine()
    adm.configure(AdmissionDiscipline("deadline"), math.inf)
    assert adm.late_after_s is None
    adm.configure(AdmissionDiscipline("deadline"), 3.0)
    assert adm.late_after_s == 3.0
    adm.configure(AdmissionDiscipline("fifo"), 3.0)
    assert adm.late_after_s is None
    action = ControlAction((8,) * 3, ("fp16",) * 3)
    described = describe_action(action, ("a", "b", "c"), AdmissionDiscipline("deadline"))
    assert described == "a=8@fp16 b=8@fp16 c=8@fp16 order=deadline"
    assert describe_action(action, ("a", "b", "c")) == "a=8@fp16 b=8@fp16 c=8@fp16"
    two = ControlAction((None,) * 3, ("any",) * 3, 96, (("fp16", 40),))
    assert describe_action(two, ("a", "b", "c")) == (
        "a=-@any b=-@any c=-@any max_num_seqs=96 max_num_seqs@fp16=40")


def _prefill_engine() -> SimEngine:
    """One engine running one request at a time whose prefill grows with the prompt: 16
    prompt tokens per 10-ms step."""
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=16, kv_reserve="oracle")
    return SimEngine(0, "fp16", cfg, ConstantStep(), num_kv_blocks=64, max_model_len=MAX_LEN,
                     gpu_memory_total_bytes=1 << 30, num_buckets=len(BUCKETS))


def test_deadline_order_allows_for_each_buckets_prefill() -> None:
    engine = _prefill_engine()
    adm = Admission([engine], BUCKETS, MAX_LEN, AdmissionConfig())
    adm.configure(AdmissionDiscipline("deadline"), LATE_AFTER_S)
    # the middle of 0-63 and 64-127, the lower edge of the open 128+: 32, 96 and 128 tokens
    assert adm.late_margins_s == pytest.approx((0.02, 0.06, 0.08))
    probe = [engine.prefill_time_s(Request(-1, 0.0, p, 1), p) for p in (32, 96, 128)]
    assert adm.late_margins_s == tuple(t.alone_s for t in probe if t is not None)
    adm.configure(AdmissionDiscipline("deadline"), 0.05)  # never more than the TTFT itself
    assert adm.late_margins_s == pytest.approx((0.02, 0.05, 0.05))
    adm.configure(AdmissionDiscipline("fifo"), LATE_AFTER_S)
    assert adm.late_margins_s == (0.0, 0.0, 0.0)
    off = Admission([engine], BUCKETS, MAX_LEN, AdmissionConfig(deadline_prefill=False))
    off.configure(AdmissionDiscipline("deadline"), LATE_AFTER_S)
    assert off.late_margins_s == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(("deadline_prefill", "first"), [(False, 0), (True, 1)])
def test_a_long_prompt_is_late_once_its_prefill_no_longer_fits_the_ttft(
        deadline_prefill: bool, first: int) -> None:
    engine = _prefill_engine()
    adm = Admission([engine], BUCKETS, MAX_LEN, AdmissionConfig(
        deadline_prefill=deadline_prefill))
    adm.configure(AdmissionDiscipline("deadline"), LATE_AFTER_S)
    adm.apply(ControlAction((None,) * 3, ("fp16",) * 3))
    adm.submit(Request(0, 0.0, 200, 5))  # 128+: allowed 0.08 s of prefill
    adm.submit(Request(1, 0.05, 10, 5))  # 0-63: allowed 0.02 s
    engine.advance_idle(1.95)
    # request 0 waited 1.95 s (1.95 + 0.08 > 2: late), request 1 1.9 s (1.92: on time); by
    # their waits alone both are on time and the older goes first
    assert adm.admit(engine) == 1
    assert _admitted(adm, 2) == [first]


# ---------------------------------------------------------------- the KV budget
def test_the_budget_holds_the_on_time_request_and_says_when_it_turns_late() -> None:
    # 67 blocks, each request ends on 17 (65 + 200 tokens): three fit, the fourth is held.
    adm, engine = _one_engine(blocks=67)
    _serve(adm, (8, 8, 8), budget=1.0)
    for rid, arrival in enumerate((0.0, 0.2, 0.4, 0.6, 2.5)):
        adm.submit(Request(rid, arrival, 65, 200))
    engine.advance_idle(3.0)  # 0-3 late, 4 on time
    assert adm.admit(engine) == 3  # 4 first, then the oldest late ones
    assert _admitted(adm, 5) == [0, 1, 4]
    assert adm.budget_blocked and adm.blocked_late
    assert adm.order_change_s == math.inf  # what is held stays held until something finishes
    adm.submit(Request(5, 3.0, 65, 200))  # on time: it goes before the late request 2
    adm.admit(engine)
    assert adm.budget_blocked and not adm.blocked_late
    # late once its wait plus its bucket's prefill (one 10-ms step) passes the TTFT
    assert adm.late_margins_s[0] == pytest.approx(0.01)
    assert adm.order_change_s == turns_late_at(3.0, LATE_AFTER_S - adm.late_margins_s[0])
    assert 4.99 <= adm.order_change_s <= math.nextafter(4.99, math.inf)
    # an on-time arrival ranks behind the held on-time request: it cannot run before it
    assert adm.leaves_running(Request(6, 3.1, 65, 200), engine, True)


def test_an_on_time_arrival_may_go_before_a_late_request_the_budget_holds() -> None:
    adm, engine = _one_engine(blocks=67)
    _serve(adm, (8, 8, 8), budget=1.0)
    for rid in range(4):
        adm.submit(Request(rid, 0.0, 65, 200))
    engine.advance_idle(3.0)  # every one late
    adm.admit(engine)
    assert adm.budget_blocked and adm.blocked_late and adm.order_change_s == math.inf
    assert not adm.leaves_running(Request(9, 3.0, 65, 200), engine, True)
    _serve(adm, (8, 8, 8), None, budget=1.0)  # FIFO: the oldest waits first
    adm.admit(engine)
    assert adm.leaves_running(Request(9, 3.0, 65, 200), engine, True)
    assert not adm.blocked_late and adm.order_change_s == math.inf


@given(arrival=st.floats(0.0, 1e6), late_after=st.floats(0.0, 1e3))
def testturns_late_at_is_the_first_late_reading(arrival: float, late_after: float) -> None:
    turn = turns_late_at(arrival, late_after)
    assert arrival < turn - late_after
    assert not arrival < math.nextafter(turn, -math.inf) - late_after


@pytest.mark.parametrize("bad", ["lifo", "", "FIFO"])
def test_a_bad_order_raises(bad: str) -> None:
    with pytest.raises(ValueError, match="queue order must be one of"):
        AdmissionDiscipline(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- a whole run
def _burst_then_stream() -> list[tuple[float, int, int, None]]:
    # 120 requests at once, then 2/s for 60 s, which the caps serve with room to spare: FIFO
    # serves the stream behind the burst's backlog, late; deadline order serves it on time
    burst = [(0.001 * i, 300, 60, None) for i in range(120)]
    stream = [(1.0 + 0.5 * i, 300, 60, None) for i in range(120)]
    return burst + stream


def test_deadline_order_serves_more_within_the_sla_and_loses_nothing() -> None:
    workload = build_workload(_burst_then_stream(), name="burst", source="test")
    spec = DeploymentSpec(num_kv_blocks=400)
    rows = {}
    for order in ("fifo", "deadline"):
        result = run(workload, make_controller(f"fixed:4/4/4/4[order={order}]"), spec)
        rows[order] = result.row
        assert result.row["completed"] == len(workload)  # nothing dropped
    assert rows["deadline"]["goodput_rps"] > 1.5 * rows["fifo"]["goodput_rps"] > 0


# ---------------------------------------------------------------- controllers
INFO = DeploymentInfo(buckets=Buckets(), pools={"fp16": 1}, gpu="a100-80g", model="llama-2-7b",
                      default_max_num_seqs=256, max_num_batched_tokens=2048,
                      num_kv_blocks={"fp16": 2000}, block_size=16, max_model_len=4096,
                      tick_s=1.0, sla=SLA(ttft_s=1.5), capacity_rps=4.0)


@pytest.mark.parametrize(("spec", "order", "budget"), [
    ("ppo:policies/default", "deadline", KvBudget()),
    ("ppo:policies/default[order=deadline]", "deadline", KvBudget()),
    ("ppo:policies/default[release.wait_fraction=0.25,order=deadline]", "deadline",
     KvBudget()),
    ("ppo:policies/default[order=fifo]", "fifo", KvBudget()),
    ("ppo:policies/default[release=none,order=fifo]", "fifo", KvBudget()),
    ("ppo:policies/default[guard.kv_budget=none]", "deadline", None),
    ("fixed:256", "fifo", KvBudget()),
    ("fixed:256[order=deadline]", "deadline", KvBudget()),
    ("fixed:64/64/8/8[guard.p99=false,order=deadline]", "deadline", KvBudget()),
    ("fixed:64[guard.kv_budget=none,order=deadline]", "deadline", None),
    ("fixed:64[guarded=false]", "fifo", None),
    ("fixed:64[guard.kv_budget.fraction=0.5,guard.kv_budget.commit=final]", "fifo",
     KvBudget(0.5, "final")),
    ("playbook", "fifo", KvBudget(commit="final")),
    ("playbook[guard.kv_budget.commit=peak]", "fifo", KvBudget()),
    ("mpc", "deadline", KvBudget()),
    ("mpc[order=fifo]", "fifo", KvBudget()),
    ("mpc[guarded=false]", "fifo", None),
    ("static:64", "fifo", None),
    ("vllm-default", "fifo", None),
])
def test_controllers_declare_their_discipline_and_the_loop_puts_it_in_force(
        spec: str, order: str, budget: KvBudget | None) -> None:
    controller = make_controller(spec)
    assert controller.discipline == AdmissionDiscipline(order, budget)  # type: ignore[arg-type]
    deployment = build_deployment(DeploymentSpec(sla=SLA(ttft_s=1.5)))
    ControlLoop(deployment, [Request(0, 0.0, 300, 20)], controller.reset(deployment.info),
                discipline=controller.discipline)
    admission = deployment.admission
    assert admission.discipline == controller.discipline
    assert admission.late_after_s == (1.5 if order == "deadline" else None)
    assert admission.kv_budget_fraction == (None if budget is None else budget.fraction)


def test_order_settings_are_checked() -> None:
    for bad in ("lifo", ""):
        with pytest.raises(ValueError, match=re.escape("order takes fifo | deadline")):
            make_controller(f"ppo:policies/default[order={bad}]")
        with pytest.raises(ValueError, match=re.escape("order takes fifo | deadline")):
            fixed_factory("256", {"order": bad})
    with pytest.raises(ValueError, match="'order' given twice"):
        make_controller("ppo:policies/default[order=fifo,order=deadline]")
    with pytest.raises(ValueError, match="queue order must be one of"):
        PpoController(ppo_factory("policies/default", {}).artifact, order="lifo")  # type: ignore[arg-type]
    assert check_queue_order("deadline") == "deadline"


@pytest.mark.parametrize(("order", "late_after_s"), [("fifo", None), ("deadline", 2.0)])
def test_the_env_serves_its_queues_in_the_order_it_is_given(order: str,
                                                            late_after_s: float | None) -> None:
    env = BatchSizeEnv(scenario="day", episode_s=20.0, drain_s=5.0,
                       queue_order=order)  # type: ignore[arg-type]
    env.reset(seed=0)
    assert env._deployment is not None
    assert env._deployment.admission.late_after_s == late_after_s
    assert env._deployment.admission.discipline == env.pipeline.discipline
    env.step(env.action_space.sample())
    assert env._deployment.admission.late_after_s == late_after_s
    with pytest.raises(ValueError, match="queue order must be one of"):
        BatchSizeEnv(queue_order="lifo")


def test_the_recipe_fine_tunes_in_the_order_ppo_serves() -> None:
    kwargs = recipe_env_kwargs("a100-80g", "llama-2-7b", "fp16", 600.0, 3, 5)
    assert kwargs["queue_order"] == ppo_factory("policies/default", {}).order == PPO_QUEUE_ORDER
