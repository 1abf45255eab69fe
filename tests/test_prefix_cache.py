"""Prefix caching in the simulated engine: exact small cases (vLLM V1's semantics)."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rlbatch.commands.main import main
from rlbatch.control.controllers import make_controller
from rlbatch.engine.config import EngineConfig
from rlbatch.engine.prefix_cache import prefix_layout
from rlbatch.engine.sim import SimEngine
from rlbatch.engine.stats import EngineStats
from rlbatch.request import Request
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.serving.run import run
from rlbatch.workload import build_workload
from tests.factories import ConstantStep


def _engine(blocks: int = 200, budget: int = 2048, max_model_len: int = 2048,
            caching: bool = True, skipping: bool = True) -> SimEngine:
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                       enable_prefix_caching=caching)
    return SimEngine(0, "fp16", cfg, ConstantStep(), num_kv_blocks=blocks,
                     max_model_len=max_model_len, gpu_memory_total_bytes=1 << 30,
                     num_buckets=4, event_skipping=skipping)


def _add(eng: SimEngine, rid: int, prompt: int, output: int,
         ids: tuple[int, ...] | None, kept: int | None = None) -> None:
    kept = prompt if kept is None else kept
    eng.add_request(Request(rid, eng.now_s, prompt, output, prefix_ids=ids), 0, kept,
                    kept < prompt)


def _drain(eng: SimEngine) -> EngineStats:
    while not eng.is_idle():
        eng.step(1e9)
        eng.check_invariants()
    return eng.snapshot()


def _blocks(ids: tuple[int, ...], prompt: int, kept: int) -> list[tuple[int, int]]:
    """What names each hashed block: its group's key and its place in the group."""
    keys, sizes, _ = prefix_layout(ids, prompt, kept, 16)
    return [(key, j) for key, size in zip(keys, sizes, strict=True) for j in range(size)]


