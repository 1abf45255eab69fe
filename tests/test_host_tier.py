"""The host KV tier (vLLM's native CPU offloading): exact small cases.

Stepping == event skipping with the tier on is in tests/test_prefix_skipping.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlbatch.commands.main import main
from rlbatch.control.controllers import make_controller
from rlbatch.engine.config import EngineConfig
from rlbatch.engine.host_tier import (
    HostLink,
    HostTier,
    host_capacity_blocks,
    host_link_of,
)
from rlbatch.engine.prefix_cache import prefix_layout
from rlbatch.engine.sim import SimEngine
from rlbatch.engine.stats import EngineStats
from rlbatch.profiles import Precision, RooflineStepTimeModel, load_gpu, load_model
from rlbatch.request import Request
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import build_workload
from tests.factories import ConstantStep

LINK = HostLink(block_bytes=1 << 20, load_s_per_block=1e-3)
"""1 MiB blocks (so ``kv_offload_gib = blocks / 1024``), 1 ms per block over the link."""
DT = 0.01
"""Every iteration of ConstantStep."""


def _engine(host_blocks: int | None = 1024, blocks: int = 130) -> SimEngine:
    gib = 0.0 if host_blocks is None else host_blocks / 1024
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=2048, kv_offload_gib=gib)
    return SimEngine(0, "fp16", cfg, ConstantStep(DT), num_kv_blocks=blocks,
                     max_model_len=2048, gpu_memory_total_bytes=1 << 30, num_buckets=4,
                     host_link=LINK if host_blocks is not None else None)


def _add(eng: SimEngine, rid: int, prompt: int, output: int,
         ids: tuple[int, ...] | None) -> None:
    eng.add_request(Request(rid, eng.now_s, prompt, output, prefix_ids=ids), 0, prompt, False)


def _drain(eng: SimEngine) -> EngineStats:
    while not eng.is_idle():
        eng.step(1e9)
        eng.check_invariants()
    return eng.snapshot()


def _layout(ids: tuple[int, ...], prompt: int) -> tuple[tuple[int, ...], ...]:
    return prefix_layout(ids, prompt, prompt, 16)


# ----------------------------------------------------------------- capacity and link


@pytest.mark.parametrize(("gpu", "model", "precision", "block_bytes", "load_bytes", "bw",
                          "blocks_64gib"), [
    # 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes x 16 tokens = 2 MiB, one GPU
    ("h200-141g", "llama-3.1-8b", "fp16", 2 << 20, 2 << 20, 50e9, 32768),
    ("h200-141g", "llama-3.1-8b", "fp8", 1 << 20, 1 << 20, 50e9, 65536),
    ("a100-80g", "llama-2-7b", "fp16", 8 << 20, 8 << 20, 25e9, 8192),  # 32 KV heads
    # TP 4: each GPU holds 2 of 80 layers x 8 heads' ... 1.25 MiB; the host all 4 shares
    ("h100-80g", "llama-2-70b", "fp16", 5 << 20, 1_310_720, 50e9, 13107),
    # MLA, TP 8: (512 + 64) x 61 layers x 1 byte x 16 = 562,176 bytes, replicated on every
    # rank and stored once, rounded up to a 4 KiB page: 138 pages
    ("h200-141g", "deepseek-v3", "fp8", 138 * 4096, 562_176, 50e9, 121574),
])
def test_host_capacity_and_link_from_the_profiles(gpu: str, model: str, precision: Precision,
                                                  block_bytes: int, load_bytes: int,
                                                  bw: float, blocks_64gib: int) -> None:
    step = RooflineStepTimeModel(load_gpu(gpu), load_model(model), precision=precision)
    link = host_link_of(step, 16)
    assert link == HostLink(block_bytes, load_bytes / bw)
    assert host_capacity_blocks(64, link) == blocks_64gib == (64 << 30) // block_bytes
    assert host_capacity_blocks(0.5, LINK) == 512


def test_a_host_pool_smaller_than_a_block_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no KV block of 1048576 bytes"):
        host_capacity_blocks(0.0009, LINK)


# ----------------------------------------------------------------- the pool itself


def test_lru_evicts_the_least_recently_stored_group() -> None:
    host = HostTier(64, LINK)
    x, y, z = _layout((1,), 512), _layout((2,), 512), _layout((3,), 512)
    host.store(x, 0, 32)
    host.store(y, 0, 32)
    host.store(z, 0, 32)  # full: x goes
    assert (host.lookup(x, 0, 31), host.lookup(y, 0, 31), host.lookup(z, 0, 31)) == (0, 31, 31)
    assert (host.stored, host.evictions, host.used) == (96, 32, 64)


def test_a_finished_request_makes_its_blocks_the_most_recent() -> None:
    host = HostTier(64, LINK)
    x, y, z = _layout((1,), 512), _layout((2,), 512), _layout((3,), 512)
    host.store(x, 0, 32)
    host.store(y, 0, 32)
    host.finish(x, 0, 32)  # x's request finished after y was stored
    host.store(z, 0, 32)
    assert (host.lookup(x, 0, 31), host.lookup(y, 0, 31)) == (31, 0)


def test_eviction_takes_a_group_from_its_end_and_a_request_tail_first() -> None:
    host = HostTier(64, LINK)
    w = _layout((4, 5), 1024)  # two groups of 32 blocks
    host.store(w, 0, 64)
    host.finish(w, 0, 64)  # ranked tail first: its first group is the most recent
    host.store(_layout((3,), 512), 0, 16)  # 16 blocks: the end of w's second group
    assert host.lookup(w, 0, 63) == 48
    host.store(_layout((6,), 512), 0, 32)  # 32 more: the 16 left of it, 16 of the first
    assert host.lookup(w, 0, 63) == 16 and host.lookup(w, 16, 63) == 0
    assert host.evictions == 48


def test_blocks_already_held_are_not_copied_again_and_a_hole_is_not_stored() -> None:
    host = HostTier(1024, LINK)
    w = _layout((4, 5), 1024)
    host.store(w, 0, 40)
    host.store(w, 0, 48)  # 8 new
    assert host.stored == 48
    v = _layout((7, 8), 1024)
    host.store(v, 40, 64)  # v's first 40 blocks are not here: blocks 40-63 would be a hole
    assert host.stored == 48 and host.lookup(v, 0, 63) == 0
    assert host.lookup(w, 0, 63) == 48 and host.lookup(w, 20, 63) == 28
    assert host.lookup(w, 0, 30) == 30  # at most the blocks asked for


# ----------------------------------------------------------------- in the engine


def test_every_computed_prompt_block_is_stored_once() -> None:
    eng = _engine()
    _add(eng, 0, 1024, 4, (1, 2))  # 64 full blocks
    stats = _drain(eng)
    assert (stats.kv_offload_stored_blocks, stats.kv_offload_store_bytes) == (64, 64 << 20)
    assert stats.kv_offload_usage == 64 / 1024 and stats.kv_offload_num_blocks == 1024
    _add(eng, 1, 1024, 4, (1, 2))  # hits the GPU cache: 63 blocks, the last recomputed
    stats = _drain(eng)
    assert (stats.prefix_cache_hits, stats.kv_offload_stored_blocks) == (63 * 16, 0)
    _add(eng, 2, 1024, 4, (1, 3))  # shares the first 512 tokens: 32 new blocks
    _add(eng, 3, 300, 4, None)  # no ids: nothing to store
    stats = _drain(eng)
    assert (stats.kv_offload_stored_blocks, stats.kv_offload_usage) == (32, 96 / 1024)
    assert stats.kv_offload_hits == stats.kv_offload_loaded_blocks == 0


def _evict_from_gpu(eng: SimEngine) -> None:
    """Request 0's 64 blocks cached, then 119 blocks of another prompt: the GPU (130
    blocks, 66 never used) evicts 53 of request 0's, its last ones first: 11 stay."""
    _add(eng, 0, 1024, 4, (1, 2))
    _drain(eng)
    _add(eng, 1, 1900, 4, (7, 8, 9, 10))
    assert _drain(eng).prefix_cache_evictions == 53


