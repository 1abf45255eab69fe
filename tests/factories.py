"""Tiny building blocks shared by the core tests: a constant-step engine and stats snapshots."""

from __future__ import annotations

import math
import signal
import subprocess
from collections.abc import Callable, Sequence

from hypothesis import strategies as st

from rlbatch.buckets import Buckets
from rlbatch.control.types import ControlAction, DeploymentStats, WindowStats
from rlbatch.engine.config import EngineConfig
from rlbatch.engine.reserve import KvReserveMode
from rlbatch.engine.sim import SimEngine
from rlbatch.engine.stats import AbortedRequest, EngineStats, FinishedRequest
from rlbatch.profiles import StepTimeModel
from rlbatch.request import Request

BUCKETS = Buckets((64, 128))
"""Three buckets: prompts below 64 tokens, 64-127, 128 and up."""


class ConstantStep(StepTimeModel):
    """Every iteration takes ``dt`` seconds: timings a test can reason about."""

    def __init__(self, dt: float = 0.01) -> None:
        self.dt = dt

    def step_time_s(self, num_prefill_tokens: int, prefill_attn_work: float,
                    num_decode_seqs: int, decode_kv_tokens: int) -> float:
        return self.dt

    def decode_coefficients(self, num_decode_seqs: int) -> tuple[float, float]:
        return self.dt, 0.0


def sim_engine(engine_id: int = 0, pool: str = "fp16", *, blocks: int = 64,
               max_num_seqs: int = 8, max_model_len: int = 512,
               num_buckets: int = len(BUCKETS),
               kv_reserve: KvReserveMode = "observed",
               event_skipping: bool = True) -> SimEngine:
    """A small simulated engine (16-token blocks, constant 10 ms steps)."""
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                       kv_reserve=kv_reserve)
    return SimEngine(engine_id, pool, cfg, ConstantStep(), num_kv_blocks=blocks,
                     max_model_len=max_model_len, gpu_memory_total_bytes=1 << 30,
                     num_buckets=num_buckets, event_skipping=event_skipping)


def record(request_id: int, bucket: int, *, ttft: float = 0.1, tpot: float = 0.01,
           pool: str = "fp16", rejected: bool = False, finish: float = 1.0,
           output_tokens: int = 4) -> FinishedRequest:
    """A finished (or rejected) request record."""
    nan = math.nan
    return FinishedRequest(
        request_id=request_id, bucket=bucket, pool="" if rejected else pool, arrival_s=0.0,
        prompt_tokens=10, output_tokens=0 if rejected else output_tokens,
        ttft_s=nan if rejected else ttft, tpot_s=nan if rejected else tpot,
        e2e_s=nan if rejected else ttft + tpot * (output_tokens - 1), finish_s=finish,
        rejected=rejected)


def engine_stats(engine_id: int = 0, pool: str = "fp16", *, running: tuple[int, ...] = (0, 0, 0),
                 waiting: tuple[int, ...] = (0, 0, 0), kv: float = 0.0,
                 prefill: int = 0, decode: int = 0, recomputed: int = 0, preemptions: int = 0,
                 kv_overflows: int = 0, committed: int = 0, capacity: int = 1024,
                 memory: tuple[int, int] = (0, 1 << 30),
                 finished: tuple[FinishedRequest, ...] = (),
                 first_tokens: tuple[tuple[int, float], ...] = (),
                 prefix: tuple[int, int] = (0, 0)) -> EngineStats:
    """An EngineStats with the given readings and harmless defaults."""
    return EngineStats(
        engine_id=engine_id, pool=pool, start_s=0.0, time_s=1.0, running=running,
        waiting=waiting, kv_cache_usage=kv, kv_cache_usage_peak=kv, committed_tokens=committed,
        kv_capacity_tokens=capacity, num_kv_blocks=capacity // 16,
        gpu_memory_used_bytes=memory[0], gpu_memory_total_bytes=memory[1], iterations=1,
        busy_s=0.5, prefill_tokens=prefill, decode_tokens=decode, preemptions=preemptions,
        recomputed_tokens=recomputed, kv_overflows=kv_overflows, max_num_seqs=8,
        finished=finished, first_tokens=first_tokens, prefix_cache_queries=prefix[0],
        prefix_cache_hits=prefix[1])


def window(n: int = 3, *, ttft: float = math.nan, tpot: float = math.nan,
           completed: tuple[int, ...] | None = None,
           sla_met: tuple[int, ...] | None = None) -> WindowStats:
    """Window percentiles, the same in every bucket."""
    return WindowStats(window_s=30.0, ttft_p99_s=(ttft,) * n, tpot_p99_s=(tpot,) * n,
                       ttft_p99_all_s=ttft, tpot_p99_all_s=tpot, e2e_p99_all_s=ttft,
                       completed=completed or (0,) * n, sla_met=sla_met or (0,) * n)


def deployment_stats(engines: tuple[EngineStats, ...], *, n: int = 3, tick_s: float = 1.0,
                     queued: tuple[int, ...] | None = None,
                     arrived: tuple[int, ...] | None = None,
                     rejected: tuple[int, ...] | None = None, win: WindowStats | None = None,
                     caps: tuple[int | None, ...] | None = None,
                     pools: tuple[str, ...] | None = None,
                     oldest_wait_s: tuple[float, ...] | None = None) -> DeploymentStats:
    """A DeploymentStats around ``engines``."""
    return DeploymentStats(
        time_s=10.0, tick_s=tick_s, engines=engines, queued=queued or (0,) * n,
        arrived=arrived or (0,) * n, rejected=rejected or (0,) * n, window=win or window(n),
        action=ControlAction(caps or (8,) * n, pools or ("fp16",) * n),
        oldest_wait_s=oldest_wait_s if oldest_wait_s is not None else (0.0,) * n)


