"""Aborting a request inside an engine (the client gave up; vLLM's ``abort_request``).

Exact small cases in the simulator, one per place a request can be (waiting, prefilling in
chunks, decoding in the lane, preempted, waiting for a copy from the host tier), with prefix
caching (an aborted request's blocks stay cached for the next one) and the
``before_first_token`` rule; then random engines aborting requests at random times, run with
event skipping and request by request (the same records to the last bit, the invariants
after every call); forks; and the live vLLM engine.
"""

from __future__ import annotations

import math
import random

import pytest

from rlbatch.engine.config import EngineConfig
from rlbatch.engine.host_tier import HostLink
from rlbatch.engine.prefix_cache import Layout
from rlbatch.engine.sim import SimEngine
from rlbatch.engine.sim_seq import SimSeq
from rlbatch.engine.stats import AbortedRequest, EngineStats
from rlbatch.request import Request
from tests.factories import ConstantStep, replay
from tests.test_prefix_skipping import MAX_MODEL_LEN, _host_tier
from tests.test_prefix_skipping import _case as _prefix_case
from tests.test_sim_lane import LinearStep

DT = 0.01
"""Every iteration of ConstantStep."""
LINK = HostLink(block_bytes=1 << 20, load_s_per_block=1e-3)
"""1 MiB blocks (``kv_offload_gib = blocks / 1024``), 1 ms per block over the link."""


def _engine(*, blocks: int = 200, budget: int = 2048, max_num_seqs: int = 8,
            skipping: bool = True, host_blocks: int | None = None,
            max_model_len: int = 2048) -> SimEngine:
    gib = 0.0 if host_blocks is None else host_blocks / 1024
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                       kv_offload_gib=gib)
    return SimEngine(0, "fp16", cfg, ConstantStep(DT), num_kv_blocks=blocks,
                     max_model_len=max_model_len, gpu_memory_total_bytes=1 << 30, num_buckets=4,
                     event_skipping=skipping,
                     host_link=LINK if host_blocks is not None else None)


def _add(eng: SimEngine, rid: int, prompt: int, output: int,
         ids: tuple[int, ...] | None = None, bucket: int = 0) -> None:
    eng.add_request(Request(rid, eng.now_s, prompt, output, prefix_ids=ids), bucket, prompt,
                    False)


def _run_to(eng: SimEngine, t: float) -> None:
    """Iterations until the next one would start at or after ``t`` (as the deployment stops
    an engine at an abort's time), the invariants checked after each call."""
    while eng.now_s < t and not eng.is_idle():
        eng.step(t)
        eng.check_invariants()


def _drain(eng: SimEngine) -> EngineStats:
    _run_to(eng, math.inf)
    return eng.snapshot()


def _seq(eng: SimEngine, rid: int) -> SimSeq:
    found = eng._locate(rid)
    assert found is not None
    return found[0]


def _used(stats: EngineStats) -> int:
    return round(stats.kv_cache_usage * stats.num_kv_blocks)


# ----------------------------------------------------------------- exact small cases


def test_a_request_the_engine_does_not_hold_is_none() -> None:
    eng = _engine()
    assert eng.abort(7) is None  # never added
    _add(eng, 0, 32, 3)
    (done,) = _drain(eng).finished
    assert done.request_id == 0 and eng.abort(0) is None  # finished already
    assert eng.snapshot().aborted == ()


@pytest.mark.parametrize("skipping", [True, False])
def test_abort_a_waiting_request(skipping: bool) -> None:
    eng = _engine(max_num_seqs=1, skipping=skipping)
    _add(eng, 0, 32, 3)
    _add(eng, 1, 100, 5, bucket=2)
    eng.step(DT / 2)  # request 0 runs, request 1 waits (the cap)
    before = eng.committed_tokens()
    count = eng.kv_tokens_to_admit(Request(1, 0.0, 100, 5), 2, 100)
    assert (eng.num_unfinished(2), eng.num_waiting(2)) == (1, 1)
    rec = eng.abort(1)
    assert rec == AbortedRequest(1, 2, "fp16", 0.0, DT, 0, 0, False)
    assert (eng.num_unfinished(2), eng.num_waiting(2), eng.num_unfinished_total()) == (0, 0, 1)
    assert eng.committed_tokens() == before - count
    eng.check_invariants()
    stats = _drain(eng)
    assert [r.request_id for r in stats.finished] == [0]
    assert stats.aborted == (rec,) and stats.prefill_tokens == 32


