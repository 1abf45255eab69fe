"""``rlbatch sweep``: the guide's benchmark checklist (simulator backend; the live vLLM
backend is in test_sweep_live.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest

from rlbatch.commands.sweep import add_arguments, run, spec_from_args
from rlbatch.control.controllers import make_controller
from rlbatch.engine.stats import FinishedRequest
from rlbatch.request import Request
from rlbatch.serving.builders import build_deployment
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.tools.sweep import (
    LIVE_DEFAULTS,
    MemoryPlan,
    SweepPoint,
    SweepSLA,
    measured_breakdown,
    run_sweep,
)
from rlbatch.tools.sweep.closed_loop import ClosedLoopResult, run_closed_loop
from rlbatch.tools.sweep.engines import EngineSetup, sim_engine
from rlbatch.tools.sweep.guide import GUIDE_CONFIGS, check_config
from rlbatch.tools.sweep.point import median_run

GIB = 2**30
TOP_KEYS = {"gpu", "model", "precision", "engine", "points", "recommendations", "guide_checks"}
POINT_KEYS = {
    "batch", "seq_len", "output_len", "precision", "runnable", "reason", "num_requests",
    "completed", "sim_seconds", "wall_seconds", "throughput_output_tok_s",
    "throughput_total_tok_s", "throughput_rps", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s",
    "tpot_p50_s", "tpot_p95_s", "tpot_p99_s", "e2e_p50_s", "e2e_p95_s", "e2e_p99_s",
    "kv_cache_usage_peak", "max_running", "preemptions", "kv_overflows", "recomputed_tokens",
    "meets_sla", "ok", "memory",
}
MEMORY_KEYS = {"weights_gib", "kv_in_use_peak_gib", "kv_reserved_free_gib",
               "activations_buffers_gib", "total_gib", "gpu_memory_gib", "kv_pool_gib"}
MEMORY_PARTS = ("weights_gib", "kv_in_use_peak_gib", "kv_reserved_free_gib",
                "activations_buffers_gib")
MEASURED = POINT_KEYS - {"batch", "seq_len", "output_len", "precision", "runnable", "reason"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlbatch sweep")
    add_arguments(parser)
    return parser


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small CLI run writing JSON, PNG and Markdown (seq 4096 + 32 > llama-2-7b's 4096)."""
    out = tmp_path_factory.mktemp("sweep")
    args = _parser().parse_args([
        "--engine", "sim", "--max-num-seqs", "4,8,16", "--seq-len", "512,4096",
        "--output-len", "32",
        "--num-requests", "16", "--gpu", "a100-80g", "--model", "llama-2-7b", "--quiet",
        "--json", str(out / "s.json"), "--plot", str(out / "s.png"),
        "--report", str(out / "s.md")])
    assert run(args) == 0
    return out


def test_json_has_every_key_per_point(cli_run: Path) -> None:
    doc = json.loads((cli_run / "s.json").read_text())
    assert doc.keys() >= TOP_KEYS
    assert (doc["gpu"], doc["model"], doc["precision"], doc["engine"]) == (
        "a100-80g", "llama-2-7b", "fp16", "sim")
    assert doc["memory_plan"]["source"] == "profile" and doc["notes"] == []
    assert [(p["seq_len"], p["batch"]) for p in doc["points"]] == [
        (512, 4), (512, 8), (512, 16), (4096, 4), (4096, 8), (4096, 16)]
    for p in doc["points"]:
        assert p.keys() == POINT_KEYS
        if p["runnable"]:
            assert p["memory"].keys() == MEMORY_KEYS
            assert all(p[k] is not None for k in MEASURED)
            assert p["completed"] == p["num_requests"] == 16
        else:
            assert all(p[k] is None for k in MEASURED)
    recs = doc["recommendations"]["per_seq_len"]
    assert [r["seq_len"] for r in recs] == [512, 4096]
    assert {"largest_batch_meeting_sla", "max_throughput_batch", "kv_fit_batch"} <= recs[0].keys()
    assert [c["name"] for c in doc["guide_checks"]] == ["latency-sensitive", "throughput-first"]
    for check in doc["guide_checks"]:
        assert check["verdict"] in ("holds", "fails", "not checked")
        assert [p["seq_len"] for p in check["points"]] == [512]
        assert [e["seq_len"] for e in check["excluded"]] == [4096]


