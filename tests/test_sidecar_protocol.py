"""Issue 13: a closed control plane, the smaller holes an adversarial client and a flaky
upstream found, and the units of behaving like vLLM (no vLLM needed; the same answers from a
real vLLM are checked by ``tests/test_sidecar_compat.py``).

Each test reproduces one hole of the issue (it failed on the sidecar as it was) and checks the
answer exactly. Faults a real vLLM cannot produce on demand come from
:class:`~tests.fake_upstream.FakeUpstream`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import pytest

from rlbatch.sidecar.policy_files import PolicyPathError, check_policy_path, confined_policy
from rlbatch.sidecar.responses import UsageStripper
from rlbatch.sidecar.vllm_server import free_port
from tests.fake_upstream import Faults
from tests.test_sidecar import (
    fakes,
    fixed_policy,
    make_settings,
    post,
    running_sidecar,
    sample,
    until,
)
from tests.test_sidecar_limits import (
    AUTH,
    TOKEN,
    FakeReplica,
    closed_by_server,
    error_of,
    fake_replicas,
    raw_connect,
    trips,
)


# ------------------------------------------------------------------ 5. closed control plane
def test_admin_endpoints_closed_without_token_even_on_loopback() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            async with running_sidecar(make_settings(("fp16", up.url)), "static:2") as (
                    url, sidecar), aiohttp.ClientSession() as s:
                async with s.get(url + "/admin/state") as r:
                    assert r.status == 403 and "--admin-token" in await r.text()
                async with s.post(url + "/admin/controller",
                                  json={"controller": "static:1"}) as r:
                    assert r.status == 403
                assert sidecar.control.controller.name == "static:2"
            settings = make_settings(("fp16", up.url), admin_token=TOKEN)
            async with running_sidecar(settings, "static:2") as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                async with s.get(url + "/admin/state",
                                 headers={"Authorization": "Bearer wrong"}) as r:
                    assert r.status == 401
                async with s.get(url + "/admin/state", headers=AUTH) as r:
                    assert r.status == 200 and (await r.json())["controller"] == "static:2"

    asyncio.run(scenario())


def test_metrics_and_admin_on_their_own_port() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url), admin_token=TOKEN,
                                     metrics_port=free_port())
            control = f"http://127.0.0.1:{settings.metrics_port}"
            async with running_sidecar(settings) as (url, _), aiohttp.ClientSession() as s:
                for path in ("/metrics", "/admin/state"):
                    async with s.get(url + path, headers=AUTH) as r:
                        assert r.status == 404 and await r.json() == {"detail": "Not Found"}
                async with s.get(control + "/metrics") as r:
                    assert r.status == 200 and "rlbatch_limit_trips_total" in await r.text()
                async with s.get(control + "/admin/state", headers=AUTH) as r:
                    assert r.status == 200
                for base in (url, control):
                    async with s.get(base + "/ready") as r:
                        assert r.status == 200
                status, _, _ = await post(s, control, {"prompt": "x"})
                assert status == 404
                status, _, _ = await post(s, url, {"prompt": "x"})
                assert status == 200

    asyncio.run(scenario())


def test_policy_switch_confined_to_policy_dirs_no_file_oracle(tmp_path: Path) -> None:
    allowed = tmp_path / "policies"
    allowed.mkdir()
    good = fixed_policy(allowed / "good", [4, 4, 4, 4], ["fp16"] * 4, pool_names=("fp16",))
    big = fixed_policy(allowed / "big", [4, 4, 4, 4], ["fp16"] * 4, pool_names=("fp16",))
    with (big / "policy.json").open("a") as f:
        f.write(" " * 5000)
    (allowed / "escape").symlink_to(tmp_path)
    outside = fixed_policy(tmp_path / "outside", [4, 4, 4, 4], ["fp16"] * 4,
                           pool_names=("fp16",))

    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url), admin_token=TOKEN,
                                     policy_dirs=(allowed,), max_policy_bytes=4096)
            async with running_sidecar(settings, "static:2") as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                async def switch(spec: str) -> tuple[int, str]:
                    async with s.post(url + "/admin/controller", json={"controller": spec},
                                      headers=AUTH) as r:
                        return r.status, await r.text()

                answers = {spec: await switch(spec) for spec in (
                    "ppo:/etc/shadow", "ppo:/no/such/file", f"ppo:{allowed}/../outside",
                    f"ppo:{outside}", "ppo:/dev/zero", f"ppo:{allowed}/escape/outside")}
                # The same answer whether the file exists, is unreadable or is absent.
                assert {status for status, _ in answers.values()} == {400}
                messages = {json.loads(text)["error"]["message"].split(": ", 1)[1]
                            for _, text in answers.values()}
                assert len(messages) == 1 and "allowed policy folders" in messages.pop()
                status, text = await switch(f"ppo:{big}")
                assert status == 400 and "larger than 4096 bytes" in text
                assert sidecar.control.controller.name == "static:2"
                # brackets out of place, a settings file, a bad setting: 400, never a 500
                for bad in ("static:8[", "fixed:64]", f"{good}.toml", "fixed:64[order=lifo]"):
                    status, text = await switch(bad)
                    assert status == 400 and json.loads(text)["error"]["param"] == "controller"
                status, text = await switch(f"ppo:{good}[order=fifo]")
                assert status == 200, text
                assert sidecar.control.controller.name == f"ppo:{good.resolve()}[order=fifo]"
                assert sidecar.state()["controller_admission"]["order"] == "fifo"

    asyncio.run(scenario())


def test_policy_dir_checks_refuse_devices_and_size_before_reading(tmp_path: Path) -> None:
    with pytest.raises(PolicyPathError, match="not a folder"):
        check_policy_path(Path("/dev/zero"), 4096)
    art = fixed_policy(tmp_path / "p", [4, 4, 4, 4], ["fp16"] * 4, pool_names=("fp16",))
    check_policy_path(art, 1 << 20)
    with pytest.raises(PolicyPathError, match="larger than 16 bytes"):
        check_policy_path(art, 16)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "policy.json").symlink_to("/dev/zero")
    (tmp_path / "dev" / "policy.safetensors").symlink_to("/dev/zero")
    with pytest.raises(PolicyPathError, match="regular file"):
        check_policy_path(tmp_path / "dev", 4096)
    assert confined_policy(str(art), (tmp_path,)) == art.resolve()
    with pytest.raises(PolicyPathError, match="allowed policy folders"):
        confined_policy(str(art), ())


# ------------------------------------------------------------------ 6. the smaller ones
def test_dropped_upstream_connection_is_not_sent_twice() -> None:
    async def scenario() -> None:
        async with fakes(Faults("drop")) as (up,), \
                running_sidecar(make_settings(("fp16", up.url))) as (url, sidecar), \
                aiohttp.ClientSession() as s:
            status, data, _ = await post(s, url, {"prompt": "x"})
            assert status == 502, data
            assert "closed the connection" in str(error_of(data)["message"])
            assert up.counters.requests == 1
            assert sidecar.tickets == {}

    asyncio.run(scenario())


def test_hostile_bodies_answer_400_not_500() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url), max_sequences=8)
            async with running_sidecar(settings) as (url, sidecar), \
                    aiohttp.ClientSession() as s:
                deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
                status, data, headers = await post(s, url, deep)
                assert status == 400 and headers["Content-Type"].startswith("application/json")
                assert "nested too deeply" in str(error_of(data)["message"])
                assert trips(sidecar, "json_depth") == 1
                for body, param in [({"prompt": "x", "n": 9}, "n"),
                                    ({"prompt": "x", "n": 2, "best_of": 9}, "best_of"),
                                    ({"prompt": ["a"] * 5, "n": 2}, "n")]:
                    status, data, _ = await post(s, url, body)
                    assert status == 400, body
                    error = error_of(data)
                    assert error["param"] == param and "at most 8" in str(error["message"])
                assert up.counters.requests == 0 and trips(sidecar, "sequences") == 3

    asyncio.run(scenario())


def test_upstream_200_that_is_not_json_is_502_and_stream_error_is_separate() -> None:
    async def scenario() -> None:
        async with fakes(Faults("bad_json")) as (up,), \
                running_sidecar(make_settings(("fp16", up.url))) as (url, sidecar), \
                aiohttp.ClientSession() as s:
            status, data, _ = await post(s, url, {"prompt": "x"})
            assert status == 502 and "not valid JSON" in str(error_of(data)["message"])
            # a stream whose body is no event stream: an error before anything was sent,
            # not its bytes under a 200
            up.faults.completion = "garbage_stream"
            status, data, headers = await post(s, url, {"prompt": "x", "stream": True})
            assert status == 502 and headers["Content-Type"].startswith("application/json")
            message = str(error_of(data)["message"])
            assert "not an event stream" in message and "<html>" in message
            assert sample(sidecar, "rlbatch_requests_total", bucket="0-128",
                          outcome="upstream_error") == 2

    asyncio.run(scenario())


def test_truncate_policy_error_names_max_tokens() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url), over_length="truncate")
            async with running_sidecar(settings) as (url, _), aiohttp.ClientSession() as s:
                status, data, _ = await post(s, url, {"prompt": "x", "max_tokens": 4096})
                assert status == 400
                error = error_of(data)
                assert error["param"] == "max_tokens"
                assert "over-length policy: truncate" in str(error["message"])

    asyncio.run(scenario())


def test_oversized_header_is_one_warning_not_an_error_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,), \
                running_sidecar(make_settings(("fp16", up.url))) as (url, sidecar):
            reader, writer = await raw_connect(url)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000
                         + b"\r\n\r\n")
            await writer.drain()
            answer = await closed_by_server(reader)
            assert answer.split(b" ")[1].startswith(b"4"), answer[:60]
            writer.close()
            await until(lambda: trips(sidecar, "header_size") == 1)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not [r for r in caplog.records if r.exc_info]


# ------------------------------------------------------------------ 7-10. like vLLM
def test_over_length_default_shortens_output_like_vllm() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,), \
                running_sidecar(make_settings(("fp16", up.url))) as (url, sidecar), \
                aiohttp.ClientSession() as s:
            # approx counter: 24 bytes = 6 tokens; max_model_len 4096.
            for max_tokens in (4095, 4096):
                body = {"prompt": "x" * 24, "max_tokens": max_tokens}
                status, data, _ = await post(s, url, body)
                assert status == 200, data
                assert up.counters.bodies[-1] == body  # forwarded untouched
            assert sample(sidecar, "rlbatch_prompts_truncated_total", bucket="0-128") == 0
            # A prompt alone over max_model_len is refused as vLLM refuses it.
            status, data, _ = await post(s, url, {"prompt": "x" * 4 * 4097})
            assert status == 400
            error = error_of(data)
            assert error["message"] == (
                "This model's maximum context length is 4096 tokens. However, your prompt "
                "contains at least 4097 input tokens, which exceeds this limit even without "
                "any output tokens. Please reduce the length of the input prompt. "
                "(parameter=input_tokens, value=4097)")
            assert error["param"] == "input_tokens" and error["type"] == "BadRequestError"

    asyncio.run(scenario())


def test_prompt_lists_are_a_batch_like_vllm() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,), \
                running_sidecar(make_settings(("fp16", up.url))) as (url, _), \
                aiohttp.ClientSession() as s:
            for prompt in (["a", "b"], [[1, 2], [3, 4, 5]]):
                status, data, _ = await post(s, url, {"prompt": prompt, "max_tokens": 2})
                assert status == 200, data
                assert up.counters.bodies[-1]["prompt"] == prompt

    asyncio.run(scenario())


def test_continuous_usage_without_include_usage_is_not_turned_on() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,), \
                running_sidecar(make_settings(("fp16", up.url))) as (url, _), \
                aiohttp.ClientSession() as s:
            status, data, _ = await post(s, url, {
                "prompt": "x", "stream": True,
                "stream_options": {"continuous_usage_stats": True}})
            assert status == 200 and b'"usage"' not in data
            assert up.counters.bodies[-1]["stream_options"] == {"include_usage": True}

    asyncio.run(scenario())


def test_unknown_paths_json_404_and_tokenize_passes_through() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,), \
                running_sidecar(make_settings(("fp16", up.url))) as (url, _), \
                aiohttp.ClientSession() as s:
            async with s.get(url + "/no/such/path") as r:
                assert r.status == 404 and await r.json() == {"detail": "Not Found"}
            async with s.get(url + "/v1/completions") as r:  # a known path, wrong method
                assert r.status == 405 and await r.json() == {"detail": "Method Not Allowed"}
            status, data, _ = await post(s, url, {"prompt": "a b c"}, "/tokenize")
            assert status == 200 and json.loads(data)["count"] == 3
            status, data, _ = await post(s, url, {"tokens": [1]}, "/detokenize")
            assert status == 200 and up.counters.other == ["POST /detokenize"]
            async with s.get(url + "/version") as r:
                assert r.status == 200

    asyncio.run(scenario())


def test_usage_stripper_moves_fingerprint_to_terminal_chunks() -> None:
    stream = (b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
              b'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}]}\n\n')
    usage = (b'data: {"choices":[],"usage":{"completion_tokens":2},'
             b'"system_fingerprint":"fp-1"}\n\ndata: [DONE]\n\n')
    stripper = UsageStripper()
    first = stripper.feed(stream)
    assert first == stream.split(b"\n\n")[0] + b"\n\n"  # the terminal chunk waits
    assert stripper.feed(usage) == (
        b'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}],'
        b'"system_fingerprint":"fp-1"}\n\ndata: [DONE]\n\n')
    assert stripper.tokens == 2 and stripper.flush() == b""
    # No usage chunk comes (an upstream that does not send one): flushed unchanged.
    other = UsageStripper()
    assert other.feed(stream) + other.flush() == stream


def test_responses_api_is_admitted_counted_and_streamed_untouched() -> None:
    async def scenario() -> None:
        async with fakes(Faults(tokens=4)) as (up,), \
                running_sidecar(make_settings(("fp16", up.url))) as (url, sidecar), \
                aiohttp.ClientSession() as s:
            body = {"model": "fake", "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "x" * 40}]}], "instructions": "be brief",
                "max_output_tokens": 4}
            status, data, _ = await post(s, url, body, "/v1/responses")
            assert status == 200 and json.loads(data)["usage"]["output_tokens"] == 4
            assert up.counters.bodies[-1] == body  # forwarded untouched
            status, data, _ = await post(s, url, {**body, "stream": True}, "/v1/responses")
            assert status == 200 and data.count(b"event: response.output_text.delta") == 4
            assert data.endswith(b'"output_tokens":4,"total_tokens":9}}}\n\n')
            assert b"[DONE]" not in data and b"error" not in data
            await until(lambda: sample(sidecar, "rlbatch_requests_total", bucket="0-128",
                                       outcome="ok") == 2)
            status, data, _ = await post(s, url, {**body, "background": True}, "/v1/responses")
            assert status == 400 and error_of(data)["param"] == "background"
            up.faults.completion = "drop_midstream"
            status, data, _ = await post(s, url, {**body, "stream": True}, "/v1/responses")
            assert status == 200 and data.endswith(b"\n\n")
            last = data.split(b"\n\n")[-2]
            assert last.startswith(b"event: error\ndata: ") and b"mid-stream" in last

    asyncio.run(scenario())


# ------------------------------------------------------------------ degraded paths
def test_client_facing_errors_do_not_name_upstream_addresses() -> None:
    async def scenario() -> None:
        async with fakes(Faults("hang")) as (up,):
            port = up.url.rsplit(":", 1)[1]
            settings = make_settings(("fp16", up.url), first_byte_timeout_s=0.3,
                                     idle_timeout_s=0.3)
            bodies: list[tuple[int, str]] = []
            async with running_sidecar(settings, ready=False) as (url, sidecar), \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
                await until(lambda: sidecar.ready)
                for fault, stream in (("hang", False), ("hang", True), ("drop", False),
                                      ("error500", False), ("garbage_stream", True),
                                      ("stall_midstream", True)):
                    up.faults = Faults(fault, tokens=5)
                    status, data, _ = await post(s, url, {"prompt": "x", "stream": stream})
                    bodies.append((status, data.decode()))
                await up.stop()  # gone: connections refused
                status, data, _ = await post(s, url, {"prompt": "x"})
                bodies.append((status, data.decode()))
                await until(lambda: not sidecar.upstreams[0].healthy)
                for path in ("/v1/completions", "/tokenize"):
                    status, data, _ = await post(s, url, {"prompt": "x"}, path)
                    bodies.append((status, data.decode()))
                async with s.get(url + "/ready") as r:
                    bodies.append((r.status, await r.text()))
            assert [b[0] for b in bodies] == [504, 504, 502, 503, 502, 200, 503, 503, 503, 503]
            for _, text in bodies:
                assert "fp16#0" in text or "no reachable upstream" in text, text
                assert "127.0.0.1" not in text and f":{port}" not in text, text

    asyncio.run(scenario())


def test_failed_admin_logins_and_shutdown_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,):
            settings = make_settings(("fp16", up.url), admin_token=TOKEN)
            async with running_sidecar(settings) as (url, _), aiohttp.ClientSession() as s:
                async with s.post(url + "/admin/controller", json={"controller": "static:1"},
                                  headers={"Authorization": "Bearer guess"}) as r:
                    assert r.status == 401
                async with s.get(url + "/admin/state") as r:
                    assert r.status == 401

    with caplog.at_level(logging.INFO, logger="rlbatch.sidecar"):
        asyncio.run(scenario())
    refused = [r for r in caplog.records if "admin" in r.getMessage()
               and r.levelno == logging.WARNING]
    assert [r.getMessage().split(" from ")[0] for r in refused] == [
        "admin request POST /admin/controller refused: wrong bearer token",
        "admin request GET /admin/state refused: no bearer token"]
    assert all("127.0.0.1" in r.getMessage() and TOKEN not in r.getMessage()
               and "guess" not in r.getMessage() for r in refused)
    messages = [r.getMessage() for r in caplog.records]
    assert "sidecar stopping" in messages and "sidecar stopped" in messages


def test_boolean_flags_help_says_what_the_default_is() -> None:
    import argparse

    from rlbatch.commands.serve import _DefaultsHelp, add_arguments

    parser = argparse.ArgumentParser(formatter_class=_DefaultsHelp)
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for flag, default in (("gpu-telemetry", "on"), ("cold-start", "on"), ("shadow", "off")):
        start = text.index(f"--{flag}, --no-{flag}")
        entry = text[start:text.index(" --", start + len(flag) * 2 + 10)]
        assert "(default: True)" not in entry and "(default: False)" not in entry, entry
        assert f"(default: {default}" in entry, entry


def test_long_headers_accepted_and_a_head_over_the_bound_answered_json_431() -> None:
    async def scenario() -> None:
        async with fake_replicas(FakeReplica()) as (up,), \
                running_sidecar(make_settings(("fp16", up.url))) as (url, sidecar):
            async with aiohttp.ClientSession() as s, s.post(
                    url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                    headers={"Authorization": "Bearer " + "j" * 9000}) as r:
                assert r.status == 200
            secret = b"s3cr3t" * 12_000
            reader, writer = await raw_connect(url)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + secret
                         + b"\r\n\r\n")
            await writer.drain()
            answer = await closed_by_server(reader)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"Content-Type: application/json" in head
            error = error_of(body)
            assert error["code"] == 431 and "65536" in str(error["message"])
            assert b"s3cr3t" not in answer
            assert trips(sidecar, "header_size") == 1

    asyncio.run(scenario())


def test_loose_json_types_coerced_as_vllms_pydantic_models_do() -> None:
    from pydantic import TypeAdapter, ValidationError

    from rlbatch.sidecar.openai import BadRequest, lax_bool, lax_int

    values: list[object] = [
        None, True, False, 0, 1, 2, -3, 2**70, 4.0, 4.5, 1e19, -1e19, float("nan"),
        float("inf"), "16", " 16 ", "\t16\n", "16\xa0", "16.0", "16.00", "16.", ".0", "16.5",
        "+5", "-3", "0016", "1_000", "1_", "_1", "1__0", "1e1", "0x10", "١٢", "", "true",
        "True", "TRUE", "yes", "Yes", "on", "oN", "t", "y", "off", "no", "n", "f", "false",
        "1", "0", " true ", "false ", "1.0", [], {}, [1]]
    for value, optional in ((v, o) for v in values for o in (True, False)):
        for ours, tp in ((lax_int, int), (lax_bool, bool)):
            adapter = TypeAdapter(tp | None if optional else tp)
            try:
                expected: object = adapter.validate_python(value)
            except ValidationError as exc:
                expected = exc.errors()[0]["type"]
            try:
                got: object = ours(value, "field", optional=optional)
            except BadRequest as exc:
                got = exc.kind
            assert got == expected and type(got) is type(expected), (value, tp, optional)


def test_lone_surrogate_in_a_prompt_is_a_400_not_a_500() -> None:
    async def scenario() -> None:
        async with fakes(Faults()) as (up,), \
                running_sidecar(make_settings(("fp16", up.url))) as (url, _), \
                aiohttp.ClientSession() as s:
            for path, raw in (
                    ("/v1/completions", b'{"prompt": "ab\\ud800cd", "max_tokens": 2}'),
                    ("/v1/completions", b'{"prompt": ["ok", "\\uDFFF"], "max_tokens": 2}'),
                    ("/v1/chat/completions",
                     b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'),
                    ("/v1/responses", b'{"input": "\\ud800", "instructions": "x"}')):
                status, data, headers = await post(s, url, raw, path)
                assert status == 400 and headers["Content-Type"] == "application/json", data
                error = error_of(data)
                assert error["type"] == "BadRequestError" and error["param"] is None
                assert "surrogate" in str(error["message"])
            # a surrogate pair is a character: served
            status, data, _ = await post(s, url, b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')
            assert status == 200, data
            assert up.counters.requests == 1

    asyncio.run(scenario())