@pytest.mark.parametrize("skipping", [True, False])
@pytest.mark.parametrize(("steps", "computed"), [(1, 512), (2, 1024)])
def test_abort_a_request_in_chunked_prefill(skipping: bool, steps: int, computed: int) -> None:
    eng = _engine(budget=512, skipping=skipping)
    _add(eng, 0, 1300, 4)  # chunks of 512, 512, 276
    for _ in range(steps):
        eng.step(math.inf)
    assert _used(eng.snapshot()) == computed // 16
    assert eng.now_s == pytest.approx(steps * DT)
    rec = eng.abort(0)
    assert rec == AbortedRequest(0, 0, "fp16", 0.0, eng.now_s, computed, 0, False)
    stats = eng.snapshot()
    assert eng.is_idle() and _used(stats) == 0 and stats.committed_tokens == 0
    assert stats.finished == () and stats.aborted == (rec,)
    eng.check_invariants()


@pytest.mark.parametrize("skipping", [True, False])
def test_abort_a_decoding_request_the_others_go_on(skipping: bool) -> None:
    eng = _engine(skipping=skipping)
    _add(eng, 0, 32, 40)
    _add(eng, 1, 20, 100)
    _add(eng, 2, 50, 30)
    _run_to(eng, 0.155)  # 16 iterations: the prefill, 15 decodes (in the lane, skipping)
    if skipping:
        assert eng._lane.n == 3
    assert eng.now_s == pytest.approx(0.16)
    rec = eng.abort(1)
    assert rec == AbortedRequest(1, 0, "fp16", 0.0, eng.now_s, 20, 16, True)
    assert eng.num_unfinished_total() == 2 and eng._lane.n == (2 if skipping else 0)
    # its 3 blocks (20 + 15 tokens computed) are back; 32 + 15 and 50 + 15 hold 3 and 5
    assert _used(eng.snapshot()) == 3 + 5
    eng.check_invariants()
    stats = _drain(eng)
    done = {r.request_id: r for r in stats.finished}
    assert sorted(done) == [0, 2] and stats.aborted == ()
    assert done[0].e2e_s == pytest.approx(40 * DT) and done[2].e2e_s == pytest.approx(30 * DT)
    assert stats.decode_tokens == 39 + 29 - 15 * 2 and stats.kv_cache_usage == 0.0


@pytest.mark.parametrize("readmitted", [False, True])
def test_abort_a_preempted_request_counts_its_recompute(readmitted: bool) -> None:
    # 4 requests of 64 prompt + 200 output tokens in 40 blocks: the newest is preempted
    eng = _engine(blocks=40, skipping=False, max_model_len=512)
    for i in range(4):
        _add(eng, i, 64, 200)
    while not any(s.preemptions for s in eng._waiting):
        eng.step(math.inf)
    victim = eng._waiting[0]
    rid, out = victim.request_id, victim.num_output
    assert rid == 3 and out > 1
    prefilled = 64
    if readmitted:  # until its recompute of the prompt and the output so far is done
        while _seq(eng, rid).num_computed < 64 + out:
            eng.step(math.inf)
            eng.check_invariants()
        prefilled += 64 + out
        out += 1
    assert eng.abort(rid, before_first_token=True) is None  # it has its first token
    rec = eng.abort(rid)
    assert rec is not None
    assert (rec.prefill_tokens_computed, rec.output_tokens, rec.first_token) == (
        prefilled, out, True)
    eng.check_invariants()
    stats = _drain(eng)
    assert sorted(r.request_id for r in stats.finished) == [0, 1, 2]
    assert stats.aborted == (rec,)


@pytest.mark.parametrize("skipping", [True, False])
def test_before_first_token_aborts_only_requests_without_one(skipping: bool) -> None:
    eng = _engine(budget=64, skipping=skipping)
    _add(eng, 0, 30, 10)
    _add(eng, 1, 200, 10)  # its prefill takes four iterations (34 + 64 + 64 + 38 tokens)
    eng.step(math.inf)
    assert eng.abort(0, before_first_token=True) is None  # produced its first token
    rec = eng.abort(1, before_first_token=True)
    assert rec == AbortedRequest(1, 0, "fp16", 0.0, DT, 34, 0, False)
    stats = _drain(eng)
    assert [r.request_id for r in stats.finished] == [0] and stats.aborted == (rec,)