def test_seq_len_beyond_context_is_marked_not_runnable(cli_run: Path) -> None:
    doc = json.loads((cli_run / "s.json").read_text())
    long = [p for p in doc["points"] if p["seq_len"] == 4096]
    assert long and all(not p["runnable"] for p in long)
    assert all("4128 tokens exceeds the model's context of 4096" in p["reason"] for p in long)
    rec = doc["recommendations"]["per_seq_len"][1]
    assert rec["runnable"] is False and rec["largest_batch_meeting_sla"] is None


def test_plot_is_a_small_valid_png(cli_run: Path) -> None:
    data = (cli_run / "s.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) < 300_000
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    assert width > 1000 and height > 600


def test_report_judges_both_guide_configurations(cli_run: Path) -> None:
    report = (cli_run / "s.md").read_text()
    for text in ("latency-sensitive", "batch=8, max_seq_len=4096, FP16", "throughput-first",
                 "batch=16, PagedAttention + FP8", "What the sweep recommends", "![sweep](s.png)"):
        assert text in report
    assert report.count("**holds**") + report.count("**fails**") == 2


def test_throughput_grows_with_batch_until_kv_saturates() -> None:
    result = run_sweep("a100-80g", "llama-2-7b", [1, 4, 16], [1024], output_len=32,
                       num_requests=32)
    points = [result.point(b, 1024) for b in (1, 4, 16)]
    tok_s = [p.throughput_output_tok_s or 0.0 for p in points]
    assert tok_s[0] < tok_s[1] < tok_s[2]
    assert all(p.preemptions == 0 and p.kv_overflows == 0 for p in points)
    peaks = [p.kv_cache_usage_peak or 0.0 for p in points]
    assert peaks[0] < peaks[1] < peaks[2] < 0.2
    # the TPOT cost of batching: one decode step serves more sequences, each a bit slower
    assert (points[0].tpot_p50_s or 0.0) < (points[2].tpot_p50_s or 0.0)


def test_saturated_kv_preempts_and_is_not_recommended() -> None:
    # 0.2 x 80 GiB leaves 339 KV blocks (5424 tokens). A 1024-token prompt takes 64 blocks,
    # so the engine admits 5 of 16; growing to 1024 + 512 tokens (96 blocks) they preempt.
    result = run_sweep("a100-80g", "llama-2-7b", [2, 16], [1024], output_len=512,
                       num_requests=16, gpu_memory_utilization=0.2, check_guide=False)
    assert result.plan.num_kv_blocks == 339
    small, big = result.point(2, 1024), result.point(16, 1024)
    assert small.preemptions == 0 and small.max_running == 2 and small.ok
    assert big.preemptions and big.kv_overflows and big.kv_cache_usage_peak == 1.0
    assert big.max_running == 5 and big.kv_limited
    failures = big.sla_failures(result.spec.sla)
    assert f"{big.preemptions} preemptions" in failures
    assert "KV cache holds only 5 of 16 sequences" in failures
    rec = result.recommendations[0]
    assert (rec.first_kv_overflow_batch, rec.largest_batch_meeting_sla) == (16, 2)
    assert rec.kv_fit_batch == 339 // 96 == 3


def test_batch_the_kv_pool_cannot_admit_is_flagged_without_preemption() -> None:
    # Short outputs: 5 sequences of 1024 + 32 tokens fit, so nothing is preempted, but a
    # static cap of 16 really runs 5 at a time.
    result = run_sweep("a100-80g", "llama-2-7b", [16], [1024], output_len=32,
                       num_requests=16, gpu_memory_utilization=0.2, check_guide=False)
    point = result.point(16, 1024)
    assert (point.preemptions, point.kv_overflows, point.max_running) == (0, 0, 5)
    assert point.overflowed and not point.ok
    assert result.recommendations[0].first_kv_overflow_batch == 16


def test_memory_breakdown_sums_to_the_budget() -> None:
    result = run_sweep("h100-80g", "llama-2-7b", [4, 32], [1024, 2048], output_len=16,
                       num_requests=32, precision="fp8", check_guide=False)
    plan = result.plan
    budget_gib = 85520809984 * 0.9 / GIB
    pool_gib = plan.num_kv_blocks * 16 * plan.kv_bytes_per_token / GIB
    assert plan.kv_bytes_per_token == 32 * 2 * 4096 * 1  # FP8 KV: 1 byte per value
    for p in result.points:
        m = p.memory
        assert m is not None and p.kv_cache_usage_peak is not None
        assert sum(m[k] for k in MEMORY_PARTS) == pytest.approx(budget_gib, rel=1e-12)
        assert m["total_gib"] == pytest.approx(budget_gib, rel=1e-12)
        assert m["kv_in_use_peak_gib"] == pytest.approx(p.kv_cache_usage_peak * pool_gib)
        assert m["kv_pool_gib"] == pytest.approx(pool_gib)
        assert min(m[k] for k in MEMORY_PARTS) >= 0
    # H100 FP8 stores linear weights in FP8: about half of the 12.6 GiB bf16 weights
    assert 6.0 < (result.points[0].memory or {})["weights_gib"] < 7.0


@pytest.mark.parametrize("batches,seq_lens,match", [
    ([], [1024], "batch sizes must list at least one value"),
    ([4, -8], [1024], "batch sizes must be >= 1"),
    ([4], [], "sequence lengths must list at least one value"),
    ([4], [0], "sequence lengths must be >= 1"),
])
def test_bad_grids_raise_clear_errors(batches: list[int], seq_lens: list[int],
                                      match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_sweep("a100-80g", "llama-2-7b", batches, seq_lens, 32, "fp16")


def test_unknown_gpu_engine_and_bad_live_setups_are_errors(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="unknown name; available names: a100-80g"):
        run_sweep("b200", "llama-2-7b", [4], [1024], 32, "fp16")
    with pytest.raises(ValueError, match="unknown engine 'tpu'; engines: sim, vllm"):
        run_sweep("a100-80g", "llama-2-7b", [4], [1024], 32, "fp16", engine="tpu")
    # checked before any live engine starts
    live_error = ("'llama-2-7b' is neither" if importlib.util.find_spec("vllm")
                  else "needs vLLM installed")
    with pytest.raises(ValueError, match=live_error):
        run_sweep("a100-80g", "llama-2-7b", [4], [1024], 32, "fp16", engine="vllm")
    with pytest.raises(ValueError, match="kv_cache_memory_bytes applies to a live engine"):
        run_sweep("a100-80g", "llama-2-7b", [4], [1024], kv_cache_memory_bytes=2**20)
    assert run(_parser().parse_args(["--gpu", "b200", "--quiet"])) == 2
    assert run(_parser().parse_args(["--engine", "vllm", "--gpu", "h100-80g", "--quiet"])) == 2
    err = capsys.readouterr().err
    assert "rlbatch sweep: error: gpu profile 'b200'" in err
    assert "--gpu names a simulated GPU profile" in err


def test_cli_defaults_follow_the_engine() -> None:
    sim = spec_from_args(_parser().parse_args([]))
    assert (sim.engine, sim.gpu, sim.model, sim.batches, sim.seq_lens) == (
        "sim", "a100-80g", "llama-2-7b", (4, 8, 16, 32), (1024, 2048, 4096))
    live = spec_from_args(_parser().parse_args(["--engine", "vllm", "--pools", "fp8",
                                                "--kv-cache-mib", "8", "--block-size", "64"]))
    assert (live.engine, live.model, live.batches, live.seq_lens, live.precision) == (
        "vllm", "tiny", LIVE_DEFAULTS.batches, LIVE_DEFAULTS.seq_lens, "fp8")
    assert (live.batches, live.seq_lens) == ((1, 4, 8, 16), (128, 256, 512))
    assert (live.kv_cache_memory_bytes, live.block_size) == (8 * 2**20, 64)
    ckpt = spec_from_args(_parser().parse_args(["--engine", "vllm", "--model", "/ckpt",
                                                "--max-num-seqs", "2", "--seq-len",
                                                "64"]))
    assert (ckpt.model, ckpt.batches, ckpt.seq_lens) == ("/ckpt", (2,), (64,))


def _live_plan(weights: int = 3 * 2**20, blocks: int = 64) -> MemoryPlan:
    return MemoryPlan(gpu_memory_bytes=8 * GIB, gpu_memory_utilization=0.9,
                      weights_bytes=weights, activation_reserve_bytes=0,
                      kv_bytes_per_token=512, block_size=32, num_kv_blocks=blocks,
                      source="process")


@pytest.mark.parametrize("measured", [0, 2**20, 4 * 2**20, 700 * 2**20])
def test_measured_breakdown_sums_to_the_total_and_is_never_negative(measured: int) -> None:
    plan = _live_plan()
    assert plan.live and plan.kv_pool_bytes == 64 * 32 * 512 == 2**20
    m = measured_breakdown(plan, 0.25, measured).to_dict()
    parts = [m[k] for k in MEMORY_PARTS]
    assert min(parts) >= 0
    assert sum(parts) == pytest.approx(m["total_gib"], rel=1e-12)
    assert m["total_gib"] == pytest.approx(max(measured, 4 * 2**20) / GIB)
    assert m["weights_gib"] == pytest.approx(3 / 1024)
    assert m["kv_in_use_peak_gib"] == pytest.approx(0.25 / 1024)
    assert m["kv_pool_gib"] == pytest.approx(1 / 1024)
    assert m["gpu_memory_gib"] == pytest.approx(8.0)
    with pytest.raises(ValueError, match="kv_usage_peak"):
        measured_breakdown(plan, 1.5, measured)


@pytest.mark.parametrize("value", ["", "4,-8", "4,x", "0"])
def test_cli_rejects_bad_batch_lists(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--max-num-seqs", value])
    assert exc.value.code == 2
    assert "argument --max-num-seqs" in capsys.readouterr().err


def test_cli_pools_is_one_pool(capsys: pytest.CaptureFixture[str]) -> None:
    assert spec_from_args(_parser().parse_args(["--pools", "fp8"])).precision == "fp8"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--pools", "fp16:1,fp8:1"])
    assert "one engine of one pool" in capsys.readouterr().err


def test_closed_loop_equals_all_requests_queued_at_t0() -> None:
    """The documented method: the closed loop finishes every request exactly when the engine
    would with all requests queued at t=0; only the latency origin differs."""
    batch, n, prompt, output = 4, 14, 700, 20
    built = sim_engine(EngineSetup("a100-80g", "llama-2-7b", "fp16", batch))
    loop = run_closed_loop(built.engine, bucket=built.buckets.index(prompt),
                           concurrency=batch, num_requests=n, prompt_tokens=prompt,
                           output_tokens=output)
    deployment = build_deployment(DeploymentSpec(gpu="a100-80g", model="llama-2-7b"))
    deployment.apply(make_controller(f"static:{batch}").reset(deployment.info))
    deployment.load([Request(i, 0.0, prompt, output) for i in range(n)])
    deployment.run_until(math.inf)
    queued = {r.request_id: r for r in deployment.snapshot()[0].finished}
    closed = {r.request_id: r for r in loop.records}
    assert sorted(closed) == sorted(queued) == list(range(n))
    for rid, rec in closed.items():
        assert rec.finish_s == pytest.approx(queued[rid].finish_s, abs=1e-12)
        assert rec.e2e_s == pytest.approx(queued[rid].e2e_s - rec.arrival_s, abs=1e-12)
    finishes = sorted(r.finish_s for r in loop.records)
    sends = sorted(r.arrival_s for r in loop.records)
    assert sends[:batch] == [0.0] * batch
    assert sends[batch:] == pytest.approx(finishes[:n - batch])  # a send per completion


def _point(batch: int, seq_len: int, precision: str, ttft: float, preemptions: int = 0
           ) -> SweepPoint:
    return SweepPoint(batch=batch, seq_len=seq_len, output_len=16, precision=precision,
                      runnable=True, ttft_p99_s=ttft, tpot_p99_s=0.02, e2e_p99_s=ttft + 0.3,
                      throughput_output_tok_s=100.0 * batch, preemptions=preemptions,
                      kv_overflows=preemptions)


def test_guide_verdicts_need_sla_and_no_preemption() -> None:
    sla = SweepSLA(p99_s=2.0)
    points = {("fp16", 8, 1024): _point(8, 1024, "fp16", 1.9),
              ("fp16", 8, 2048): _point(8, 2048, "fp16", 1.0),
              ("fp8", 16, 1024): _point(16, 1024, "fp8", 1.0, preemptions=3),
              ("fp8", 16, 2048): _point(16, 2048, "fp8", 1.5)}
    latency, throughput = GUIDE_CONFIGS
    checks = [check_config(cfg, points, lambda k: "sweep", [1024, 2048, 4096], 16, 4096, sla,
                           [], "fp16", "gpu / model") for cfg in (latency, throughput)]
    assert [c.verdict for c in checks] == ["holds", "fails"]
    assert [e["seq_len"] for e in checks[0].excluded] == [4096]  # 4096 + 16 > max_seq_len
    assert checks[1].points[0]["failures"] == ["3 preemptions"]
    assert "fails at seq 1024: 3 preemptions" in checks[1].summary
    e2e = SweepSLA(p99_s=2.0, metric="e2e")
    again = check_config(latency, points, lambda k: "sweep", [1024], 16, 4096, e2e, [], "fp16",
                         "gpu / model")
    assert again.verdict == "fails"  # e2e P99 2.2 s > 2 s
    assert again.points[0]["failures"] == ["P99 E2E 2.20 s > 2 s"]


def test_guide_points_missing_from_the_grid_are_run_extra() -> None:
    result = run_sweep("h100-80g", "llama-2-7b", [4], [512], output_len=16, num_requests=8)
    by_name = {c.name: c for c in result.guide_checks}
    assert [(p["batch"], p["precision"], p["source"])
            for p in by_name["latency-sensitive"].points] == [(8, "fp16", "extra run")]
    assert [(p["batch"], p["precision"], p["source"])
            for p in by_name["throughput-first"].points] == [(16, "fp8", "extra run")]
    assert len(result.extra_points) == 2 and len(result.points) == 1
    assert set(result.plans) == {"fp16", "fp8"}


def test_logdir_writes_tensorboard_images_and_scalars(tmp_path: Path) -> None:
    pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = _parser().parse_args(["--max-num-seqs", "2,4", "--seq-len", "256", "--output-len", "8",
                                 "--num-requests", "8", "--no-guide-check", "--quiet",
                                 "--logdir", str(tmp_path / "tb")])
    assert run(args) == 0
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    events.Reload()
    tags = events.Tags()
    assert "sweep/overview/a100-80g/llama-2-7b/fp16" in tags["images"]
    assert "sweep/memory/a100-80g/llama-2-7b/fp16" in tags["images"]
    steps = [e.step for e in events.Scalars("sweep/output_tok_s/a100-80g/llama-2-7b/fp16/seq256")]
    assert steps == [2, 4]


def test_repeats_report_the_run_with_the_median_throughput() -> None:
    def run_of(tokens: int, makespan: float) -> ClosedLoopResult:
        record = FinishedRequest(request_id=0, bucket=0, pool="fp16", arrival_s=0.0,
                                 prompt_tokens=8, output_tokens=tokens, ttft_s=0.1, tpot_s=0.01,
                                 e2e_s=makespan, finish_s=makespan, preemptions=0,
                                 truncated=False)
        return ClosedLoopResult(records=[record], makespan_s=makespan)

    slow, mid, fast = run_of(100, 2.0), run_of(100, 1.0), run_of(300, 1.0)
    assert median_run([fast, slow, mid]) is mid
    assert median_run([slow]) is slow
    # the simulator repeats exactly
    once = run_sweep("a100-80g", "llama-2-7b", [4], [512], output_len=16, num_requests=8,
                     check_guide=False)
    thrice = run_sweep("a100-80g", "llama-2-7b", [4], [512], output_len=16, num_requests=8,
                       check_guide=False, repeats=3)
    assert thrice.to_dict()["repeats"] == 3
    assert thrice.points[0].throughput_output_tok_s == once.points[0].throughput_output_tok_s
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        run_sweep("a100-80g", "llama-2-7b", [4], [512], repeats=0)