def _shared(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


@pytest.mark.parametrize(("ids_a", "len_a", "kept_a", "ids_b", "len_b", "kept_b", "shared"), [
    ((1, 2, 3), 1536, 1536, (1, 2, 3), 1536, 1536, 96),  # the same prompt: every block
    ((1, 2, 3), 1536, 1536, (1, 2, 4), 1536, 1536, 64),  # ids agree on 1024 tokens
    ((1, 2, 3), 1536, 1536, (9, 2, 3), 1536, 1536, 0),  # the first id differs: nothing
    ((1, 2, 3), 1500, 1500, (1, 2, 3), 1100, 1100, 68),  # a shorter prompt: its full blocks
    ((1, 2), 1024, 1024, (1, 2, 5), 1400, 1400, 64),  # one prompt ends where they diverge
    ((1, 2, 3), 1536, 1000, (1, 2, 3), 1536, 1000, 62),  # truncated alike: same tail kept
    ((1, 2, 3), 1536, 1000, (1, 2, 3), 1536, 1536, 0),  # truncated vs whole: other positions
    ((1, 2, 3), 1536, 1000, (1, 2, 3), 1600, 1000, 0),  # tails kept from other tokens
    ((1, 2, 3), 1536, 1000, (1, 2, 3), 1600, 1064, 62),  # the same tokens kept
    ((7,), 700, 700, (7,), 700, 700, 32),  # ids describe 512 tokens: the rest has no hash
])
def test_hashes_share_exactly_the_blocks_before_the_first_different_id(
        ids_a: tuple[int, ...], len_a: int, kept_a: int, ids_b: tuple[int, ...], len_b: int,
        kept_b: int, shared: int) -> None:
    a = _blocks(ids_a, len_a, kept_a)
    b = _blocks(ids_b, len_b, kept_b)
    assert len(a) == min(kept_a, 512 * len(ids_a) - (len_a - kept_a)) // 16
    assert _shared(a, b) == shared
    assert len(set(a) & set(b)) == shared  # a block never matches at another position


@pytest.mark.parametrize("seed", range(20))
def test_layout_names_each_block_by_its_prefix(seed: int) -> None:
    """Block q is named by (the key chained up to the 512-token block holding its last
    token, its place among the blocks ending in that 512-token block), in any alignment."""
    rng = random.Random(seed)
    block = rng.choice([16, 32, 48])
    ids = tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 12)))
    prompt = rng.randint(1, 512 * len(ids) + 300)
    kept = prompt if seed % 2 else rng.randint(1, prompt)
    start = prompt - kept
    count = max(0, (min(prompt, 512 * len(ids)) - start) // block)
    chain = {}
    key = hash((0x5EED_CAC4E, start))
    for i in range(start // 512, len(ids)):
        key = chain[i] = hash((key, ids[i]))
    last = [(start + block * q + block - 1) // 512 for q in range(count)]
    expected = [(chain[i], last[:q].count(i)) for q, i in enumerate(last)]
    keys, sizes, ends = prefix_layout(ids, prompt, kept, block)
    assert [(k, j) for k, n in zip(keys, sizes, strict=True) for j in range(n)] == expected
    assert list(ends) == list(itertools.accumulate(sizes))


def test_layout_is_the_same_in_every_process() -> None:
    code = ("from rlbatch.engine.prefix_cache import prefix_layout; "
            "print(prefix_layout((4, 8, 15), 1500, 1400, 16))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert runs == {f"{prefix_layout((4, 8, 15), 1500, 1400, 16)}\n"}


@pytest.mark.parametrize("skipping", [True, False])
def test_second_identical_request_skips_the_cached_prefill(skipping: bool) -> None:
    eng = _engine(skipping=skipping)
    _add(eng, 0, 100, 3, (5,))
    first = _drain(eng)
    assert (first.prefill_tokens, first.prefix_cache_queries, first.prefix_cache_hits) == (
        100, 100, 0)
    _add(eng, 1, 100, 3, (5,))
    second = _drain(eng)
    # 6 full blocks (96 tokens) of 100 are cached; at most (100 - 1) // 16 = 6 blocks.
    assert (second.prefill_tokens, second.prefix_cache_queries,
            second.prefix_cache_hits) == (4, 100, 96)
    assert second.decode_tokens == 2 and second.finished[0].output_tokens == 3


def test_a_full_prompt_hit_still_computes_the_last_block() -> None:
    eng = _engine()
    _add(eng, 0, 64, 2, (5,))
    _drain(eng)
    _add(eng, 1, 64, 2, (5,))
    stats = _drain(eng)
    # all 4 blocks cached, but the last token is computed: the hit stops a block short
    assert (stats.prefix_cache_hits, stats.prefill_tokens) == (48, 16)


def test_lru_evicts_the_least_recently_freed_tail_first() -> None:
    eng = _engine(blocks=24, max_model_len=256)
    _add(eng, 0, 64, 1, (1,))  # blocks a0..a3, freed tail first: a3 a2 a1 a0
    _add(eng, 1, 64, 1, (2,))  # b0..b3, freed after them: b3 b2 b1 b0
    _drain(eng)
    _add(eng, 2, 250, 1, None)  # 16 blocks: the 16 never used go first, nothing evicted
    assert _drain(eng).prefix_cache_evictions == 0
    # One iteration: request 3 takes 5 blocks (a3 a2 a1 a0 b3 evicted), request 4 then hits
    # b0 b1 b2, request 5 finds a0 gone.
    _add(eng, 3, 80, 1, None)
    _add(eng, 4, 64, 1, (2,))
    _add(eng, 5, 64, 1, (1,))
    stats = _drain(eng)
    assert stats.iterations == 1
    assert (stats.prefix_cache_evictions, stats.prefix_cache_hits) == (5, 48)
    _add(eng, 6, 64, 1, (2,))  # request 4 freed its blocks again, cached
    assert _drain(eng).prefix_cache_hits == 48


def test_a_block_shared_by_running_requests_is_counted_once() -> None:
    eng = _engine(blocks=200)
    _add(eng, 0, 64, 20, (5,))
    eng.step(1e9)  # request 0's prefill: 4 blocks
    _add(eng, 1, 64, 20, (5,))
    eng.step(1e9)  # request 0 decodes into a 5th block; request 1 hits 3, computes 1 block
    eng.check_invariants()
    stats = eng.snapshot()
    assert stats.prefix_cache_hits == 48
    assert stats.kv_cache_usage == 6 / 200  # 5 + 1, the 3 shared blocks once
    _drain(eng)
    assert eng.snapshot().kv_cache_usage == 0.0  # cached but free blocks are not in use


def test_requests_without_prefix_ids_never_hit_and_change_nothing() -> None:
    rows = [(0.01 * i, 300, 40, None) for i in range(60)]  # identical prompts, no ids
    workload = build_workload(rows, name="same", source="test")
    on = run(workload, make_controller("static:8"), DeploymentSpec())
    off = run(workload, make_controller("static:8"),
              DeploymentSpec(enable_prefix_caching=False))
    assert on.row["prefix_cache_queries"] == 60 * 300 and on.row["prefix_cache_hits"] == 0
    assert on.row["prefix_hit_rate"] == 0.0 and off.row["prefix_cache_queries"] == 0
    assert [r.comparable() for r in on.records] == [r.comparable() for r in off.records]


@pytest.mark.parametrize("ids", [(1, 2, 3, 4), None])
def test_holds_new_arrivals_allows_for_hits_still_to_come(ids: tuple[int, ...] | None) -> None:
    # Request 0 prefills 1600 tokens about 255 at a time; request 1 waits, its first chunk
    # does not fit the one free block. Without ids it needs 16 new blocks whatever happens:
    # the engine holds new arrivals. With ids, cached blocks could shorten that chunk to one
    # block (the bound takes every hash of request 1 as cached), so it does not claim to.
    eng = _engine(blocks=130, budget=256)
    _add(eng, 9, 600, 300, None)  # 38 blocks and growing
    _add(eng, 0, 1600, 2, (1, 2, 3, 4))
    for _ in range(4):
        eng.step(1e9)
    _add(eng, 1, 1600, 2, ids)
    for _ in range(4):
        eng.step(1e9)
    assert eng.num_waiting(0) == 1 and eng.snapshot().kv_cache_usage == 129 / 130
    assert eng.holds_new_arrivals() == (ids is None)


def test_a_fork_has_its_own_cache() -> None:
    eng = _engine(blocks=32, max_model_len=512)
    _add(eng, 0, 160, 1, (3,))  # 10 cached blocks, freed behind the 22 never used
    _drain(eng)
    twin = eng.fork()
    _add(twin, 1, 400, 1, None)  # 25 blocks: the twin evicts the last 3 of request 0's
    _add(twin, 2, 160, 1, (3,))
    twin_stats = _drain(twin)
    twin.check_invariants()
    assert (twin_stats.prefix_cache_evictions, twin_stats.prefix_cache_hits) == (3, 7 * 16)
    _add(eng, 2, 160, 1, (3,))  # the original still has all of them: 9 blocks, one short
    stats = _drain(eng)
    assert (stats.prefix_cache_evictions, stats.prefix_cache_hits) == (0, 9 * 16)


def test_a_fork_shares_nothing_with_the_requests_it_copied() -> None:
    def start() -> SimEngine:
        eng = _engine(blocks=64, max_model_len=512)
        _add(eng, 0, 300, 40, (3,))
        eng.step(1e9)
        _add(eng, 1, 300, 5, (4,))  # waiting when forked
        return eng

    eng = start()
    twin = eng.fork()
    _add(twin, 2, 300, 5, (4,))
    _drain(twin)
    reference = start()  # never forked
    assert _drain(eng) == _drain(reference)


def test_no_prefix_caching_flag_gives_zero_hits(mooncake_trace: Path, tmp_path: Path) -> None:
    rows = {}
    for flag in ([], ["--no-prefix-caching"]):
        out = tmp_path / f"row{len(flag)}.json"
        assert main(["simulate", "--trace", str(mooncake_trace), "--controller", "static:16",
                     "--model", "llama-3.1-8b", "--max-requests", "150", "--json", str(out),
                     "--quiet", *flag]) == 0
        rows[bool(flag)] = json.loads(out.read_text())
    assert rows[False]["prefix_hit_rate"] > 0 and rows[False]["prefix_cache_hits"] > 0
    assert (rows[True]["prefix_hit_rate"], rows[True]["prefix_cache_queries"],
            rows[True]["prefix_cache_hits"]) == (0.0, 0, 0)
    assert rows[True]["prefill_tokens"] > rows[False]["prefill_tokens"]