@pytest.mark.parametrize(("steps", "hit_blocks"), [(1, 32), (3, 63)])
def test_an_aborted_requests_blocks_stay_cached(steps: int, hit_blocks: int) -> None:
    eng = _engine(budget=512)
    _add(eng, 0, 1024, 50, (1, 2))
    for _ in range(steps):  # one chunk of 512, or the whole prompt and a decode
        eng.step(eng.now_s + DT / 2)
    first = eng.abort(0)
    assert first is not None and first.prefill_tokens_computed == 512 * min(steps, 2)
    stats = eng.snapshot()
    assert _used(stats) == 0 and stats.prefix_cache_queries == 1024
    _add(eng, 1, 1024, 4, (1, 2))
    eng.step(math.inf)  # its hit, then a chunk of the rest
    second = eng.abort(1)
    assert second is not None
    assert second.prefill_tokens_computed == min(512, 1024 - 16 * hit_blocks)
    stats = eng.snapshot()
    assert stats.prefix_cache_hits == 16 * hit_blocks and _used(stats) == 0
    eng.check_invariants()
    _add(eng, 2, 1024, 4, (1, 2))  # the blocks are still there after two aborts
    assert _drain(eng).prefix_cache_hits == 16 * 63


def _evict_from_gpu(eng: SimEngine) -> None:
    """Request 0's 64 blocks cached, then 119 blocks of another prompt: the GPU (130
    blocks) keeps 11 of request 0's; the host tier holds all of them."""
    _add(eng, 100, 1024, 4, (1, 2))
    _drain(eng)
    _add(eng, 101, 1900, 4, (7, 8, 9, 10))
    assert _drain(eng).prefix_cache_evictions == 53