counts3 = st.tuples(*(st.integers(0, 50),) * 3)
odd_floats = st.one_of(st.floats(0.0, 5.0), st.just(math.nan), st.just(math.inf))


@st.composite
def random_engine_stats(draw: st.DrawFn, engine_id: int, pool: str) -> EngineStats:
    """An EngineStats with random (sometimes NaN or infinite) readings."""
    prefill, decode = draw(st.integers(0, 5000)), draw(st.integers(0, 5000))
    finished = tuple(record(1000 * engine_id + i, draw(st.integers(0, 2)),
                            ttft=draw(st.floats(0.0, 5.0)), tpot=draw(st.floats(0.0, 0.3)),
                            pool=pool)
                     for i in range(draw(st.integers(0, 6))))
    return engine_stats(
        engine_id, pool, running=draw(counts3), waiting=draw(counts3), kv=draw(odd_floats),
        prefill=prefill, decode=decode, recomputed=draw(st.integers(0, prefill + decode + 10)),
        preemptions=draw(st.integers(0, 20)), kv_overflows=draw(st.integers(0, 3)),
        committed=draw(st.integers(0, 4000)), capacity=draw(st.sampled_from((0, 1024, 4096))),
        memory=(draw(st.integers(0, 1 << 30)), draw(st.sampled_from((0, 1 << 30)))),
        finished=finished)


@st.composite
def random_deployment_stats(draw: st.DrawFn) -> DeploymentStats:
    """A DeploymentStats of one or two engines (pools fp16 / fp8) with random readings."""
    pools = draw(st.sampled_from((("fp16",), ("fp16", "fp8"))))
    engines = tuple(draw(random_engine_stats(i, p)) for i, p in enumerate(pools))
    completed = draw(counts3)
    met = tuple(draw(st.integers(0, c)) for c in completed)
    return deployment_stats(
        engines, tick_s=draw(st.sampled_from((0.5, 1.0, 2.0))), queued=draw(counts3),
        arrived=draw(counts3), rejected=draw(counts3),
        win=window(ttft=draw(odd_floats), tpot=draw(odd_floats), completed=completed,
                   sla_met=met),
        caps=tuple(draw(st.one_of(st.none(), st.integers(1, 64))) for _ in range(3)),
        pools=tuple(draw(st.sampled_from(pools)) for _ in range(3)),
        oldest_wait_s=tuple(draw(odd_floats) for _ in range(3)))


def stop_child(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a child server (the graceful path under test), then kill it if it hangs."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def replay(eng: SimEngine, arrivals: list[tuple[Request, int, int, bool]], caps: list[int], *,
           call: str, tick_s: float = 0.25, aborts: Sequence[tuple[float, int, bool]] = (),
           aborted: list[AbortedRequest | None] | None = None) -> list[EngineStats]:
    """Replay arrivals ``(request, bucket, kept tokens, truncated)`` on ``eng`` as the
    deployment does: at each boundary the arrivals due are added, then the aborts
    ``(time, request id, before_first_token)`` due are made (their returns appended to
    ``aborted``), then one ``call`` (``step`` or ``advance``) runs to the next arrival, abort
    or tick, invariants checked after each; a snapshot at every tick, after which the tick's
    cap is set.
    """
    run = getattr(eng, call)
    snaps = []
    idx = j = 0
    for tick, cap in enumerate(caps, start=1):
        t_stop = tick * tick_s
        while eng.now_s < t_stop:
            while idx < len(arrivals) and arrivals[idx][0].arrival_s <= eng.now_s:
                eng.add_request(*arrivals[idx])
                idx += 1
            while j < len(aborts) and aborts[j][0] <= eng.now_s:
                returned = eng.abort(aborts[j][1], before_first_token=aborts[j][2])
                if aborted is not None:
                    aborted.append(returned)
                eng.check_invariants()
                j += 1
            bound = min(arrivals[idx][0].arrival_s if idx < len(arrivals) else t_stop,
                        aborts[j][0] if j < len(aborts) else t_stop, t_stop)
            if eng.is_idle():
                eng.advance_idle(bound)
            else:
                run(bound)
            eng.check_invariants()
        snaps.append(eng.snapshot())
        eng.set_max_num_seqs(cap)
        if idx == len(arrivals) and j == len(aborts) and eng.is_idle():
            break
    return snaps


def assert_skipping_equals_stepping(drive: Callable[[bool, str], list[EngineStats]],
                                    n_requests: int) -> None:
    """Event skipping (``step`` and ``advance``) gives exactly the snapshots of stepping one
    iteration at a time, and the stepped replay finishes all ``n_requests``.

    :param drive: ``(skipping, call) -> snapshots`` of one replay.
    """
    ref = drive(False, "step")
    assert sum(len(s.finished) for s in ref) == n_requests
    for call in ("step", "advance"):
        got = drive(True, call)
        assert len(got) == len(ref), call
        for a, b in zip(got, ref, strict=True):
            assert a == b, (call, a.time_s)
