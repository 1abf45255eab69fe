"""Prefix caching under the simulator's fast paths: event skipping == stepping, bit for bit.

Random small engines as in tests/test_sim_lane.py, now with requests that share prefixes
(Mooncake-style ids of 512-token blocks drawn from a small tree, some prompts truncated, some
without ids): few KV blocks (preemptions and evictions), small token budgets (chunked
prefill, hits in the middle of another request's prefill), caps changed at ticks. Every
tick's snapshot, prefix-cache counters included, must be the same with ``step`` and with
``advance`` as request by request, the invariants holding after every call. The same cases
again with a host KV tier (small host pools: host evictions; slow host links: requests wait
for their copies, copies queue on the link). Then whole deployments on a Mooncake slice,
with and without the host tier.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rlbatch.control.controllers import make_controller
from rlbatch.engine.config import EngineConfig
from rlbatch.engine.host_tier import HostLink
from rlbatch.engine.reserve import KV_RESERVE_MODES
from rlbatch.engine.sim import SimEngine
from rlbatch.engine.stats import EngineStats
from rlbatch.request import Request
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import load_trace
from tests.factories import assert_skipping_equals_stepping, replay
from tests.test_sim_lane import LinearStep

MAX_MODEL_LEN = 2048


def _host_tier(seed: int, cfg: EngineConfig) -> tuple[EngineConfig, HostLink]:
    """The case's config with a host tier of a few to many 1 MiB blocks, and its link
    (drawn apart, so the cases without it stay what they were)."""
    rng = random.Random(10_000 + seed)
    host_blocks = rng.choice([20, 60, 150, 1000])
    link = HostLink(block_bytes=1 << 20, load_s_per_block=rng.choice([1e-4, 2e-3, 0.02]))
    return replace(cfg, kv_offload_gib=host_blocks / 1024), link


def _case(seed: int) -> tuple[EngineConfig, int, list[tuple[Request, int]], list[int]]:
    """An engine config, its KV blocks, requests with the prompt tokens kept, cap changes."""
    rng = random.Random(seed)
    cfg = EngineConfig(max_num_seqs=rng.choice([2, 4, 8, 32]),
                       max_num_batched_tokens=rng.choice([96, 256, 700, 2048]),
                       kv_reserve=rng.choice(KV_RESERVE_MODES))
    blocks = rng.choice([130, 200, 400, 3000])
    t = 0.0
    requests = []
    for i in range(rng.randint(30, 90)):
        t += rng.expovariate(rng.choice([2.0, 20.0, 200.0]))
        prompt = rng.randint(1, 1900)
        output = rng.randint(1, min(120, MAX_MODEL_LEN - prompt))
        ids: tuple[int, ...] | None = None
        if rng.random() < 0.8:  # a path in a tree of 3 x 3 x 3 ... ids: prefixes repeat
            ids = tuple(10 * depth + rng.randint(0, 2) for depth in range(-(-prompt // 512)))
        kept = prompt if rng.random() < 0.8 else rng.randint(1, prompt)  # some truncated
        requests.append((Request(i, t, prompt, output, prefix_ids=ids), kept))
    caps = [rng.choice([1, 2, 4, 8, 32]) for _ in range(400)]
    return cfg, blocks, requests, caps


def _drive(cfg: EngineConfig, blocks: int, requests: list[tuple[Request, int]],
           caps: list[int], *, skipping: bool, call: str, tick_s: float = 0.25,
           link: HostLink | None = None) -> list[EngineStats]:
    eng = SimEngine(0, "fp16", cfg, LinearStep(), num_kv_blocks=blocks,
                    max_model_len=MAX_MODEL_LEN, gpu_memory_total_bytes=1 << 30,
                    num_buckets=4, event_skipping=skipping, host_link=link)
    arrivals = [(r, min(kept // 500, 3), kept, kept < r.prompt_tokens) for r, kept in requests]
    return replay(eng, arrivals, caps, call=call, tick_s=tick_s)


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_prefix_caching_skipping_equals_stepping(seed: int, host: bool) -> None:
    cfg, blocks, requests, caps = _case(seed)
    link = None
    if host:
        cfg, link = _host_tier(seed, cfg)
    assert_skipping_equals_stepping(
        lambda skipping, call: _drive(cfg, blocks, requests, caps, skipping=skipping, call=call,
                                      link=link),
        len(requests))


def test_cases_cover_hits_evictions_and_preemption() -> None:
    """The random cases above reach what they are there for."""
    hit = evicted = preempted = 0
    for seed in range(30):
        cfg, blocks, requests, caps = _case(seed)
        snaps = _drive(cfg, blocks, requests, caps, skipping=True, call="advance")
        hit += sum(s.prefix_cache_hits for s in snaps) > 0
        evicted += sum(s.prefix_cache_evictions for s in snaps) > 0
        preempted += sum(s.preemptions for s in snaps) > 0
    assert hit >= 20 and evicted >= 10 and preempted >= 5


def test_host_cases_cover_loads_waits_and_host_evictions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the host tier the cases load prefixes the GPU lost (some while the engine has
    nothing else to run, some queued behind other copies) and evict from small host pools."""
    idle_waits = []
    wait = SimEngine._wait_for_loads

    def counted(self: SimEngine, bound_s: float) -> None:
        before = self.now_s
        wait(self, bound_s)
        idle_waits.append(self.now_s > before)

    monkeypatch.setattr(SimEngine, "_wait_for_loads", counted)
    loaded = waited = queued = host_evicted = 0
    for seed in range(30):
        cfg, blocks, requests, caps = _case(seed)
        cfg, link = _host_tier(seed, cfg)
        idle_waits.clear()
        snaps = _drive(cfg, blocks, requests, caps, skipping=True, call="advance", link=link)
        hits = sum(s.kv_offload_hits for s in snaps)
        blocks_loaded = sum(s.kv_offload_loaded_blocks for s in snaps)
        load_s = sum(s.kv_offload_load_s for s in snaps)
        loaded += hits > 0
        # a request waited longer than its own copy: it queued behind another on the link
        queued += load_s > blocks_loaded * link.load_s_per_block * (1 + 1e-9)
        waited += any(idle_waits)  # the engine idled until a copy completed
        host_evicted += sum(s.kv_offload_evictions for s in snaps) > 0
    assert loaded >= 15 and queued >= 10 and host_evicted >= 20 and waited >= 8  # of 30


