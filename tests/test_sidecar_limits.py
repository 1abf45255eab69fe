"""Issue 13: every request bounded in memory and time (no vLLM needed); the options and the
Kubernetes example that set the bounds. The closed control plane and the smaller holes are in
``tests/test_sidecar_protocol.py``.

Each test reproduces one hole of the issue (it fails on the sidecar as it was) and checks
the limit's answer exactly: the status, the OpenAI-style error and the
``rlbatch:limit_trips_total{limit}`` sample that counts it. Faults a real vLLM cannot produce
on demand (a ``/tokenize`` or completion that never answers, a stream that stalls, a 200
that is not JSON) come from :class:`~tests.fake_upstream.FakeUpstream`; the rest needs only
raw sockets. Figures (RSS per held byte, descriptors under slowloris) are measured by
``benchmarks/sidecar_limits.py``, not asserted on time here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from rlbatch.sidecar.options import add_production_options, production_settings
from tests.fake_upstream import Faults
from tests.test_sidecar import (
    REPO,
    fakes,
    make_settings,
    post,
    running_sidecar,
    sample,
    until,
)

TOKEN = "t" * 24
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def trips(sidecar: object, limit: str) -> float:
    return sample(sidecar, "rlbatch:limit_trips_total", limit=limit)  # type: ignore[arg-type]


def error_of(data: bytes) -> dict[str, object]:
    error = json.loads(data)["error"]
    assert isinstance(error, dict)
    return error


async def raw_connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def closed_by_server(reader: asyncio.StreamReader, within_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (fails if it does not
    close it within ``within_s``: a bound on the assertion, not a measured time)."""
    data = b""
    async with asyncio.timeout(within_s):
        while chunk := await reader.read(65536):
            data += chunk
    return data


# ------------------------------------------------------------------ 1. memory per request
def test_body_cap_is_an_option_and_answers_json_413() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url), max_body_bytes=4096,
                                     max_held_bytes=8192)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                status, data, _ = await post(s, url, {"prompt": "x" * 5000})
                assert status == 413
                error = error_of(data)
                assert error["code"] == 413 and "4096" in str(error["message"])
                assert trips(sidecar, "body_size") == 1
                assert up.counters.requests == 0

    asyncio.run(scenario())


def test_held_bytes_budget_refuses_before_queueing() -> None:
    async def scenario() -> None:
        async with fakes(Faults("hang")) as (up,):
            body_len = 40_000
            settings = make_settings(("fp16", up.url), max_body_bytes=50_000,
                                     max_held_bytes=100_000, approx_bytes_per_token=100.0,
                                     queue_timeout_s=30.0)
            async with running_sidecar(settings, "static:1") as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                words = " ".join(["w"] * (body_len // 2))
                first = asyncio.create_task(post(s, url, {"prompt": words, "max_tokens": 1}))
                await until(lambda: up.counters.running == 1)
                second = asyncio.create_task(post(s, url, {"prompt": words, "max_tokens": 1}))
                await until(lambda: sample(sidecar, "rlbatch:held_body_bytes") > 2 * body_len)
                status, data, headers = await post(s, url, {"prompt": words, "max_tokens": 1})
                assert status == 429 and headers.get("Retry-After") == "1"
                assert "held" in str(error_of(data)["message"])
                assert trips(sidecar, "held_bytes") == 1
                for task in (first, second):
                    task.cancel()
                await asyncio.gather(first, second, return_exceptions=True)
                await until(lambda: sample(sidecar, "rlbatch:held_body_bytes") == 0)

    asyncio.run(scenario())


def test_prompt_certainly_over_length_is_refused_without_tokenising() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            # /v1/models says max_model_len 4096; 4096 * 4 chars is the most 4096 tokens of a
            # vocabulary whose longest token has 4 characters can span (vLLM's own check).
            settings = make_settings(("fp16", up.url), tokenizer="upstream",
                                     max_chars_per_token=4)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                status, data, _ = await post(s, url, {"prompt": "x" * (4096 * 4 + 1)})
                assert status == 400, data
                error = error_of(data)
                assert "maximum context length is 4096 tokens" in str(error["message"])
                assert up.counters.tokenize_calls == 0 and up.counters.requests == 0
                assert sample(sidecar, "rlbatch:rejections_total", bucket="512+") >= 0

    asyncio.run(scenario())


# ------------------------------------------------------------------ 2. client read timeouts
def test_slow_header_slow_body_and_idle_keepalive_connections_are_closed() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url), header_timeout_s=0.3,
                                     body_timeout_s=0.3, keepalive_timeout_s=0.3)
            async with running_sidecar(settings) as (url, sidecar):
                # Slow header: a request line and one header, then nothing.
                reader, writer = await raw_connect(url)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                await writer.drain()
                assert await closed_by_server(reader) == b""
                writer.close()
                # Slow body: the head promises 100 bytes, 10 come.
                reader, writer = await raw_connect(url)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
                await writer.drain()
                answer = await closed_by_server(reader)
                assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
                assert b'"code": 408' in answer
                writer.close()
                # Keep-alive: a served connection that stays idle is closed.
                reader, writer = await raw_connect(url)
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                await writer.drain()
                answer = await closed_by_server(reader)
                assert answer.startswith(b"HTTP/1.1 200")
                writer.close()
                assert trips(sidecar, "header_timeout") == 1
                assert trips(sidecar, "body_timeout") == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # serve.py runs on uvloop