def test_a_returning_prefix_evicted_from_the_gpu_is_loaded_from_the_host() -> None:
    eng = _engine()
    _evict_from_gpu(eng)
    start = eng.now_s
    _add(eng, 2, 1024, 4, (1, 2))
    eng.step(1e9)  # admitted to the loading list: nothing else runs, the engine waits
    ready = start + 52 * LINK.load_s_per_block  # 63 - 11 blocks over the link
    assert eng.now_s == ready and eng.num_waiting(0) == 1
    loading = eng.snapshot()
    assert loading.kv_cache_usage == 63 / 130 and loading.running == (0, 0, 0, 0)
    assert (loading.prefix_cache_hits, loading.kv_offload_hits) == (11 * 16, 52 * 16)
    assert (loading.kv_offload_loaded_blocks, loading.kv_offload_load_bytes) == (52, 52 << 20)
    assert (loading.kv_offload_load_s, loading.iterations) == (ready - start, 0)
    stats = _drain(eng)
    (done,) = stats.finished
    assert done.ttft_s == ready + DT - start  # then one iteration: the last 16 tokens
    assert stats.prefill_tokens == 16


def test_without_the_host_tier_the_evicted_prefix_is_computed() -> None:
    eng = _engine(host_blocks=None)
    _evict_from_gpu(eng)
    _add(eng, 2, 1024, 4, (1, 2))
    stats = _drain(eng)
    assert (stats.prefix_cache_hits, stats.prefill_tokens) == (11 * 16, 1024 - 11 * 16)
    assert stats.kv_offload_num_blocks == stats.kv_offload_hits == 0


