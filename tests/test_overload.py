"""Overload rules in admission: the queue TTL, rejection on a predicted TTFT, the queued-tokens
bound, and the drain rate they read."""

from __future__ import annotations

import math

import pytest

from rlbatch.control.discipline import AdmissionDiscipline
from rlbatch.control.types import ControlAction
from rlbatch.engine.base import Engine
from rlbatch.request import Request
from rlbatch.serving.admission import HTTP_STATUS, Admission, AdmissionConfig, Queued, Rejected
from rlbatch.serving.overload import MIN_COMPLETIONS, DrainRate, predicted_wait_s
from tests.factories import BUCKETS, sim_engine

MAX_LEN = 512


def _admission(config: AdmissionConfig, order: str = "fifo", ttft_s: float = 2.0,
               caps: tuple[int | None, ...] = (1, 1, 1)) -> Admission:
    engines: list[Engine] = [sim_engine(0, "fp16", blocks=64, kv_reserve="oracle")]
    adm = Admission(engines, BUCKETS, MAX_LEN, config)
    adm.configure(AdmissionDiscipline(order, None), ttft_s)  # type: ignore[arg-type]
    adm.apply(ControlAction(caps=caps, pools=("fp16",) * len(caps)))
    return adm


def _req(rid: int, arrival_s: float, prompt: int = 10) -> Request:
    return Request(rid, arrival_s, prompt, 4)


@pytest.mark.parametrize("kwargs, match", [
    ({"queue_ttl_s": 0.0}, "queue_ttl_s"), ({"queue_ttl_s": math.inf}, "queue_ttl_s"),
    ({"reject_ttft_slack": -1.0}, "reject_ttft_slack"),
    ({"max_num_queued_tokens": 0}, "max_num_queued_tokens"),
    ({"drain_window_s": 0.0}, "drain_window_s")])
def test_bad_overload_settings_are_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdmissionConfig(**kwargs)  # type: ignore[arg-type]


def test_drain_rate_needs_enough_completions_and_forgets_the_old_ones() -> None:
    drain = DrainRate(10.0)
    drain.note([float(t) for t in range(MIN_COMPLETIONS - 1)])
    assert drain.rate(MIN_COMPLETIONS - 1.0) is None
    drain.note([3.5])  # reported late: kept in order
    assert drain.rate(9.0) == pytest.approx(MIN_COMPLETIONS / 10.0)
    assert drain.rate(13.5) is None  # 0..3.5 left the window
    drain.note([35.0 + k for k in range(MIN_COMPLETIONS)])
    assert drain.rate(42.0) == pytest.approx(MIN_COMPLETIONS / 10.0)  # a full window
    assert predicted_wait_s(0, 2.0) == 0.0
    assert predicted_wait_s(6, 2.0) == 3.0
    assert predicted_wait_s(6, None) == 0.0


def test_the_prior_stands_in_until_the_drain_rate_is_measured() -> None:
    drain = DrainRate(10.0, prior_rps=5.0)
    assert drain.rate(0.0) == 5.0
    drain.note([float(t) for t in range(MIN_COMPLETIONS - 1)])
    assert drain.rate(MIN_COMPLETIONS - 1.0) == 5.0 and drain.copy().rate(7.0) == 5.0
    drain.note([7.5])
    assert drain.rate(9.0) == pytest.approx(MIN_COMPLETIONS / 10.0)  # measured: the prior
    # no longer counts, however far from it
    drain.prior_rps = None
    assert drain.rate(30.0) is None
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="prior_rps"):
            DrainRate(10.0, prior_rps=bad)


def test_a_cold_start_predicts_with_the_capacity_configured() -> None:
    """Nothing has completed: without a capacity every arrival is queued; with 2 requests/s
    of capacity the fourth in line would wait 1.5 s > 0.5 x 2 s and is refused (the third,
    1 s, is not)."""
    for capacity, refused in ((0.0, False), (2.0, True)):
        adm = _admission(AdmissionConfig(reject_ttft_slack=0.5))
        adm.configure(AdmissionDiscipline("fifo", None), 2.0, capacity)
        for rid in range(3):
            assert isinstance(adm.submit(_req(rid, 0.1 * rid)), Queued)
        out = adm.submit(_req(3, 0.5))
        assert isinstance(out, Rejected) is refused
        if isinstance(out, Rejected):
            assert out.retry_after_s == pytest.approx(3 / 2.0)


