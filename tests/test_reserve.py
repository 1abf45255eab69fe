"""The KV budget's per-request count: declared limits, the observed-output estimate, growth."""

from __future__ import annotations

import argparse
import asyncio
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlbatch.commands.options import add_deployment_options, deployment_spec_from_args
from rlbatch.engine.config import EngineConfig
from rlbatch.engine.reserve import (
    KV_COMMIT_MODES,
    SHIFT_TRIGGER,
    KvCommitMode,
    OutputReserve,
    declared_output_limit,
    peak_commitment,
)
from rlbatch.request import Request
from rlbatch.serving.builders import build_deployment
from rlbatch.sidecar.settings import UpstreamSpec
from rlbatch.sidecar.upstream import HttpUpstream, Ticket
from tests.factories import record, sim_engine

MAX_LEN = 512


def test_declared_limit_is_max_tokens_or_the_rest_of_the_context() -> None:
    assert declared_output_limit(Request(0, 0.0, 100, 50), 100, MAX_LEN) == 412
    assert declared_output_limit(Request(0, 0.0, 100, 50, max_tokens=80), 100, MAX_LEN) == 80
    assert declared_output_limit(Request(0, 0.0, 100, 50, max_tokens=9999), 100, MAX_LEN) == 412


@pytest.mark.parametrize(("mode", "expected"), [
    ("oracle", 160),     # 100 + the real 50 -> 10 blocks
    ("declared", 512),   # no max_tokens: the whole context
    ("observed", 512),   # nothing observed yet: the prior (4,096) is past the limit here
])
def test_admission_count_by_mode(mode: str, expected: int) -> None:
    reserve = OutputReserve(mode, 1, 16, MAX_LEN)  # type: ignore[arg-type]
    assert reserve.at_admission(Request(0, 0.0, 100, 50), 0, 100) == expected


@pytest.mark.parametrize(("mode", "max_tokens", "prior", "expected"), [
    ("observed", None, 4096, 4208),     # 100 + 4,096 -> 263 blocks, not the 128k context
    ("observed", None, 1000, 1104),     # 100 + 1,000 -> 69 blocks
    ("observed", 2000, 4096, 2112),     # never above the request's own max_tokens
    ("declared", None, 4096, 131072),   # declared ignores the prior
])
def test_cold_start_reserves_the_prior_on_a_long_context(mode: str, max_tokens: int | None,
                                                         prior: int, expected: int) -> None:
    reserve = OutputReserve(mode, 1, 16, 131072,  # type: ignore[arg-type]
                            prior_output_tokens=prior)
    assert reserve.at_admission(Request(0, 0.0, 100, 50, max_tokens=max_tokens), 0,
                                100) == expected


def test_prior_gives_way_to_the_observed_quantile() -> None:
    reserve = OutputReserve("observed", 1, 16, 131072, quantile=1.0, min_samples=2)
    reserve.observe(0, 40000)
    assert reserve.at_admission(Request(0, 0.0, 100, 50), 0, 100) == 4208  # 1 < min_samples
    reserve.observe(0, 40000)
    assert reserve.at_admission(Request(0, 0.0, 100, 50), 0, 100) == 40112  # 100 + 40,000


def test_observed_reserves_the_bucket_quantile_once_it_has_enough_completions() -> None:
    # outputs rising 1..100 are a turn to longer answers: without the shift rule here
    reserve = OutputReserve("observed", 2, 16, MAX_LEN, quantile=0.9, min_samples=16,
                            shift_trigger=None)
    for out in range(1, 16):
        reserve.observe(0, out)
    assert reserve.expected_output(0) is None  # 15 < min_samples
    for out in range(16, 101):
        reserve.observe(0, out)
    assert reserve.expected_output(0) == 91  # sorted 1..100, index int(0.9 * 100)
    assert reserve.expected_output(1) == 91  # no history of its own yet: the pooled one
    for _ in range(16):
        reserve.observe(1, 7)
    assert reserve.expected_output(1) == 7  # then its own
    assert reserve.at_admission(Request(0, 0.0, 100, 50), 0, 100) == 192  # 100 + 91 -> 12 blocks
    assert reserve.at_admission(Request(0, 0.0, 100, 30, max_tokens=40), 0, 100) == 144