def test_a_load_overlaps_the_running_requests_and_joins_at_the_next_iteration() -> None:
    eng = _engine()
    _evict_from_gpu(eng)
    _add(eng, 9, 20, 30, None)  # decodes throughout, one token per 10 ms iteration
    eng.step(1e9)
    start = eng.now_s
    _add(eng, 2, 1024, 4, (1, 2))
    stats = _drain(eng)
    loaded, other = sorted(stats.finished, key=lambda r: r.request_id)
    # request 9's blocks evicted 2 more of request 0's from the GPU: 54 blocks are copied,
    # issued at `start`, ready 54 ms later: it joins the iteration starting at start + 60 ms
    assert stats.kv_offload_loaded_blocks == 54
    assert stats.kv_offload_load_s == pytest.approx(0.054, abs=1e-12)
    assert loaded.arrival_s == start and loaded.ttft_s == pytest.approx(0.06 + DT, abs=1e-12)
    assert other.tpot_s == pytest.approx(DT, abs=1e-12)  # never stalled by the copy


def test_copies_queue_on_the_link() -> None:
    eng = _engine()
    _evict_from_gpu(eng)
    _add(eng, 2, 1024, 4, (1, 2))
    _add(eng, 3, 1024, 4, (1, 2))  # the same blocks, copied again after the first copy
    start = eng.now_s
    stats = _drain(eng)
    assert stats.kv_offload_loaded_blocks == 104
    assert stats.kv_offload_load_s == pytest.approx(0.052 + 0.104, abs=1e-12)
    first, second = sorted(stats.finished, key=lambda r: r.request_id)
    assert second.ttft_s - first.ttft_s == pytest.approx(0.052, abs=1e-12)
    assert first.ttft_s == pytest.approx(0.052 + DT, abs=1e-12) and start == first.arrival_s


