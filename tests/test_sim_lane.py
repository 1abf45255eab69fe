"""The simulator's fast paths (decode lane, decode runs, ``advance``) against stepping.

Event skipping off runs every iteration request by request (vLLM V1's ``schedule()``): the
reference. Random small engines (few KV blocks: preemption; small token budgets: chunked
prefill; caps changed at ticks; every KV reserve mode) are driven the way the deployment
drives them, and every tick's snapshot must be the same to the last bit with ``step`` and
with ``advance``, the invariants holding after every call.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from rlbatch.engine.config import EngineConfig
from rlbatch.engine.reserve import KV_RESERVE_MODES
from rlbatch.engine.sim import SimEngine
from rlbatch.engine.stats import EngineStats
from rlbatch.profiles import StepTimeModel
from rlbatch.request import Request
from tests.factories import assert_skipping_equals_stepping, replay


class LinearStep(StepTimeModel):
    """Step times that depend on everything (so float sums in any other order would show).

    :param scale: every time multiplied by this (pools of different speeds).
    """

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def step_time_s(self, num_prefill_tokens: int, prefill_attn_work: float,
                    num_decode_seqs: int, decode_kv_tokens: int) -> float:
        return self.scale * (0.0061 + 1.7e-5 * num_prefill_tokens + 3.1e-9 * prefill_attn_work
                             + 1.3e-4 * num_decode_seqs + 1.1e-7 * decode_kv_tokens)

    def decode_coefficients(self, num_decode_seqs: int) -> tuple[float, float]:
        return self.scale * (0.0053 + 1.3e-4 * num_decode_seqs), self.scale * 1.1e-7


def _case(seed: int) -> tuple[EngineConfig, int, list[Request], list[int]]:
    rng = random.Random(seed)
    budget = rng.choice([48, 96, 256, 2048])
    cfg = EngineConfig(max_num_seqs=rng.choice([2, 4, 8, 32]), max_num_batched_tokens=budget,
                       kv_reserve=rng.choice(KV_RESERVE_MODES))
    blocks = rng.choice([40, 64, 200, 2000])
    t = 0.0
    requests = []
    for i in range(rng.randint(20, 120)):
        t += rng.expovariate(rng.choice([2.0, 20.0, 200.0]))
        prompt = rng.randint(1, 300)
        output = rng.randint(1, min(300, 640 - prompt))
        max_tokens = None if rng.random() < 0.5 else output + rng.randint(0, 40)
        requests.append(Request(i, t, prompt, output, max_tokens=max_tokens))
    caps = [rng.choice([1, 2, 4, 8, 32]) for _ in range(400)]
    return cfg, blocks, requests, caps


def _drive(cfg: EngineConfig, blocks: int, requests: list[Request], caps: list[int], *,
           skipping: bool, call: str, tick_s: float = 0.25) -> list[EngineStats]:
    """Replay ``requests`` as the deployment does: at each boundary the arrivals due are
    added, then one call runs to the next arrival or tick; a snapshot at every tick."""
    eng = SimEngine(0, "fp16", cfg, LinearStep(), num_kv_blocks=blocks, max_model_len=640,
                    gpu_memory_total_bytes=1 << 30, num_buckets=4, event_skipping=skipping)
    arrivals = [(r, min(r.prompt_tokens // 100, 3), r.prompt_tokens, False) for r in requests]
    return replay(eng, arrivals, caps, call=call, tick_s=tick_s)


@pytest.mark.parametrize("seed", range(40))
def test_lane_and_runs_equal_stepping(seed: int) -> None:
    cfg, blocks, requests, caps = _case(seed)
    assert_skipping_equals_stepping(
        lambda skipping, call: _drive(cfg, blocks, requests, caps, skipping=skipping, call=call),
        len(requests))


def test_cases_cover_preemption_chunking_and_the_lane() -> None:
    """The random cases above reach what they are there for."""
    preempted = chunked = 0
    for seed in range(40):
        cfg, blocks, requests, caps = _case(seed)
        snaps = _drive(cfg, blocks, requests, caps, skipping=True, call="advance")
        preempted += sum(s.preemptions for s in snaps) > 0
        chunked += any(r.prompt_tokens > cfg.max_num_batched_tokens for r in requests)
    assert preempted >= 5 and chunked >= 5


def test_step_keeps_the_protocol_granularity() -> None:
    """``step`` runs one iteration after a prefill and stops before a completion, so a
    closed-loop caller sees each completion on its own (the sweep relies on it)."""
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256)
    eng = SimEngine(0, "fp16", cfg, LinearStep(), num_kv_blocks=200, max_model_len=640,
                    gpu_memory_total_bytes=1 << 30, num_buckets=4)
    for i in range(2):
        eng.add_request(Request(i, 0.0, 20, 10 + 5 * i), 0, 20, False)
    eng.step(1e9)  # the prefill iteration only
    assert eng.snapshot().iterations == 1
    eng.step(1e9)  # a decode run up to, not including, request 0's last token
    assert eng.snapshot().finished == ()
    eng.step(1e9)
    assert [r.request_id for r in eng.snapshot().finished] == [0]
    twin = replace(cfg)
    other = SimEngine(0, "fp16", twin, LinearStep(), num_kv_blocks=200, max_model_len=640,
                      gpu_memory_total_bytes=1 << 30, num_buckets=4)
    for i in range(2):
        other.add_request(Request(i, 0.0, 20, 10 + 5 * i), 0, 20, False)
    other.advance(1e9)  # prefill, the decode run and the completing iteration in one call
    assert [r.request_id for r in other.snapshot().finished] == [0]