def test_the_queue_ttl_expires_the_oldest_and_answers_503() -> None:
    adm = _admission(AdmissionConfig(queue_ttl_s=5.0))
    for rid, t in enumerate((0.0, 1.0, 2.0)):
        assert isinstance(adm.submit(_req(rid, t)), Queued)
    assert adm.next_expiry_s() == 5.0
    assert adm.expire(4.999) == []
    expired = adm.expire(6.0)
    assert [(r.request_id, out.reason, out.status) for r, out in expired] == [
        (0, "queue_ttl", 503), (1, "queue_ttl", 503)]
    assert adm.queued() == (1, 0, 0)
    assert adm.queued_prompt_tokens == 10
    assert adm.refusals["queue_ttl"] == [2, 0, 0]
    records = adm.take_rejected()
    assert [(r.request_id, r.finish_s, r.rejected) for r in records] == [(0, 6.0, True),
                                                                         (1, 6.0, True)]
    assert HTTP_STATUS["queue_ttl"] == 503


def test_a_predicted_ttft_past_the_sla_is_refused_with_the_drain_time() -> None:
    """FIFO, nothing admitted (no admit call): 9 waiting, 8 completions in the 30-s window
    (0.267/s): the next arrival would wait 33.75 s > 1.5 x 2 s and is refused with that as
    Retry-After."""
    adm = _admission(AdmissionConfig(reject_ttft_slack=1.5))
    for rid in range(8):
        assert isinstance(adm.submit(_req(rid, 10.0 + rid * 0.1)), Queued)
    # no drain rate known yet: nothing is refused
    assert isinstance(adm.submit(_req(8, 11.0)), Queued)
    adm.note_finished([float(t) for t in range(2, 2 + MIN_COMPLETIONS)])
    out = adm.submit(_req(9, 12.0))
    assert isinstance(out, Rejected) and out.reason == "predicted_ttft"
    assert out.status == 429
    assert out.retry_after_s == pytest.approx(9 / (MIN_COMPLETIONS / 30.0))
    assert adm.refusals["predicted_ttft"] == [1, 0, 0]


def test_an_arrival_whose_own_prefill_misses_the_ttft_is_refused_on_an_idle_deployment(
        ) -> None:
    """10-ms iterations of 256 tokens: a 300-token prompt takes two (20 ms) on an idle engine,
    over 1 x 15 ms, and is refused before any drain rate is known (no Retry-After: no wait is
    predicted); a 10-token one takes one and is queued. The wait and the own prefill add up:
    with 8 completions in the window and one request ahead the 10-token arrival is refused at
    a TTFT the wait alone fits under."""
    adm = _admission(AdmissionConfig(reject_ttft_slack=1.0), ttft_s=0.015)
    engine = adm.engines[0]
    assert engine.prefill_time_s(_req(0, 0.0, prompt=300), 300).alone_s == pytest.approx(0.02)
    out = adm.submit(_req(0, 0.0, prompt=300))
    assert isinstance(out, Rejected) and out.reason == "predicted_ttft"
    # late even on an empty deployment: no Retry-After, and no retry whatever retry_overload
    assert out.retry_after_s is None and out.status == 429 and out.retry is False
    assert isinstance(adm.submit(_req(1, 0.0, prompt=10)), Queued)
    rate = MIN_COMPLETIONS / 30.0
    adm.note_finished([float(t) for t in range(1, 1 + MIN_COMPLETIONS)])
    wait = adm.predicted_ttft_s(10.0)
    assert wait == pytest.approx(1 / rate)
    for ttft_s, refused in ((wait + 0.005, True), (wait + 0.015, False)):
        adm.configure(AdmissionDiscipline("fifo", None), ttft_s)
        out = adm.submit(_req(2, 10.0, prompt=10))
        assert isinstance(out, Rejected) is refused
        if isinstance(out, Rejected):  # the wait made it late: it may come back after it
            assert out.retry is True and out.retry_after_s == pytest.approx(wait)
        else:
            assert adm.cancel(2)