def test_a_fork_has_its_own_host_tier() -> None:
    eng = _engine()
    _evict_from_gpu(eng)
    _add(eng, 2, 1024, 4, (1, 2))
    eng.step(1e9)  # request 2 is loading: forked mid-copy
    twin = eng.fork()
    _add(twin, 3, 1024, 4, (20, 21))  # the twin stores 64 more blocks
    twin_stats = _drain(twin)
    stats = _drain(eng)
    assert (twin_stats.kv_offload_stored_blocks, stats.kv_offload_stored_blocks) == (64, 0)
    assert stats.kv_offload_usage == (64 + 118) / 1024
    assert twin_stats.kv_offload_usage == (64 + 118 + 64) / 1024
    assert [r.ttft_s for r in stats.finished] == [
        r.ttft_s for r in twin_stats.finished if r.request_id == 2]


def test_requests_without_prefix_ids_never_touch_the_host_tier() -> None:
    rows = [(0.01 * i, 300, 40, None) for i in range(60)]
    workload = build_workload(rows, name="same", source="test")
    on = run(workload, make_controller("static:8"), DeploymentSpec(kv_offload_gib=64))
    off = run(workload, make_controller("static:8"), DeploymentSpec())
    assert [r.comparable() for r in on.records] == [r.comparable() for r in off.records]
    assert all(v == 0 for k, v in on.row.items() if k.startswith("kv_offload_"))
    assert {k: v for k, v in on.row.items() if k not in ("wall_seconds", "speedup_x")} == {
        k: v for k, v in off.row.items() if k not in ("wall_seconds", "speedup_x")}


# ----------------------------------------------------------------- configuration


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "lots"])
def test_a_bad_kv_offload_gib_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--trace", "x.jsonl", "--kv-offload-gib", value])
    assert exc.value.code == 2
    assert "--kv-offload-gib" in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_offload_gib": -0.5}, "kv_offload_gib must be a finite number >= 0"),
    ({"kv_offload_gib": math.nan}, "kv_offload_gib must be a finite number >= 0"),
    ({"kv_offload_gib": 4.0, "enable_prefix_caching": False}, "needs prefix caching"),
])
def test_engine_and_deployment_configs_refuse_a_bad_host_tier(kwargs: dict[str, object],
                                                              message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        DeploymentSpec(**kwargs)  # type: ignore[arg-type]


def test_the_host_tier_needs_a_simulated_roofline_engine_with_a_host_link(
        tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="roofline model only"):
        DeploymentSpec(kv_offload_gib=4, engine="vllm", model="tiny")
    with pytest.raises(ValueError, match="needs the host link"):
        _engine_without_link()
    gpu = json.loads((Path(__file__).parents[1] / "rlbatch/profiles/gpus/a100-80g.json")
                     .read_text())
    del gpu["host_link_bandwidth_bytes_s"]
    path = tmp_path / "no-link.json"
    path.write_text(json.dumps(gpu))
    with pytest.raises(ValueError, match="no host_link_bandwidth_bytes_s"):
        run(build_workload([(0.0, 10, 2, None)], name="one", source="test"),
            make_controller("static:8"), DeploymentSpec(gpu=str(path), kv_offload_gib=4))


def _engine_without_link() -> SimEngine:
    cfg = EngineConfig(kv_offload_gib=1.0)
    return SimEngine(0, "fp16", cfg, ConstantStep(), num_kv_blocks=200, max_model_len=2048,
                     gpu_memory_total_bytes=1 << 30, num_buckets=4)


def test_the_cli_flag_reaches_the_engines(mooncake_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "row.json"
    assert main(["simulate", "--trace", str(mooncake_trace), "--controller", "static:16",
                 "--model", "llama-3.1-8b", "--max-requests", "150", "--json", str(out),
                 "--quiet", "--kv-offload-gib", "16"]) == 0
    row = json.loads(out.read_text())
    assert row["kv_offload_stored_blocks"] > 0
    assert row["kv_offload_store_bytes"] == row["kv_offload_stored_blocks"] * (2 << 20)