def test_connection_limit_closes_idle_connections_first(loop: str) -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url), max_connections=8,
                                     header_timeout_s=60.0, keepalive_timeout_s=60.0)
            async with running_sidecar(settings) as (url, sidecar):
                idle = [await raw_connect(url) for _ in range(20)]
                await until(lambda: trips(sidecar, "connections") >= 12)
                # A client arriving now evicts an idle connection and is served.
                async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
                    assert r.status == 200
                assert sample(sidecar, "rlbatch:connections_open") <= 8
                closed = 0
                for reader, writer in idle:
                    try:
                        async with asyncio.timeout(0.5):
                            closed += await reader.read(1) == b""
                    except TimeoutError:
                        pass
                    writer.close()
                assert closed >= 13  # 12 evicted for the idle ones, 1 for the /health client

    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(scenario())
    else:
        asyncio.run(scenario())


# ------------------------------------------------------------------ 3. bounded tokenize
def test_hanging_tokenize_falls_back_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with fakes(Faults(tokenize="hang")) as (up,):
            settings = make_settings(("fp16", up.url), tokenizer="upstream",
                                     tokenize_timeout_s=0.3)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
                for _ in range(2):
                    status, data, _ = await post(s, url, {"prompt": "a b c", "max_tokens": 2})
                    assert status == 200, data
                assert up.counters.tokenize_calls == 2
                assert trips(sidecar, "tokenize_timeout") == 2
                assert sample(sidecar, "rlbatch:requests_counting") == 0

    with caplog.at_level(logging.WARNING, logger="rlbatch.sidecar"):
        asyncio.run(scenario())
    assert caplog.text.count("/tokenize") == 1  # logged once per failure run


# ------------------------------------------------------------------ 4. upstream timeouts
def test_upstream_first_byte_and_idle_timeouts_not_a_total() -> None:
    async def scenario() -> None:
        async with fakes(Faults("hang")) as (up,):
            settings = make_settings(("fp16", up.url), first_byte_timeout_s=0.3,
                                     idle_timeout_s=0.5)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
                status, data, _ = await post(s, url, {"prompt": "x"})
                assert status == 504, data
                message = str(error_of(data)["message"])
                assert "no answer within 0.3 s" in message and up.url in message
                assert trips(sidecar, "upstream_first_byte") == 1
                assert up.counters.requests == 1  # a timed-out request is not sent twice
                # A healthy stream longer than every limit, chunks 0.05 s apart: complete.
                up.faults = Faults(tokens=20, chunk_interval_s=0.05)
                status, data, _ = await post(s, url, {"prompt": "x", "stream": True})
                assert status == 200 and data.count(b'"text":"t') == 20
                assert data.endswith(b"data: [DONE]\n\n") and b"error" not in data
                # A stream that stalls after two chunks ends with an error event.
                up.faults = Faults("stall_midstream", tokens=5)
                status, data, _ = await post(s, url, {"prompt": "x", "stream": True})
                assert status == 200 and b"no data for 0.5 s" in data
                assert data.endswith(b"data: [DONE]\n\n")
                assert trips(sidecar, "upstream_idle") == 1
                assert sidecar.tickets == {}

    asyncio.run(scenario())