def test_an_aborted_load_holds_its_blocks_until_its_copy_completes() -> None:
    eng = _engine(blocks=130, host_blocks=1024)
    _evict_from_gpu(eng)
    _add(eng, 9, 20, 30)  # decodes throughout: the engine never waits for the copy
    eng.step(math.inf)
    start = eng.now_s
    _add(eng, 2, 1024, 4, (1, 2))
    eng.step(start + DT / 2)  # admitted to the loading list: 9 hit + 54 blocks copied
    ready = _seq(eng, 2).ready_s
    assert ready == pytest.approx(start + 0.054, abs=1e-12) and eng.now_s < ready
    rec = eng.abort(2)
    assert rec == AbortedRequest(2, 0, "fp16", start, start + DT, 0, 0, False)
    assert eng.num_unfinished_total() == 1 and eng.num_waiting(0) == 0
    eng.check_invariants()  # the aborted load's 63 blocks are counted held

    def used_by_9() -> int:
        (_, _, _, out, _) = eng.pending()[0]
        return -(-(20 + out - 1) // 16)

    _run_to(eng, ready)  # the iterations before the copy completes
    assert eng.now_s >= ready and _used(eng.snapshot()) == 63 + used_by_9()
    eng.step(math.inf)  # the first iteration that starts after it: the blocks are back
    assert _used(eng.snapshot()) == used_by_9()
    eng.check_invariants()
    stats = _drain(eng)
    assert [r.request_id for r in stats.finished] == [9]
    assert stats.kv_offload_loaded_blocks == 0 and stats.kv_cache_usage == 0.0


def test_an_aborted_load_lets_a_held_back_request_in_when_its_copy_completes() -> None:
    eng = _engine(blocks=130, host_blocks=1024)
    _evict_from_gpu(eng)
    _add(eng, 9, 20, 30)
    eng.step(math.inf)
    _add(eng, 2, 1024, 4, (1, 2))
    eng.step(eng.now_s + DT / 2)
    ready = _seq(eng, 2).ready_s
    assert eng.abort(2) is not None
    _add(eng, 5, 1900, 4)  # 119 blocks: 65 free until the aborted copy completes
    assert not eng.holds_new_arrivals()  # they grow then: arrivals may get in
    _run_to(eng, ready)
    assert eng.num_waiting(0) == 1
    eng.step(math.inf)  # the first iteration after the copy admits it
    assert eng.num_waiting(0) == 0 and eng.num_unfinished(0) == 2
    eng.check_invariants()


def test_an_aborted_load_whose_copy_completed_returns_its_blocks_at_once() -> None:
    eng = _engine(blocks=130, host_blocks=1024)
    _evict_from_gpu(eng)
    start = eng.now_s
    _add(eng, 2, 1024, 4, (1, 2))
    eng.step(math.inf)  # nothing else to run: the engine waits for the copy
    assert eng.now_s == pytest.approx(start + 0.052, abs=1e-12)
    rec = eng.abort(2)
    assert rec is not None and eng.is_idle() and _used(eng.snapshot()) == 0
    eng.check_invariants()
    # the copy landed nowhere: the same prefix is copied again, queued on a free link
    _add(eng, 3, 1024, 4, (1, 2))
    stats = _drain(eng)
    assert stats.kv_offload_loaded_blocks == 52
    assert stats.kv_offload_load_s == pytest.approx(0.052, abs=1e-12)


def test_an_aborted_load_is_released_by_an_idle_wait() -> None:
    eng = _engine(blocks=130, host_blocks=1024)
    _evict_from_gpu(eng)
    _add(eng, 9, 20, 3)
    eng.step(math.inf)
    _add(eng, 2, 1024, 4, (1, 2))
    eng.step(math.inf)
    ready = _seq(eng, 2).ready_s
    assert eng.abort(2) is not None
    _run_to(eng, math.inf)  # request 9 finishes before the copy completes
    assert eng.is_idle() and eng.now_s < ready and _used(eng.snapshot()) == 63
    eng.advance_idle(ready)
    assert _used(eng.snapshot()) == 0
    eng.check_invariants()


# ----------------------------------------------------------------- forks


def test_a_fork_aborts_on_its_own() -> None:
    eng = _engine(blocks=130, host_blocks=1024)
    _evict_from_gpu(eng)
    _add(eng, 9, 20, 30)
    eng.step(math.inf)
    _add(eng, 2, 1024, 4, (1, 2))
    _add(eng, 3, 200, 8)
    eng.step(eng.now_s + DT / 2)
    assert eng.abort(2) is not None  # its copy in flight when forked
    twin = eng.fork()
    twin.check_invariants()
    rec = twin.abort(3)
    assert rec is not None and rec.prefill_tokens_computed == 200 and rec.first_token
    twin_stats = _drain(twin)
    stats = _drain(eng)
    assert [a.request_id for a in twin_stats.aborted] == [2, 3]
    assert [a.request_id for a in stats.aborted] == [2]
    assert sorted(r.request_id for r in stats.finished) == [3, 9]
    assert [r.request_id for r in twin_stats.finished] == [9]
    assert eng.abort(9) is None and twin.abort(9) is None


# ----------------------------------------------------------------- skipping == stepping


class _LoadLog(SimEngine):
    """A simulated engine that notes each copy from the host: request id -> (issued,
    completes)."""

    loads: dict[int, tuple[float, float]]

    def _start_load(self, seq: SimSeq, layout: Layout, hit: int, loaded: int,
                    free: int) -> tuple[int, int]:
        out = super()._start_load(seq, layout, hit, loaded, free)
        if out[0] < 0:
            self.loads = getattr(self, "loads", {})
            self.loads[seq.request_id] = (self.now_s, seq.ready_s)
        return out


def _aborts(seed: int, requests: list[Request],
            loads: dict[int, tuple[float, float]]) -> list[tuple[float, int, bool]]:
    """``(time, request id, before_first_token)``: about a third of the requests aborted a
    little after their arrival, a few twice, an id never added, and half of the requests
    that a run without aborts copies from the host tier in the middle of their copy (drawn
    apart from the case, so the cases stay what they are in tests/test_prefix_skipping.py).

    :param loads: request id -> when its copy is issued and completes, without aborts.
    """
    rng = random.Random(f"abort-{seed}")
    out = []
    for r in requests:
        if r.request_id in loads and rng.random() < 0.5:
            issued, ready = loads[r.request_id]
            out.append(((issued + ready) / 2, r.request_id, rng.random() < 0.3))
        elif rng.random() < 0.35:
            delay = rng.expovariate(rng.choice([2.0, 10.0, 100.0]))
            out.append((r.arrival_s + delay, r.request_id, rng.random() < 0.3))
            if rng.random() < 0.1:
                out.append((r.arrival_s + 2 * delay, r.request_id, False))
    out.append((requests[len(requests) // 2].arrival_s, 10**6, False))
    return sorted(out)


def _drive(seed: int, host: bool, skipping: bool, call: str,
           aborts: list[tuple[float, int, bool]] | None = None,
           ) -> tuple[list[EngineStats], list[AbortedRequest | None], _LoadLog]:
    """One random case (tests/test_prefix_skipping.py's, with fewer KV blocks: preemptions)
    replayed with ``aborts`` (default: :func:`_aborts`, from a run without them)."""
    cfg, blocks, requests, caps = _prefix_case(seed)
    blocks = min(blocks, random.Random(f"abort-blocks-{seed}").choice([130, 160, 250]))
    link = None
    if host:
        cfg, link = _host_tier(seed, cfg)
    if aborts is None:
        plain = _drive(seed, host, True, "advance", aborts=[])[2]
        aborts = _aborts(seed, [r for r, _ in requests], getattr(plain, "loads", {}))
    eng = _LoadLog(0, "fp16", cfg, LinearStep(), num_kv_blocks=blocks,
                   max_model_len=MAX_MODEL_LEN, gpu_memory_total_bytes=1 << 30,
                   num_buckets=4, event_skipping=skipping, host_link=link)
    arrivals = [(r, min(kept // 500, 3), kept, kept < r.prompt_tokens) for r, kept in requests]
    returned: list[AbortedRequest | None] = []
    snaps = replay(eng, arrivals, caps, call=call, aborts=aborts, aborted=returned)
    return snaps, returned, eng


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("seed", range(16))
def test_aborts_skipping_equals_stepping(seed: int, host: bool) -> None:
    ref, ref_returned, _ = _drive(seed, host, False, "step")
    n = len(_prefix_case(seed)[2])
    finished = [r.comparable() for s in ref for r in s.finished]
    aborted = [a for s in ref for a in s.aborted]
    assert len(finished) + len(aborted) == n and aborted
    assert aborted == [a for a in ref_returned if a is not None]
    for call in ("step", "advance"):
        got, returned, _ = _drive(seed, host, True, call)
        assert [r.comparable() for s in got for r in s.finished] == finished, call
        assert [a for s in got for a in s.aborted] == aborted, call
        assert returned == ref_returned, call
        assert got == ref, call  # every counter of every tick too


def test_abort_cases_cover_every_place_a_request_can_be(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The random cases above abort requests waiting, preempted, in prefill, in the decode
    lane, and waiting for a copy from the host (some with it in flight)."""
    seen: list[str] = []
    withdraw = SimEngine._withdraw

    def counted(self: SimEngine, seq: SimSeq, where: str) -> AbortedRequest:
        kind = where
        if where == "running":
            kind = "lane" if seq.in_lane else (
                "prefill" if seq.num_computed < seq.prefill_end else "decode")
        elif where == "loading":
            kind = "copy in flight" if seq.ready_s > self.now_s else "copied"
        elif seq.preemptions:
            kind = "preempted"
        seen.append(kind)
        return withdraw(self, seq, where)

    monkeypatch.setattr(SimEngine, "_withdraw", counted)
    for seed in range(16):
        for host in (False, True):
            _drive(seed, host, True, "advance")
    for where in ("waiting", "preempted", "prefill", "lane", "copy in flight"):
        assert seen.count(where) >= 3, (where, seen.count(where))


# ----------------------------------------------------------------- the live engine


@pytest.mark.live
def test_the_live_engine_aborts_through_vllm() -> None:
    from rlbatch.engine.vllm import LiveClock, VllmEngineConfig, start_vllm_engine

    cfg = VllmEngineConfig(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=1024,
                           kv_cache_memory_bytes=32 * 2**20, block_size=32)
    eng = start_vllm_engine(cfg, engine_id=3, pool="fp16", num_buckets=4, clock=LiveClock())
    try:
        for rid, prompt, output in ((0, 40, 50), (1, 300, 5)):
            eng.add_request(Request(rid, eng.now_s, prompt, output), 0, prompt, False)
        eng.step(math.inf)  # both prefilled, a first token each
        eng.step(math.inf)
        assert eng.abort(0, before_first_token=True) is None
        rec = eng.abort(0)
        assert rec is not None and (rec.prefill_tokens_computed, rec.output_tokens,
                                    rec.first_token) == (40, 2, True)
        eng.add_request(Request(2, eng.now_s, 100, 5), 1, 100, False)
        late = eng.abort(2, before_first_token=True)
        assert late is not None and (late.prefill_tokens_computed, late.output_tokens,
                                     late.first_token) == (0, 0, False)
        assert eng.abort(2) is None and eng.num_unfinished_total() == 1
        while not eng.is_idle():
            eng.step(math.inf)
        stats = eng.snapshot()
        assert [r.request_id for r in stats.finished] == [1]
        assert stats.aborted == (rec, late) and stats.kv_cache_usage == 0.0
        assert not eng._scheduler.requests and not eng._probe.prefilled
    finally:
        eng.close()
