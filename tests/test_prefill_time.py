"""The least time an arrival's own prefill takes: chunks of the token budget after the prefix
an engine's caches hold, read without changing the engine (admission's predicted TTFT adds it
to the predicted wait)."""

from __future__ import annotations

import pytest

from rlbatch.engine.config import EngineConfig
from rlbatch.engine.prefix_cache import prefix_layout
from rlbatch.engine.sim import SimEngine
from rlbatch.profiles import StepTimeModel
from rlbatch.request import Request
from tests.factories import ConstantStep


class PrefillStep(StepTimeModel):
    """1 ms per iteration plus 10 us per prompt token and 1 ns per attention pair."""

    def step_time_s(self, num_prefill_tokens: int, prefill_attn_work: float,
                    num_decode_seqs: int, decode_kv_tokens: int) -> float:
        return 1e-3 + 1e-5 * num_prefill_tokens + 1e-9 * prefill_attn_work

    def decode_coefficients(self, num_decode_seqs: int) -> tuple[float, float]:
        return 1e-3, 0.0


def _pairs(done: int, n: int) -> float:
    return n * (done + (n + 1) / 2)


@pytest.mark.parametrize(("prompt", "cached", "chunks"), [
    (100, 0, [(0, 100)]),
    (600, 0, [(0, 256), (256, 256), (512, 88)]),
    (600, 512, [(512, 88)]),
    (600, 600, [(599, 1)]),  # a full hit still computes the last token (its logits)
    (600, 9999, [(599, 1)]),
])
def test_prefill_time_sums_the_chunks_after_the_cached_prefix(
        prompt: int, cached: int, chunks: list[tuple[int, int]]) -> None:
    model = PrefillStep()
    expected = sum(1e-3 + 1e-5 * n + 1e-9 * _pairs(done, n) for done, n in chunks)
    assert model.prefill_time_s(prompt, cached, 256) == pytest.approx(expected, rel=1e-12)


def test_prefill_time_refuses_a_budget_under_one() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        PrefillStep().prefill_time_s(10, 0, 0)


def _engine() -> SimEngine:
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256)
    return SimEngine(0, "fp16", cfg, ConstantStep(0.01), num_kv_blocks=400,
                     max_model_len=2048, gpu_memory_total_bytes=1 << 30, num_buckets=1)


def test_the_engine_counts_its_cached_prefix_and_changes_nothing() -> None:
    """After a 1,100-token prompt of prefix blocks (1, 2, 3) finished, an arrival sharing its
    first two 512-token blocks needs 76 tokens computed (one 10-ms chunk); one sharing
    nothing needs five chunks of 256. Reading it twice gives the same and the engine's next
    run is the one it would have been without the reads."""
    runs = []
    for read in (False, True):
        eng = _engine()
        eng.add_request(Request(0, 0.0, 1100, 2, prefix_ids=(1, 2, 3)), 0, 1100, False)
        while not eng.is_idle():
            eng.step(1e9)
        shared = Request(1, eng.now_s, 1100, 2, prefix_ids=(1, 2, 9))
        other = Request(2, eng.now_s, 1100, 2, prefix_ids=(7, 8, 9))
        if read:
            assert eng.cached_prompt_tokens(shared, 1100) == 1024
            assert eng.prefill_time_s(shared, 1100).alone_s == pytest.approx(0.01)
            assert eng.prefill_time_s(shared, 1100).alone_s == pytest.approx(0.01)
            assert eng.cached_prompt_tokens(other, 1100) == 0
            assert eng.prefill_time_s(other, 1100).alone_s == pytest.approx(0.05)
            # no prefix information: nothing is known cached
            assert eng.prefill_time_s(Request(3, eng.now_s, 1100, 2), 1100).alone_s == (
                pytest.approx(0.05))
        eng.check_invariants()
        for request in (shared, other):
            eng.add_request(request, 0, 1100, False)
        while not eng.is_idle():
            eng.step(1e9)
            eng.check_invariants()
        runs.append(eng.snapshot())
    assert runs[0] == runs[1]
    assert runs[0].prefix_cache_hits == runs[1].prefix_cache_hits > 0