def test_total_request_timeout_is_opt_in_and_says_why() -> None:
    async def scenario() -> None:
        async with fakes(Faults("hang")) as (up,):
            settings = make_settings(("fp16", up.url), request_timeout_s=0.4)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
                status, data, _ = await post(s, url, {"prompt": "x"})
                assert status == 504, data
                message = str(error_of(data)["message"])
                assert message.endswith("did not finish within 0.4 s (--request-timeout-s)")
                assert trips(sidecar, "upstream_total") == 1
                up.faults = Faults(tokens=40, chunk_interval_s=0.05)  # a 2 s stream: cut
                status, data, _ = await post(s, url, {"prompt": "x", "stream": True})
                assert status == 200 and b"--request-timeout-s" in data
                assert data.endswith(b"data: [DONE]\n\n")
                assert trips(sidecar, "upstream_total") == 2

    asyncio.run(scenario())


# ------------------------------------------------------------------ options
def test_cli_limits_and_dev_zero_policy(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_production_options(parser)
    args = parser.parse_args(["--max-body-bytes", "1024", "--max-held-bytes", "4096",
                              "--header-timeout-s", "2", "--policy-dir", str(tmp_path),
                              "--max-connections", "100", "--idle-timeout-s", "7"])
    fields = production_settings(args)
    settings = make_settings(("fp16", "http://127.0.0.1:9"), **fields)
    assert (settings.max_body_bytes, settings.max_held_bytes, settings.max_connections) == (
        1024, 4096, 100)
    assert settings.header_timeout_s == 2.0 and settings.idle_timeout_s == 7.0
    assert settings.policy_dirs == (tmp_path.resolve(),)
    assert settings.first_byte_timeout_s == 600.0 and settings.keepalive_timeout_s == 5.0
    with pytest.raises(ValueError, match="max_held_bytes"):
        make_settings(("fp16", "http://127.0.0.1:9"), max_body_bytes=10, max_held_bytes=5)
    with pytest.raises(ValueError, match="16 characters"):
        make_settings(("fp16", "http://127.0.0.1:9"), admin_token="short")
    # serve.py --policy /dev/zero: refused before anything reads it (it read until
    # MemoryError; the address-space limit makes that quick instead of eating the machine).
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    done = subprocess.run(
        [sys.executable, str(REPO / "serve.py"), "--upstream", "fp16=http://127.0.0.1:9",
         "--policy", "/dev/zero"], capture_output=True, text=True, timeout=60,
        preexec_fn=limit_memory)
    assert done.returncode == 2 and "not a folder" in done.stderr, done.stderr[-500:]


def test_kubernetes_manifest_args_are_valid_sidecar_settings() -> None:
    import argparse

    import yaml

    from rlbatch.commands.serve import add_arguments, settings_from_args

    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "rlbatch-sidecar.yaml")
                                   .read_text()))
    pod = docs[0]["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "rlbatch-sidecar")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(container["args"])
    args.admin_token = "s" * 32  # from the Secret in the pod
    settings = settings_from_args(args)
    assert settings.metrics_port == 9090 and settings.policy_dirs == (Path("/policies"),)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.port, "metrics": settings.metrics_port}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics"
    assert container["resources"]["limits"]["memory"] == "512Mi"
    service = docs[1]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