@pytest.mark.parametrize(("slack", "ttft_s", "refused"), [
    (0.5, 0.03, False),  # 20 ms of own prefill: over 0.5 x 30 ms, within the 30 ms itself
    (0.5, 0.019, True),
    (2.0, 0.011, False),  # a slack over 1 widens the floor's bound too: 20 ms <= 22 ms
    (2.0, 0.009, True)])
def test_the_own_prefill_is_held_to_the_ttft_not_to_a_slack_under_one(
        slack: float, ttft_s: float, refused: bool) -> None:
    """On an idle deployment (nothing waits) a 300-token prompt's two 10-ms chunks are
    compared with the TTFT, times the slack only if it is over 1; a slack under 1 bounds the
    predicted wait alone."""
    adm = _admission(AdmissionConfig(reject_ttft_slack=slack), ttft_s=ttft_s)
    out = adm.submit(_req(0, 0.0, prompt=300))
    assert isinstance(out, Rejected) is refused


def test_deadline_order_counts_only_the_on_time_requests_ahead() -> None:
    """Under deadline order late requests go after an arrival: with 8 late and 1 on time
    ahead, the predicted wait is 1 / rate = 3.75 s, under 2 x 2 s, and the arrival is let in;
    served FIFO the same queue predicts 9 / rate and refuses it."""
    outcomes = {}
    for order in ("deadline", "fifo"):
        adm = _admission(AdmissionConfig(reject_ttft_slack=2.0), order=order, ttft_s=2.0)
        for rid in range(8):
            adm.submit(_req(rid, 0.1 * rid))
        adm.submit(_req(8, 19.5))
        adm.note_finished([float(t) for t in range(10, 10 + MIN_COMPLETIONS)])
        outcomes[order] = (adm.waiting_ahead(20.0), adm.submit(_req(9, 20.0)))
    assert outcomes["deadline"][0] == 1 and isinstance(outcomes["deadline"][1], Queued)
    assert outcomes["fifo"][0] == 9 and isinstance(outcomes["fifo"][1], Rejected)


def test_the_queued_tokens_bound_counts_prompts_waiting_in_admission() -> None:
    adm = _admission(AdmissionConfig(max_num_queued_tokens=25))
    assert isinstance(adm.submit(_req(0, 0.0, prompt=20)), Queued)
    assert isinstance(adm.submit(_req(1, 0.1, prompt=5)), Queued)
    out = adm.submit(_req(2, 0.2, prompt=1))
    assert isinstance(out, Rejected) and out.reason == "queued_tokens" and out.status == 429
    assert adm.cancel(1)
    assert adm.queued_prompt_tokens == 20
    assert isinstance(adm.submit(_req(3, 0.3, prompt=1)), Queued)
    adm.apply(ControlAction(caps=(8, 8, 8), pools=("fp16",) * 3))
    adm.admit(adm.engines[0])
    assert adm.queued_prompt_tokens == 0



@pytest.mark.parametrize("retry_overload", [True, False])
def test_overload_refusals_invite_a_retry_only_when_asked(retry_overload: bool) -> None:
    """Off, the overload rules' refusals say not to retry; a full queue still invites one."""
    adm = _admission(AdmissionConfig(max_num_queued_tokens=100, max_queue_len=1,
                                     queue_ttl_s=1.0, retry_overload=retry_overload))
    assert isinstance(adm.submit(_req(0, 0.0, prompt=10)), Queued)
    full = adm.submit(_req(1, 0.1, prompt=10))
    assert isinstance(full, Rejected) and full.reason == "queue_full" and full.retry
    assert isinstance(adm.submit(_req(2, 0.2, prompt=100)), Queued)  # bucket 1: 110 tokens
    by_tokens = adm.submit(_req(3, 0.3, prompt=200))
    assert isinstance(by_tokens, Rejected) and by_tokens.reason == "queued_tokens"
    assert by_tokens.retry is retry_overload
    expired = adm.expire(5.0)
    assert [(r.request_id, out.retry) for r, out in expired] == [(0, retry_overload),
                                                                 (2, retry_overload)]