def test_observed_history_is_a_sliding_window() -> None:
    reserve = OutputReserve("observed", 1, 16, MAX_LEN, window=32, min_samples=1, quantile=1.0)
    for _ in range(32):
        reserve.observe(0, 300)
    for _ in range(32):
        reserve.observe(0, 10)
    assert reserve.expected_output(0) == 10


@given(outs=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 500)), max_size=400),
       quantile=st.sampled_from([0.5, 0.9, 0.99, 1.0]))
def test_quantile_is_the_one_of_the_sorted_window(outs: list[tuple[int, int]],
                                                  quantile: float) -> None:
    """The reserve keeps its windows sorted as completions come and go: each quantile is
    the one of ``sorted(window)``."""
    r = OutputReserve("observed", 3, 16, MAX_LEN, window=32, min_samples=4, quantile=quantile)
    for bucket, out in outs:
        r.observe(bucket, out)
        own, pooled = sorted(r._history[bucket]), sorted(r._history[-1])
        assert r._sorted[bucket] == own and r._sorted[-1] == pooled
        pick = own if len(own) >= 4 else pooled if len(pooled) >= 4 else None
        expected = None if pick is None else pick[min(len(pick) - 1, int(quantile * len(pick)))]
        assert r.expected_output(bucket) == expected


def test_a_turn_to_longer_outputs_forgets_the_history_before_it() -> None:
    reserve = OutputReserve("observed", 2, 16, MAX_LEN)  # 0.9, 256 kept, 6 of the last 16
    plain = OutputReserve("observed", 2, 16, MAX_LEN, shift_trigger=None)
    for r in (reserve, plain):
        for _ in range(256):
            r.observe(0, 50)
        for _ in range(5):
            r.observe(0, 400)
    assert reserve.expected_output(0) == 50 and len(reserve._history[0]) == 256
    twin = reserve.fork()
    reserve.observe(0, 400)  # the sixth of the last 16 past the quantile (50)
    assert list(reserve._history[0]) == [50] * 10 + [400] * 6
    assert reserve.expected_output(0) == 400  # index int(0.9 x 16) of 10 x 50, 6 x 400
    assert list(reserve._history[-1]) == [50] * 10 + [400] * 6  # the pooled history too
    assert reserve.expected_output(1) == 400
    assert len(twin._history[0]) == 256 and twin.expected_output(0) == 50  # forks apart
    # without the rule the window turns only once 10% of it is long: 26 completions
    plain.observe(0, 400)
    assert plain.expected_output(0) == 50
    for _ in range(19):
        plain.observe(0, 400)
    assert plain.expected_output(0) == 50  # 25 long
    plain.observe(0, 400)
    assert plain.expected_output(0) == 400 and len(plain._history[0]) == 256


def test_steady_or_shortening_outputs_keep_the_whole_window() -> None:
    reserve = OutputReserve("observed", 1, 16, MAX_LEN)
    lengths = []
    for i in range(2000):  # 1..100 in a fixed shuffle: 10% past the 0.9-quantile
        reserve.observe(0, (37 * i) % 100 + 1)
        lengths.append(len(reserve._history[0]))
    for _ in range(256):  # a turn to shorter answers
        reserve.observe(0, 3)
        lengths.append(len(reserve._history[0]))
    assert lengths[255:] == [256] * (len(lengths) - 255)
    assert reserve.expected_output(0) == 3


@pytest.mark.parametrize("bad", [{"shift_trigger": 0}, {"shift_trigger": 17},
                                 {"shift_window": 300}])
def test_bad_shift_settings_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="shift_trigger"):
        OutputReserve("observed", 1, 16, MAX_LEN, **bad)  # type: ignore[arg-type]