@pytest.mark.parametrize("controller", ["static:8", "vllm-default", "fixed:64", "playbook"])
def test_mooncake_slice_skipping_equals_stepping(controller: str, mooncake_trace: Path) -> None:
    workload = load_trace(mooncake_trace, window_s=(0.0, 90.0), rate_scale=0.5)
    spec = DeploymentSpec(model="llama-3.1-8b", num_kv_blocks=6000, max_model_len=32768,
                          admission=AdmissionConfig(over_length="truncate"))
    on = run(workload, make_controller(controller), spec)
    off = run(workload, make_controller(controller), replace(spec, event_skipping=False))
    assert {r.request_id: r.comparable() for r in on.records} == {
        r.request_id: r.comparable() for r in off.records}
    for key in ("prefill_tokens", "decode_tokens", "preemptions", "prefix_cache_queries",
                "prefix_cache_hits", "prefix_cache_evictions"):
        assert on.row[key] == off.row[key], key
    assert on.row["prefix_cache_hits"] > 0 and on.row["prefix_cache_evictions"] > 0


def _host_tier_slice_matches(controller: str, mooncake_trace: Path,
                             pools: dict[str, int]) -> dict[str, Any]:
    """A Mooncake slice on llama-3.1-8b engines with 8 GiB host tiers, skipping and stepping:
    same records, same cache and token counters; the skipping run's row."""
    workload = load_trace(mooncake_trace, window_s=(0.0, 90.0), rate_scale=0.5)
    spec = DeploymentSpec(model="llama-3.1-8b", num_kv_blocks=3000, max_model_len=32768,
                          pools=pools, admission=AdmissionConfig(over_length="truncate"),
                          kv_offload_gib=8)
    on = run(workload, make_controller(controller), spec)
    off = run(workload, make_controller(controller), replace(spec, event_skipping=False))
    assert {r.request_id: r.comparable() for r in on.records} == {
        r.request_id: r.comparable() for r in off.records}
    for key, value in on.row.items():
        if key.startswith(("kv_offload_", "prefix_cache_")) or key.endswith("_tokens"):
            assert value == off.row[key], key
    return on.row


@pytest.mark.parametrize("controller", ["static:8", "vllm-default", "fixed:64"])
def test_mooncake_slice_host_tier_skipping_equals_stepping(controller: str,
                                                           mooncake_trace: Path) -> None:
    row = _host_tier_slice_matches(controller, mooncake_trace, {"fp16": 1})
    # the slice's loads come from preempted requests' own blocks (its first admissions
    # share little), evicted from the GPU and found in the host pool
    assert row["kv_offload_loaded_blocks"] > 0 and row["kv_offload_evictions"] > 0


# The budget counting every request at its count (commit=final): behind the peak budget
# this slice loads nothing from the host tiers (tests/test_skipping_fuzz.py covers that one).
@pytest.mark.parametrize("controller", ["fixed:64[guard.kv_budget.commit=final]",
                                        "fixed:256[guard.kv_budget.commit=final]"])
def test_two_pools_host_tier_behind_the_kv_budget_skipping_equals_stepping(
        controller: str, mooncake_trace: Path) -> None:
    # Two engines share the queue behind the KV budget while each loads from its host tier:
    # a skipping engine stops at the other's boundaries, its waits for copies do not.
    row = _host_tier_slice_matches(controller, mooncake_trace, {"fp16": 1, "fp8": 1})
    assert row["kv_offload_loaded_blocks"] > 0
