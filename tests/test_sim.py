"""The simulated vLLM V1 engine: exact small cases, invariants, skipping == stepping."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from rlbatch.control.controllers import make_controller
from rlbatch.engine.config import EngineConfig
from rlbatch.engine.sim import SimEngine
from rlbatch.engine.stats import FinishedRequest
from rlbatch.request import Request
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.builders import build_deployment
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import Workload, build_workload, load_trace
from tests.factories import ConstantStep


def _engine(blocks: int = 1000, max_num_seqs: int = 256, budget: int = 2048,
            skipping: bool = True, max_model_len: int = 512) -> SimEngine:
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return SimEngine(0, "fp16", cfg, ConstantStep(), num_kv_blocks=blocks,
                     max_model_len=max_model_len,
                     gpu_memory_total_bytes=80 << 30, num_buckets=4, event_skipping=skipping)


def _drain(engine: SimEngine, limit_s: float = 1e6) -> list[FinishedRequest]:
    while not engine.is_idle() and engine.now_s < limit_s:
        engine.step(limit_s)
    return list(engine.snapshot().finished)


@pytest.mark.parametrize("skipping", [True, False])
def test_single_request_timings_are_exact(skipping: bool) -> None:
    eng = _engine(skipping=skipping)
    eng.add_request(Request(0, 0.0, 32, 3), 0, 32, False)
    (rec,) = _drain(eng)
    # iteration 1: prefill 32 tokens -> token 1; iterations 2, 3: decode -> tokens 2, 3.
    assert rec.ttft_s == pytest.approx(0.01)
    assert rec.e2e_s == pytest.approx(0.03)
    assert rec.tpot_s == pytest.approx(0.01)
    assert rec.output_tokens == 3 and rec.preemptions == 0


def test_chunked_prefill_respects_token_budget() -> None:
    eng = _engine(budget=512, max_model_len=4096)
    eng.add_request(Request(0, 0.0, 1300, 2), 0, 1300, False)
    (rec,) = _drain(eng)
    # 1300 prompt tokens in chunks of 512, 512, 276 -> first token after 3 iterations.
    assert rec.ttft_s == pytest.approx(0.03)
    assert rec.e2e_s == pytest.approx(0.04)


def test_decodes_go_first_then_prefill_fills_the_budget() -> None:
    eng = _engine(budget=100)
    eng.add_request(Request(0, 0.0, 10, 50), 0, 10, False)
    eng.step(1e9)  # prefill of request 0
    eng.add_request(Request(1, 0.0, 250, 1), 0, 250, False)
    # Each iteration: 1 decode token for request 0, 99 prefill tokens for request 1.
    s0 = eng.snapshot()
    assert s0.prefill_tokens == 10
    eng.step(1e9)
    eng.step(1e9)
    s1 = eng.snapshot()
    assert (s1.decode_tokens, s1.prefill_tokens) == (2, 198)


def test_max_num_seqs_limits_running() -> None:
    eng = _engine(max_num_seqs=2)
    for i in range(5):
        eng.add_request(Request(i, 0.0, 16, 100), 0, 16, False)
    eng.step(1e9)
    stats = eng.snapshot()
    assert stats.running[0] == 2 and stats.waiting[0] == 3


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 4 requests of 64 prompt + 200 output tokens need 4 * 17 blocks at the end; 40 exist.
    eng = _engine(blocks=40, skipping=False)
    for i in range(4):
        eng.add_request(Request(i, 0.0, 64, 200), 0, 64, False)
    recs = _drain(eng)
    assert len(recs) == 4
    stats = eng.snapshot()
    assert sum(r.preemptions for r in recs) > 0
    # newest running request is preempted first: the oldest never is.
    by_id = {r.request_id: r for r in recs}
    assert by_id[0].preemptions == 0
    assert all(r.output_tokens == 200 for r in recs)
    assert stats.kv_cache_usage == 0.0


def test_no_preemption_when_blocks_suffice() -> None:
    eng = _engine(blocks=4 * 17)
    for i in range(4):
        eng.add_request(Request(i, 0.0, 64, 200), 0, 64, False)
    recs = _drain(eng)
    assert sum(r.preemptions for r in recs) == 0


def test_engine_refuses_kv_smaller_than_max_model_len() -> None:
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        _engine(blocks=10, max_model_len=4096)


def _night_overflow_workload() -> Workload:
    # long reports arriving together overflow a small KV pool: preemption storms.
    rows = [(0.05 * i, 3000 if i % 3 == 0 else 300, 400 if i % 3 == 0 else 120, None)
            for i in range(120)]
    return build_workload(rows, name="overflow", source="test")


def _records_by_id(result_records: list[FinishedRequest]) -> dict[int, tuple[object, ...]]:
    """Every field of every record, NaN (rejected requests' timings) made comparable."""
    return {r.request_id: r.comparable() for r in result_records}


# fixed:64 runs behind the guard, so its KV budget reads the observed-output counts that
# grow as requests run: skipping must keep them exact too. The guarded per-bucket caps
# (fixed:8/8/4/4, playbook, aimd) queue requests in admission, which the deployment lets the
# engine run past while their queue stays closed (Admission.leaves_running).
@pytest.mark.parametrize("controller", ["static:8", "static:32", "vllm-default", "fixed:64",
                                        "fixed:8/8/4/4", "playbook", "aimd"])
@pytest.mark.parametrize("workload_kind", ["azure", "overflow"])
def test_event_skipping_equals_stepping(controller: str, workload_kind: str,
                                        azure_trace: Path) -> None:
    if workload_kind == "azure":
        workload = load_trace(azure_trace, window_s=(0.0, 240.0), rate_scale=2.0)
        spec = DeploymentSpec()
    else:
        workload = _night_overflow_workload()
        spec = DeploymentSpec(num_kv_blocks=600)
    on = run(workload, make_controller(controller), replace(spec, event_skipping=True))
    off = run(workload, make_controller(controller), replace(spec, event_skipping=False))
    a, b = _records_by_id(on.records), _records_by_id(off.records)
    assert a.keys() == b.keys() == set(range(len(workload)))
    for rid, rec in a.items():
        assert rec == b[rid], f"request {rid} differs"
    for key in ("preemptions", "kv_overflows", "prefill_tokens", "decode_tokens"):
        assert on.row[key] == off.row[key], key
    if workload_kind == "overflow" and controller in ("static:32", "vllm-default"):
        assert on.row["preemptions"] > 0  # the comparison covered preemption


@pytest.mark.parametrize("controller", ["static:16", "fixed:8/8/4/4"])
def test_event_skipping_equals_stepping_two_pools_two_replicas(azure_trace: Path,
                                                               controller: str) -> None:
    # The controllers route every bucket to any pool: three engines share each queue.
    workload = load_trace(azure_trace, window_s=(0.0, 120.0), rate_scale=4.0)
    spec = DeploymentSpec(pools={"fp16": 2, "fp8": 1}, num_kv_blocks=2000)

    on = run(workload, make_controller(controller), spec)
    off = run(workload, make_controller(controller), replace(spec, event_skipping=False))
    assert on.records and _records_by_id(on.records) == _records_by_id(off.records)


# Behind the KV budget the queue's head can be held back by one engine and taken by the
# other, after which the first may admit the next request at its next boundary: a skipping
# engine must not run past the other engines' boundaries while requests are queued.
@pytest.mark.parametrize("controller", ["fixed:256", "fixed:64/64/8/8"])
def test_event_skipping_equals_stepping_two_pools_kv_budget(controller: str) -> None:
    workload = _night_overflow_workload()
    spec = DeploymentSpec(pools={"fp16": 1, "fp8": 1}, num_kv_blocks=600)

    on = run(workload, make_controller(controller), spec)
    off = run(workload, make_controller(controller), replace(spec, event_skipping=False))
    assert on.records and _records_by_id(on.records) == _records_by_id(off.records)
    assert on.row["guard_overrides"] and off.row["preemptions"] == 0


@pytest.mark.parametrize("controller", ["static:4", "static:64", "vllm-default"])
def test_no_request_lost_and_kv_within_capacity(controller: str) -> None:
    workload = _night_overflow_workload()
    spec = DeploymentSpec(num_kv_blocks=600)
    peaks: list[float] = []
    result = run(workload, make_controller(controller), spec,
                 on_tick=lambda s: peaks.extend(e.kv_cache_usage_peak for e in s.engines))
    row = result.row
    assert row["completed"] + row["rejected"] + row["unfinished"] == len(workload)
    assert row["completed"] == len(workload)  # nothing too long for llama-2-7b's 4k context
    assert max(peaks) <= 1.0
    assert len({r.request_id for r in result.records}) == len(result.records)


def test_requests_cut_off_by_drain_count_as_unfinished() -> None:
    rows = [(0.0, 500, 2000, None)] * 3
    workload = build_workload(rows, name="long", source="test")
    result = run(workload, make_controller("static:1"), DeploymentSpec(), drain_s=5.0)
    row = result.row
    assert row["unfinished"] >= 1
    assert row["completed"] + row["rejected"] + row["unfinished"] == 3


@pytest.mark.parametrize("policy,expect_rejected,expect_truncated", [("reject", 1, 0),
                                                                     ("truncate", 0, 1)])
def test_over_length_requests_are_counted(policy: str, expect_rejected: int,
                                          expect_truncated: int) -> None:
    rows = [(0.0, 200, 50, None), (0.1, 4090, 100, None)]
    workload = build_workload(rows, name="long", source="test")
    spec = DeploymentSpec(admission=AdmissionConfig(over_length=policy))  # type: ignore[arg-type]
    row = run(workload, make_controller("static:8"), spec).row
    assert (row["rejected"], row["truncated"]) == (expect_rejected, expect_truncated)
    assert row["completed"] == 2 - expect_rejected


def test_fp8_pool_holds_about_twice_the_tokens() -> None:
    fp16 = build_deployment(DeploymentSpec(pools={"fp16": 1})).info.num_kv_blocks["fp16"]
    fp8 = build_deployment(DeploymentSpec(pools={"fp8": 1})).info.num_kv_blocks["fp8"]
    assert 1.9 <= fp8 / fp16 <= 2.2


def test_same_seed_same_result(azure_trace: Path) -> None:
    def once() -> dict[str, object]:
        workload = load_trace(azure_trace, window_s=(0.0, 120.0), rate_scale=3.0, seed=7)
        row = run(workload, make_controller("static:16"), DeploymentSpec()).row
        return {k: v for k, v in row.items() if k not in ("wall_seconds", "speedup_x")}

    assert once() == once()


def test_bigger_static_batch_more_throughput_until_preemption(azure_trace: Path) -> None:
    workload = load_trace(azure_trace, window_s=(0.0, 300.0), rate_scale=4.0)
    rows = {n: run(workload, make_controller(f"static:{n}"), DeploymentSpec()).row
            for n in (2, 8)}
    assert rows[8]["throughput_tok_s"] > rows[2]["throughput_tok_s"]
    assert rows[8]["ttft_p99_s"] < rows[2]["ttft_p99_s"]