@given(prompt=st.integers(1, 300), reserve_out=st.integers(0, 200), cap_out=st.integers(1, 200))
def test_growth_starts_exactly_where_next_growth_at_says(prompt: int, reserve_out: int,
                                                         cap_out: int) -> None:
    r = OutputReserve("observed", 1, 16, MAX_LEN)
    limit = r.limit_tokens(Request(0, 0.0, prompt, 1, max_tokens=reserve_out + cap_out), prompt)
    reserved = min(limit, -(-(prompt + reserve_out) // 16) * 16)
    at = r.next_growth_at(reserved, limit, prompt)
    if reserved >= limit:
        assert r.grown(reserved, limit, prompt, 10_000) == reserved
        return
    assert at >= 0
    if at > 0:
        assert r.grown(reserved, limit, prompt, at - 1) == reserved
    grown = r.grown(reserved, limit, prompt, at)
    assert reserved < grown <= limit and grown % 16 == 0
    assert r.grown(reserved, limit, prompt, 10_000) == limit


@given(mode=st.sampled_from(["observed", "declared", "oracle"]),
       outs=st.lists(st.tuples(st.integers(0, 1), st.integers(1, 600)), max_size=40),
       prompt=st.integers(1, 500), real=st.integers(1, 600),
       max_tokens=st.none() | st.integers(600, 2000), bucket=st.integers(0, 1))
def test_admission_is_limit_within_and_next_growth_in_one_call(
        mode: str, outs: list[tuple[int, int]], prompt: int, real: int,
        max_tokens: int | None, bucket: int) -> None:
    """The simulator's one call per admitted request gives the figures of the three."""
    r = OutputReserve(mode, 2, 16, 1024, min_samples=4,  # type: ignore[arg-type]
                      prior_output_tokens=300)
    for b, out in outs:
        r.observe(b, out)
    request = Request(0, 0.0, prompt, real, max_tokens=max_tokens)
    limit = r.limit_tokens(request, prompt)
    count = r.within(limit, bucket, prompt)
    assert r.admission(request, bucket, prompt) == (
        limit, count, r.next_growth_at(count, limit, prompt))


def test_engine_count_grows_as_a_request_outruns_its_reserve() -> None:
    engine = sim_engine(0, "fp16", blocks=200)
    reserve = engine._reserve
    for _ in range(16):
        reserve.observe(0, 20)  # bucket 0 usually answers in 20 tokens
    engine.add_request(Request(0, 0.0, 32, 300), 0, 32, False)
    assert engine.committed_tokens() == 64  # 32 + 20 -> 4 blocks
    seen = set()
    while not engine.is_idle():
        running = list(engine._running)
        engine.step(engine.now_s)  # one iteration at a time (no event skipping)
        if running and not engine.is_idle():
            out = engine.pending()[0][3]
            expected = max(64, min(512, -(-(32 + 2 * out) // 16) * 16))
            assert engine.committed_tokens() == expected, out
            seen.add(expected)
    assert {64, 80, 336, 512} <= seen  # reserve, first growth, midway, the context
    assert engine.committed_tokens() == 0 and reserve._history[0][-1] == 300  # learnt


def test_fork_does_not_feed_the_original_history() -> None:
    engine = sim_engine(0, "fp16")
    twin = engine.fork()
    twin._reserve.observe(0, 5)
    assert len(engine._reserve._history[0]) == 0 and len(twin._reserve._history[0]) == 1
    assert len(engine._reserve._history[-1]) == 0


@pytest.mark.parametrize("bad", [{"kv_reserve": "guess"}, {"kv_reserve_quantile": 0.0},
                                 {"kv_reserve_quantile": 1.5}])
def test_bad_reserve_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="kv_reserve"):
        EngineConfig(**bad)  # type: ignore[arg-type]


def test_a_prior_below_one_token_is_refused() -> None:
    with pytest.raises(ValueError, match="prior_output_tokens"):
        OutputReserve("observed", 1, 16, MAX_LEN, prior_output_tokens=0)


def test_sidecar_upstream_counts_observed_outputs_after_enough_completions() -> None:
    loop = asyncio.new_event_loop()
    try:
        tickets: dict[int, Ticket] = {}
        upstream = HttpUpstream(0, UpstreamSpec("fp16", "http://127.0.0.1:9"), 1, tickets,
                                lambda: 0.0, 64, kv_reserve_quantile=0.5)

        def forward(i: int, max_out: int) -> Ticket:
            ticket = Ticket(Request(i, 0.0, 100, max_out), 0, loop.create_future())
            tickets[i] = ticket
            upstream.add_request(ticket.request, 0, 100, False)
            return ticket

        first = forward(0, 1000)
        assert upstream.committed_tokens() == 1100  # nothing observed: the declared limit
        upstream.release(first, record(0, 0, output_tokens=40))
        for i in range(1, 16):
            upstream.release(forward(i, 1000), record(i, 0, output_tokens=40))
        assert upstream.committed_tokens() == 0
        forward(16, 1000)
        forward(17, 30)  # never counted above its own max_tokens
        assert upstream.committed_tokens() == (100 + 40) + (100 + 30)
    finally:
        loop.close()


def _projected_peak(held: int, current: list[int], remaining: list[int], block: int) -> int:
    """The projection's peak by brute force: every iteration from now until the last
    request reaches its count, each alive request's KV in whole blocks."""
    best = 0
    for k in range(max(remaining, default=0) + 1):
        best = max(best, sum(-(-(c + k) // block) * block
                             for c, r in zip(current, remaining, strict=True) if r >= k))
    return held + best


def test_peak_commitment_by_hand() -> None:
    # counts of 112 and 80 tokens (7 and 5 blocks), 100 and 50 tokens in: the peak is just
    # before the first finishes (k = 12: 112 + 62, the second with up to a block's rounding),
    # not the sum of the counts (192)
    assert peak_commitment(10, [(100, 112), (50, 80)], 16) == 10 + 112 + 62 + 15
    assert peak_commitment(10, [(100, 112), (50, 80)], 1) == 10 + 112 + 62
    assert peak_commitment(7, [], 16) == 7


@given(st.integers(0, 500), st.lists(st.tuples(st.integers(1, 20), st.integers(0, 320)),
                                     max_size=8), st.sampled_from([1, 16]))
def test_peak_commitment_bounds_the_projected_blocks(
        held: int, requests: list[tuple[int, int]], block: int) -> None:
    # counts are whole blocks; each request is somewhere on its way to its count
    counts = [blocks * block for blocks, _ in requests]
    current = [max(1, count - grow) for count, (_, grow) in zip(counts, requests, strict=True)]
    remaining = [count - cur for count, cur in zip(counts, current, strict=True)]
    bound = peak_commitment(held, list(zip(current, counts, strict=True)), block)
    assert bound >= _projected_peak(held, current, remaining, block)
    assert bound <= held + sum(counts) + len(counts) * (block - 1)
    if block == 1:  # nothing to round: the bound is the peak
        assert bound == _projected_peak(held, current, remaining, 1)


@pytest.mark.parametrize("commit", KV_COMMIT_MODES)
def test_engine_peak_bounds_the_kv_its_decoding_requests_will_hold(commit: KvCommitMode) -> None:
    # oracle counts are exact: the projection made once every request decodes bounds the
    # blocks they hold from then on, and (peak) is below the sum of their counts
    engine = sim_engine(0, "fp16", blocks=400, max_num_seqs=8, kv_reserve="oracle",
                        event_skipping=False)
    for i, (prompt, output) in enumerate([(40, 200), (100, 30), (20, 90), (64, 120)]):
        engine.add_request(Request(i, 0.0, prompt, output), 0, prompt, False)
    while any(s.num_output == 0 for s in engine._running) or engine._waiting:
        engine.step(math.inf)
    projected = engine.committed_with(0, commit)
    total = engine.committed_tokens()
    held_tokens = []
    while not engine.is_idle():
        # the blocks the next iteration allocates (every request decodes here): measured
        # between steps, a request's last block would be gone with it
        held_tokens.append(sum(-(-(s.num_computed + 1) // 16) for s in engine._running) * 16)
        engine.step(math.inf)
    assert max(held_tokens) <= projected
    if commit == "final":
        assert projected == total
    else:
        assert projected < total - 100  # the long answer outlives the others


@pytest.mark.parametrize(("flag", "expected"), [([], True), (["--no-kv-reserve-shift"], False)])
def test_the_shift_rule_is_a_deployment_flag(flag: list[str], expected: bool) -> None:
    parser = argparse.ArgumentParser()
    add_deployment_options(parser)
    spec = deployment_spec_from_args(parser.parse_args(flag))
    assert spec.kv_reserve_shift is expected
    engine = build_deployment(spec).engines[0]
    assert engine._reserve.shift_trigger == (SHIFT_TRIGGER if expected else None)
