"""Sidecar units and fault handling (no vLLM needed; a few seconds in all).

Where a fault must be injected that a real vLLM server cannot produce on demand (a 500
answer, a dropped connection, a broken ``/metrics``, a response that never comes) the
upstream is :class:`~tests.fake_upstream.FakeUpstream`; request validation
needs no upstream at all. Everything else runs against a real vLLM server in
``tests/test_sidecar_live.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from policies.artifact import ArtifactError, save_artifact
from policies.ppo import PpoController, ppo_factory
from rlbatch.buckets import Buckets
from rlbatch.commands import serve as serve_command
from rlbatch.commands.serve import add_arguments, controller_spec, settings_from_args
from rlbatch.control.action_codec import ActionCodec
from rlbatch.control.controllers import make_controller
from rlbatch.control.discipline import KvBudget
from rlbatch.control.guard import DEFAULT_LADDER
from rlbatch.control.observation import observation_size
from rlbatch.control.types import ControlAction
from rlbatch.sidecar import SIDECAR, Sidecar, SidecarSettings, UpstreamSpec, create_app, serve
from rlbatch.sidecar.openai import BadRequest, completion_tokens, parse_request
from rlbatch.sidecar.responses import take_usage
from rlbatch.sidecar.tokens import ApproxCounter, Prompt
from rlbatch.sidecar.vllm_server import free_port
from tests.fake_upstream import FakeUpstream, Faults

REPO = Path(__file__).resolve().parents[1]
EDGES = (128, 256, 512)
BUCKETS = Buckets(EDGES)


# --------------------------------------------------------------------------- helpers
def fixed_policy(path: Path, caps: Sequence[int], pools: Sequence[str],
                 pool_names: Sequence[str] = ("fp16", "fp8"),
                 edges: Sequence[int] = EDGES, obs_version: int = 1) -> Path:
    """A valid PPO artifact whose deterministic action is always ``caps`` / ``pools``
    (zero weights, one-hot head bias): a policy with a known answer."""
    n = len(edges) + 1
    ladder = list(DEFAULT_LADDER)
    codec = ActionCodec(ladder, list(pool_names), n)
    nvec, routes = codec.nvec, list(codec.routes)
    obs = observation_size(n, obs_version)
    width = 8
    bias = np.zeros(sum(nvec), dtype=np.float32)
    offset = 0
    for b in range(n):
        bias[offset + ladder.index(caps[b])] = 10.0
        offset += len(ladder)
        bias[offset + routes.index(pools[b])] = 10.0
        offset += len(routes)
    hidden = [(np.zeros((width, obs), np.float32), np.zeros(width, np.float32))]
    head = (np.zeros((sum(nvec), width), np.float32), bias)
    meta = {"nvec": nvec, "obs_size": obs, "ladder": ladder, "pools": list(pool_names),
            "bucket_edges": list(edges), "activation": "tanh", "obs_version": obs_version}
    save_artifact(path, hidden, head, meta)
    return path


def make_settings(*upstreams: tuple[str, str], **changes: object) -> SidecarSettings:
    base: dict[str, object] = dict(
        upstreams=tuple(UpstreamSpec(p, u) for p, u in upstreams), port=free_port(),
        buckets=BUCKETS, tick_s=0.2, cold_start=False, gpu_telemetry=False,
        tokenizer="approx", scrape_timeout_s=1.0, connect_timeout_s=1.0)
    base.update(changes)
    return SidecarSettings(**base)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running_sidecar(settings: SidecarSettings, controller_name: str = "static:4", *,
                          ready: bool = True) -> AsyncIterator[tuple[str, Sidecar]]:
    """The sidecar in this event loop; yields its URL and state."""
    app = create_app(settings, make_controller(controller_name),
                     controller_factory=make_controller)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(app, settings, stop=stop))
    url = f"http://{settings.host}:{settings.port}"
    sidecar = app[SIDECAR]
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(url + "/health") as r:
                        if r.status == 200 and (not ready or sidecar.ready):
                            break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("sidecar did not come up")
        yield url, sidecar
    finally:
        stop.set()
        await task


@contextlib.asynccontextmanager
async def fakes(*faults: Faults) -> AsyncIterator[list[FakeUpstream]]:
    ups = [FakeUpstream(faults=f) for f in faults]
    for u in ups:
        await u.start()
    try:
        yield ups
    finally:
        for u in ups:
            await u.stop()


async def post(session: aiohttp.ClientSession, url: str, body: object | bytes,
               path: str = "/v1/completions") -> tuple[int, bytes, dict[str, str]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url + path, data=data,
                            headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.read(), dict(r.headers)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def sample(sidecar: Sidecar, name: str, **labels: str) -> float:
    value = sidecar.metrics.registry.get_sample_value(name, labels)
    assert value is not None, f"no sample {name}{labels}"
    return value


# --------------------------------------------------------------------------- units
def test_settings_validation() -> None:
    up = (UpstreamSpec("fp16", "http://127.0.0.1:1"),)
    assert SidecarSettings(upstreams=up).host == "127.0.0.1"  # loopback unless told
    # profile names are checked as the other commands check them: a typo is an error, not a
    # capacity of 0 that observation version 3 then refuses at the first tick
    assert SidecarSettings(upstreams=up, gpu="a100-80g", model="llama-2-7b").gpu == "a100-80g"
    with pytest.raises(ValueError, match=r"gpu: .*'a100'.*available names: a100-80g"):
        SidecarSettings(upstreams=up, gpu="a100")
    with pytest.raises(ValueError, match=r"model: .*'llama2'.*available names"):
        SidecarSettings(upstreams=up, model="llama2")
    with pytest.raises(ValueError, match="at least one"):
        SidecarSettings(upstreams=())
    with pytest.raises(ValueError, match="pool must be one of"):
        UpstreamSpec.parse("bf16=http://127.0.0.1:1")
    with pytest.raises(ValueError, match="POOL=URL"):
        UpstreamSpec.parse("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="no path"):
        UpstreamSpec.parse("fp16=http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="distinct"):
        SidecarSettings(upstreams=up * 2)
    with pytest.raises(ValueError, match="tick_s"):
        SidecarSettings(upstreams=up, tick_s=0)
    with pytest.raises(ValueError, match="max_queue_len"):
        SidecarSettings(upstreams=up, max_queue_len=0)
    with pytest.raises(ValueError, match="tokenizer"):
        SidecarSettings(upstreams=up, tokenizer="/no/such/tokenizer.json")
    with pytest.raises(ValueError, match="shadow_pool"):
        SidecarSettings(upstreams=up, shadow_pool="fp8")
    two = SidecarSettings(upstreams=(UpstreamSpec("fp8", "http://127.0.0.1:2"), *up))
    assert two.pools == ("fp16", "fp8")  # canonical order, whatever the command line order


def test_capacity_from_settings_or_profiles() -> None:
    from rlbatch.profiles.capacity import profile_capacity_rps
    from rlbatch.sidecar.source import describe_upstreams

    up = (UpstreamSpec("fp16", "http://127.0.0.1:1"), UpstreamSpec("fp16", "http://127.0.0.1:2"))
    with pytest.raises(ValueError, match="capacity_rps"):
        SidecarSettings(upstreams=up, capacity_rps=0.0)
    given = SidecarSettings(upstreams=up, capacity_rps=7.5, gpu="a100-80g", model="llama-2-7b")
    assert describe_upstreams(given, {"fp16": []}, 4096).capacity_rps == 7.5
    named = SidecarSettings(upstreams=up, gpu="h100-80g", model="llama-3.1-8b")
    expected = profile_capacity_rps("h100-80g", "llama-3.1-8b", {"fp16": 2}, max_num_seqs=256,
                                    max_num_batched_tokens=8192)
    assert describe_upstreams(named, {"fp16": []}, 4096).capacity_rps == pytest.approx(expected)
    assert expected > 0
    unknown = SidecarSettings(upstreams=up)  # gpu and model "unknown": not profiles
    assert describe_upstreams(unknown, {"fp16": []}, 4096).capacity_rps == 0.0


def test_cli_builds_settings() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--upstream", "fp16=http://127.0.0.1:8000", "--upstream",
                              "fp8=http://127.0.0.1:8001", "--policy", "p", "--shadow",
                              "--buckets", "128,256", "--max-queue-len", "8",
                              "--max-model-len", "512", "--capacity-rps", "3.5"])
    s = settings_from_args(args)
    assert s.capacity_rps == 3.5
    assert s.pools == ("fp16", "fp8") and s.shadow and s.max_queue_len == 8
    assert s.buckets.edges == (128, 256) and s.host == "127.0.0.1"
    assert s.max_model_len == 512 and s.cold_start and s.over_length is None
    assert controller_spec(args) == "ppo:p"
    with pytest.raises(SystemExit):
        parser.parse_args(["--upstream", "fp16=http://x:1", "--policy", "p", "--controller",
                           "static:4"])
    warm = parser.parse_args(["--upstream", "fp16=http://x:1", "--controller", "static:4",
                              "--no-cold-start", "--over-length", "reject"])
    assert not settings_from_args(warm).cold_start and warm.over_length == "reject"


def test_parse_request_and_usage() -> None:
    p = parse_request(b'{"prompt": "a b", "max_tokens": 5, "stream": true}', "completions")
    assert p.prompt.text == "a b" and p.max_tokens == 5 and p.stream and not p.wants_usage
    forwarded = json.loads(p.forward_body(None))
    assert forwarded["stream_options"] == {"include_usage": True}
    assert json.loads(p.forward_body(7))["truncate_prompt_tokens"] == 7
    batch = parse_request(b'{"prompt": ["a b", [1, 2, 3, 4]], "n": 2}', "completions")
    assert [q.size_chars for q in batch.prompts] == [3, 0] and batch.prompts[1].token_ids == 4
    assert batch.sequences == 4
    plain = parse_request(b'{"prompt": [1, 2, 3]}', "completions")
    assert plain.prompt.token_ids == 3 and plain.forward_body(None) == b'{"prompt": [1, 2, 3]}'
    assert plain.max_output_tokens(3, 100) == 16  # vLLM's completions default
    # loose types vLLM's pydantic models coerce are read the same way
    loose = parse_request(b'{"prompt": "a", "max_tokens": "5", "stream": "yes"}', "completions")
    assert loose.max_tokens == 5 and loose.stream is True
    chat = parse_request(b'{"messages": [{"role": "user", "content": "hi"}]}', "chat")
    assert chat.prompt.messages == ("hi",) and chat.max_output_tokens(10, 100) == 90
    for raw, kind, needle in [
            (b"{bad", "completions", "not valid JSON"), (b"[1]", "completions", "JSON object"),
            (b"", "completions", "empty body"), (b"{}", "completions", "'prompt' is required"),
            (b'{"prompt": ["a", {"b": 1}]}', "completions", "list of strings"),
            (b'{"prompt": []}', "completions", "empty list"),
            (b'{"prompt": "a", "max_tokens": "five"}', "completions", "'body.max_tokens'"),
            (b'{"prompt": "a", "max_tokens": 0}', "completions", ">= 1"),
            (b'{"prompt": "a", "stream": "maybe"}', "completions", "'body.stream'"),
            (b'{"messages": []}', "chat", "non-empty list"),
            (b'{"messages": [{"content": "x"}]}', "chat", "string 'role'"),
            (b"{}", "chat", "'messages' is required")]:
        with pytest.raises(BadRequest, match=needle):
            parse_request(raw, kind)  # type: ignore[arg-type]
    body = (b'{"choices":[{"text":"say \\"completion_tokens\\": 99"}],'
            b'"usage":{"completion_tokens":7}}')
    assert completion_tokens(body) == 7
    stream = (b'data: {"choices":[{"text":"a"}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":4}}\n\n'
              b"data: [DONE]\n\n")
    kept, tokens = take_usage(stream, strip=True)
    assert tokens == 4 and b"usage" not in kept and kept.endswith(b"data: [DONE]\n\n")
    assert take_usage(stream, strip=False) == (stream, 4)


def test_approx_counter() -> None:
    c = ApproxCounter(4.0)
    assert c.count_now(Prompt(text="x" * 40)) == 10
    assert c.count_now(Prompt(token_ids=17)) == 17
    assert c.count_now(Prompt(messages=("x" * 8, ""))) == (2 + 4) + (0 + 4)


@pytest.mark.parametrize("choice", [("--policy", "default"), ("--controller", "ppo:default"),
                                    ("--policy", "seeds/seed1"),
                                    ("--policy", "policies/default/policy.json")])
def test_start_accepts_what_the_controller_factory_accepts(
        choice: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Shipped names resolve from any folder (no "default" here), and the factory also reads
    # an artifact's policy.json: the start check must not refuse either before the factory
    # resolves it.
    if choice[1].startswith("policies/"):
        choice = (choice[0], str(REPO / choice[1]))
    else:
        monkeypatch.chdir(tmp_path)
    served: list[object] = []
    monkeypatch.setattr(serve_command, "run_loop", lambda main, loop: served.append(main))
    # the shipped policies read the TPOT fit of the deployment's GPU and model profiles
    status = serve_command.main(["--upstream", "fp16=http://127.0.0.1:9", *choice,
                                 "--gpu", "a100-80g", "--model", "llama-2-7b"])
    assert status == 0 and len(served) == 1


def test_a_policy_that_reads_the_tpot_fit_refuses_to_start_without_profiles(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(serve_command, "run_loop", lambda main, loop: None)
    status = serve_command.main(["--upstream", "fp16=http://127.0.0.1:9", "--policy",
                                 "default", "--capacity-rps", "10"])
    assert status == 2
    assert "give profile names or files for --gpu and --model" in capsys.readouterr().err


def test_corrupt_or_missing_policy_refuses_to_start(tmp_path: Path) -> None:
    missing = subprocess.run(
        [sys.executable, str(REPO / "serve.py"), "--upstream", "fp16=http://127.0.0.1:9",
         "--policy", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "policy artifact not found" in missing.stderr
    art = fixed_policy(tmp_path / "pol", [4, 4, 4, 4], ["fp16"] * 4, pool_names=("fp16",))
    (art / "policy.safetensors").write_bytes(b"garbage")
    corrupt = subprocess.run(
        [sys.executable, str(REPO / "serve.py"), "--upstream", "fp16=http://127.0.0.1:9",
         "--policy", str(art), "--buckets", "128,256,512"],
        capture_output=True, text=True, timeout=60)
    assert corrupt.returncode == 2 and "checksum mismatch" in corrupt.stderr
    # A policy trained for other buckets or pools does not fit: refused before serving.
    good = fixed_policy(tmp_path / "pol2", [4, 4, 4, 4], ["fp16"] * 4)
    with pytest.raises(ArtifactError, match="pools"):
        create_app(make_settings(("fp16", "http://127.0.0.1:9")), ppo_factory(str(good), {}))
    with pytest.raises(ArtifactError, match="bucket edges"):
        create_app(make_settings(("fp16", "http://127.0.0.1:9"), ("fp8", "http://127.0.0.1:8"),
                                 buckets=Buckets()), ppo_factory(str(good), {}))
    # A policy that reads load relative to capacity needs the capacity: refused without it.
    relative = fixed_policy(tmp_path / "pol3", [4, 4, 4, 4], ["fp16"] * 4,
                            pool_names=("fp16",), obs_version=3)
    with pytest.raises(ValueError, match="capacity"):
        create_app(make_settings(("fp16", "http://127.0.0.1:9")), ppo_factory(str(relative), {}))
    create_app(make_settings(("fp16", "http://127.0.0.1:9"), capacity_rps=5.0),
               ppo_factory(str(relative), {}))


# --------------------------------------------------------------------------- faults
def test_bad_requests_get_400_with_a_reason() -> None:
    async def scenario() -> None:
        # Validation happens before anything else: no upstream is needed (none is reachable).
        settings = make_settings(("fp16", f"http://127.0.0.1:{free_port()}"))
        async with running_sidecar(settings, ready=False) as (url, sidecar), \
                aiohttp.ClientSession() as s:
            for body, path, needle in [
                    (b"{not json", "/v1/completions", "not valid JSON"),
                    ({"model": "m"}, "/v1/completions", "'prompt' is required"),
                    ({"prompt": "x", "max_tokens": -1}, "/v1/completions", "max_tokens"),
                    ({"messages": "hi"}, "/v1/chat/completions", "non-empty list")]:
                status, data, _ = await post(s, url, body, path)
                assert status == 400, data
                error = json.loads(data)["error"]
                assert needle in error["message"] and error["code"] == 400
            assert sample(sidecar, "rlbatch_bad_requests_total") == 4
            # A valid request while no upstream answers: 503 with the reason.
            status, data, headers = await post(s, url, {"prompt": "x"})
            assert status == 503 and "not ready" in json.loads(data)["error"]["message"]
            assert headers.get("Retry-After") == "1"
            async with s.get(url + "/ready") as r:
                assert r.status == 503 and "waiting for upstreams" in (await r.json())["reason"]

    asyncio.run(scenario())


def test_upstream_errors_retry_other_replica_else_503() -> None:
    async def scenario() -> None:
        async with fakes(Faults("error500"), Faults("none")) as (bad, good):
            settings = make_settings(("fp16", bad.url), ("fp16", good.url))
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                for stream in (False, True, False, True):
                    status, data, _ = await post(s, url, {"prompt": "x y", "stream": stream})
                    assert status == 200, data
                assert sample(sidecar, "rlbatch_upstream_retries_total", pool="fp16") >= 1
                good.faults.completion = "error500"  # both replicas fail now
                status, data, headers = await post(s, url, {"prompt": "x y"})
                message = json.loads(data)["error"]["message"]
                assert status == 503 and message.startswith("upstream fp16#")
                assert "answered 500" in message
                assert headers.get("Retry-After") is not None
                # A connection dropped after the request was sent: not sent again (the
                # upstream may have received it), 502.
                bad.faults.completion = good.faults.completion = "drop"
                before = bad.counters.requests + good.counters.requests
                status, data, _ = await post(s, url, {"prompt": "x y"})
                assert status == 502 and "not retried" in json.loads(data)["error"]["message"]
                assert bad.counters.requests + good.counters.requests == before + 1
                assert sidecar.tickets == {}  # nothing left behind
                assert all(u.running_total == 0 for u in sidecar.upstreams)

    asyncio.run(scenario())


def test_upstream_dying_mid_stream_ends_stream_with_error_event() -> None:
    async def scenario() -> None:
        async with fakes(Faults("drop_midstream", tokens=5)) as (up,), \
                running_sidecar(make_settings(("fp16", up.url))) as (url, sidecar), \
                aiohttp.ClientSession() as s:
            status, data, _ = await post(s, url, {"prompt": "x", "stream": True})
            assert status == 200
            assert b'data: {"error"' in data and b"mid-stream" in data
            assert data.endswith(b"data: [DONE]\n\n")
            assert sample(sidecar, "rlbatch_requests_total", bucket="0-128",
                          outcome="upstream_error") == 1
            assert sidecar.tickets == {}

    asyncio.run(scenario())


def test_scrape_failure_applies_guard_fallback_caps(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url))
            async with running_sidecar(settings, "playbook") as (_, sidecar):
                await until(lambda: sidecar.control.ticks >= 2)
                # playbook: every bucket is short here
                assert sidecar.control.in_force.caps == (32, 32, 32, 32)
                up.faults.metrics_status = 500
                await until(lambda: sidecar.control.fallback_active)
                assert sidecar.control.in_force.caps == (4, 4, 4, 4)  # Guard.fallback_action()
                assert sample(sidecar, "rlbatch_fallback_ticks_total") >= 1
                up.faults.metrics_status = 200
                await until(lambda: not sidecar.control.fallback_active)
                assert sidecar.control.in_force.caps == (32, 32, 32, 32)

    with caplog.at_level(logging.INFO, logger="rlbatch.sidecar"):
        asyncio.run(scenario())
    assert "fallback caps" in caplog.text and "back in charge" in caplog.text


def test_queue_full_answers_429_queue_ttl_503_and_cancel_frees_slot() -> None:
    async def scenario() -> None:
        async with fakes(Faults("hang")) as (up,):
            settings = make_settings(("fp16", up.url), max_queue_len=2, queue_timeout_s=1.0)
            async with running_sidecar(settings, "static:1") as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                # One runs (hangs upstream), two wait (queue bound 2), the fourth is refused.
                first = asyncio.create_task(post(s, url, {"prompt": "x"}))
                await asyncio.sleep(0.2)
                waiting = [asyncio.create_task(post(s, url, {"prompt": "x"})) for _ in range(2)]
                await asyncio.sleep(0.1)
                # the two wait at the upstream, held by the engine-wide cap: a tick sees them
                await until(lambda: sample(sidecar, "rlbatch_oldest_unserved_seconds") > 0)
                status, data, headers = await post(s, url, {"prompt": "x"})
                assert status == 429 and "is full" in json.loads(data)["error"]["message"]
                assert headers.get("Retry-After") == "1"
                for task in waiting:  # the queue TTL (--queue-timeout-s) expires them
                    status, data, headers = await task
                    assert status == 503 and "without being admitted" in data.decode()
                    assert headers.get("Retry-After") == "1"
                assert sample(sidecar, "rlbatch_requests_total", bucket="0-128",
                              outcome="expired_queue_ttl") == 2
                assert up.counters.requests == 1 and up.counters.running == 1
                first.cancel()  # the client goes away: its upstream request is cancelled
                with contextlib.suppress(asyncio.CancelledError):
                    await first
                await until(lambda: up.counters.cancelled == 1 and not sidecar.tickets)
                assert up.counters.running == 0
                assert sidecar.tickets == {}
                assert all(u.running_total == 0 for u in sidecar.upstreams)
                # Admission counted everything; the control loop's ticks took its counters
                # into the snapshot, and /metrics names them from the snapshot table.
                loop = sidecar.control.loop
                assert loop is not None
                # (static:N caps no bucket: the waiting requests were in the upstream's
                # engine-wide FIFO, so the queue bound counted those, and nothing was queued
                # in admission to cancel.)
                await until(lambda: loop.arrived_total == 4 and loop.rejected_total == 1)
                assert loop.cancelled_total == 0
                assert sample(sidecar, "rlbatch_arrivals_total", bucket="0-128") == 4
                assert sample(sidecar, "rlbatch_rejections_total", bucket="0-128") == 1
                assert sample(sidecar, "rlbatch_queue_length", bucket="0-128") == 0

    asyncio.run(scenario())


def test_admin_switch_and_state() -> None:
    async def scenario() -> None:
        settings = make_settings(("fp16", "http://127.0.0.1:9"), admin_token="a" * 16)
        async with fakes(Faults()) as (up,), \
                running_sidecar(replace(settings, upstreams=(UpstreamSpec("fp16", up.url),)),
                                "static:2") as (url, sidecar), \
                aiohttp.ClientSession(headers={"Authorization": "Bearer " + "a" * 16}) as s:
            assert up.url in json.dumps(sidecar.state())
            async with s.post(url + "/admin/controller", json={"controller": "static:6"}) as r:
                assert r.status == 200 and (await r.json())["controller"] == "static:6"
            assert sidecar.control.in_force == ControlAction((None,) * 4, ("fp16",) * 4, 6)
            assert all(u.max_num_seqs == 6 for u in sidecar.upstreams)
            async with s.post(url + "/admin/controller", json={"controller": "nope"}) as r:
                assert r.status == 400 and "unknown controller" in await r.text()
            async with s.post(url + "/admin/controller",
                              json={"controller": "ppo:/no/such/policy"}) as r:
                assert r.status == 400 and "allowed policy folders" in await r.text()
            assert sidecar.control.controller.name == "static:6"  # a failed switch changes nothing

    asyncio.run(scenario())


def test_fixed_policy_is_deterministic(tmp_path: Path) -> None:
    from rlbatch.control.types import SLA, DeploymentInfo

    path = fixed_policy(tmp_path / "p", [2, 4, 1, 8], ["fp16", "fp16", "fp8", "fp8"])
    ctl = ppo_factory(str(path), {})
    assert isinstance(ctl, PpoController)
    info = DeploymentInfo(BUCKETS, {"fp16": 1, "fp8": 1}, "x", "y", 32, 1024,
                          {"fp16": 10, "fp8": 10}, 16, 1024, 1.0, SLA())
    action = ctl.reset(info)
    assert action.caps == (2, 4, 1, 8) and action.pools == ("fp16", "fp16", "fp8", "fp8")
    assert ctl.discipline.kv_budget == KvBudget(1.0, "peak")  # the guard's KV budget