@pytest.mark.parametrize("ids", [None, (1, 2, 3), (1, 2, 9)])
def test_on_an_idle_engine_the_estimate_is_the_simulated_ttft(
        ids: tuple[int, ...] | None) -> None:
    """With nothing else running, the estimate for a 1,100-token arrival is exactly the TTFT
    the simulator then gives it: after a request with prefix blocks (1, 2, 3) finished, with
    no prefix information, the whole prefix cached (the last block recomputed) and the
    first two blocks cached."""
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256)
    eng = SimEngine(0, "fp16", cfg, PrefillStep(), num_kv_blocks=400, max_model_len=2048,
                    gpu_memory_total_bytes=1 << 30, num_buckets=1)
    eng.add_request(Request(0, 0.0, 1100, 2, prefix_ids=(1, 2, 3)), 0, 1100, False)
    while not eng.is_idle():
        eng.step(1e9)
    eng.snapshot()
    arrival = Request(1, eng.now_s, 1100, 2, prefix_ids=ids)
    estimate, behind = eng.prefill_time_s(arrival, 1100)
    assert behind == estimate  # nothing running
    eng.add_request(arrival, 0, 1100, False)
    while not eng.is_idle():
        eng.step(1e9)
    (finished,) = eng.snapshot().finished
    assert finished.ttft_s == pytest.approx(estimate, rel=1e-12)


def test_the_cache_read_counts_the_evictions_pending_since_its_last_update() -> None:
    """A request without prefix information allocates blocks without updating the prefix
    cache's free queue: the cached blocks at its head are evicted only at the next lookup.
    The read counts them as gone, as that lookup will find, and evicts nothing itself."""
    eng = SimEngine(0, "fp16", EngineConfig(max_num_seqs=8, max_num_batched_tokens=256),
                    ConstantStep(0.01), num_kv_blocks=100, max_model_len=1600,
                    gpu_memory_total_bytes=1 << 30, num_buckets=1)
    eng.add_request(Request(0, 0.0, 1100, 2, prefix_ids=(1, 2, 3)), 0, 1100, False)
    while not eng.is_idle():
        eng.step(1e9)
    eng.add_request(Request(1, eng.now_s, 1400, 50), 0, 1400, False)
    for _ in range(6):  # its prefill: blocks taken from the free queue's head
        eng.step(eng.now_s)
    again = Request(2, eng.now_s, 1100, 2, prefix_ids=(1, 2, 3))
    cache = eng._cache
    assert cache is not None
    layout = prefix_layout((1, 2, 3), 1100, 1100, 16)
    max_blocks = 1099 // 16
    stale = cache._hit(layout, max_blocks, {})  # the groups as last updated
    synced = cache.fork().lookup(layout, max_blocks, eng._free_blocks)
    assert eng.cached_prompt_tokens(again, 1100) == synced * 16
    assert synced < stale
    assert cache._hit(layout, max_blocks, {}) == stale  # nothing evicted by the read
    eng.check_invariants()


def test_behind_running_prefills_their_remaining_chunks_come_first() -> None:
    """Two 256-token chunks into a 1,100-token prefill, a 300-token arrival waits for the
    remaining 588 tokens' chunks (counted alone, from 512 computed) before its own; once that
    request decodes, it delays nothing."""
    model = PrefillStep()
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256)
    eng = SimEngine(0, "fp16", cfg, model, num_kv_blocks=400, max_model_len=2048,
                    gpu_memory_total_bytes=1 << 30, num_buckets=1)
    eng.add_request(Request(0, 0.0, 1100, 50), 0, 1100, False)
    eng.step(0.0)
    eng.step(0.0)
    arrival = Request(1, eng.now_s, 300, 2)
    alone = model.prefill_time_s(300, 0, 256)
    assert eng.prefill_time_s(arrival, 300) == (
        pytest.approx(alone), pytest.approx(model.prefill_time_s(1100, 512, 256) + alone))
    for _ in range(4):  # its last three chunks, then its first decode
        eng.step(eng.now_s)
    assert eng.prefill_time_s(arrival, 300) == (pytest.approx(alone), pytest.approx(alone))
    eng.check_invariants()
