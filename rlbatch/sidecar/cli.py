"""Command line of the sidecar (``serve.py``): options -> :class:`SidecarSettings`, and the
event loop that runs the app."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from rlbatch.buckets import DEFAULT_EDGES, Buckets
from rlbatch.control.types import SLA
from rlbatch.sidecar.settings import TOKENIZER_MODES, SidecarSettings, UpstreamSpec

ADMIN_TOKEN_ENV = "RLBATCH_ADMIN_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sidecar's options.

    :param parser: the parser to extend.
    """
    d = SidecarSettings(upstreams=(UpstreamSpec("fp16", "http://127.0.0.1:8000"),))
    up = parser.add_argument_group("upstreams")
    up.add_argument("--upstream", action="append", default=[], metavar="POOL=URL",
                    help="a vLLM OpenAI server and its pool (fp16 | fp8); repeat for more "
                         "replicas and pools, e.g. --upstream fp16=http://127.0.0.1:8000 "
                         "--upstream fp8=http://127.0.0.1:8001")
    up.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                    help="the upstreams' --max-num-seqs (vLLM does not export it)")
    up.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                    help="the upstreams' --max-num-batched-tokens")
    up.add_argument("--gpu", default=d.gpu, help="GPU profile name told to the controller")
    up.add_argument("--model", default=d.model, help="model profile name told to the "
                    "controller")
    up.add_argument("--scrape-timeout-s", type=float, default=d.scrape_timeout_s)
    up.add_argument("--connect-timeout-s", type=float, default=d.connect_timeout_s)
    up.add_argument("--request-timeout-s", type=float, default=None,
                    help="limit of one upstream request (default: none)")

    ctl = parser.add_argument_group("control")
    which = ctl.add_mutually_exclusive_group(required=True)
    which.add_argument("--policy", type=Path, metavar="PATH",
                       help="a trained policy artifact (folder with policy.json + "
                            "policy.safetensors): the controller ppo:PATH")
    which.add_argument("--controller", metavar="SPEC",
                       help="a named controller: playbook, static:N, aimd, ppo:PATH, ...")
    ctl.add_argument("--shadow", action="store_true",
                     help="decide and log every tick, never act (no caps, one pool)")
    ctl.add_argument("--shadow-pool", default=None,
                     help="the pool every request goes to in shadow mode (default: the first)")
    ctl.add_argument("--tick-s", type=float, default=d.tick_s, help="control interval")
    ctl.add_argument("--window-s", type=float, default=d.window_s,
                     help="sliding window of the latency percentiles")
    ctl.add_argument("--bucket-edges", default=",".join(str(e) for e in DEFAULT_EDGES),
                     help="prompt-length bucket edges in tokens")
    ctl.add_argument("--sla-ttft-s", type=float, default=SLA().ttft_s)
    ctl.add_argument("--sla-tpot-s", type=float, default=SLA().tpot_s)
    ctl.add_argument("--no-cold-start", dest="cold_start", action="store_false",
                     help="the upstreams are warm: skip the guard's warm-up ramp")
    ctl.add_argument("--logdir", type=Path, default=None,
                     help="write the decisions to TensorBoard here")

    adm = parser.add_argument_group("admission")
    adm.add_argument("--max-queue-len", type=int, default=d.max_queue_len,
                     help="per-bucket queue bound (a full queue answers 429)")
    adm.add_argument("--queue-timeout-s", type=float, default=d.queue_timeout_s,
                     help="longest wait in a queue before 429")
    adm.add_argument("--retry-after-s", type=int, default=d.retry_after_s,
                     help="Retry-After of 429 / 503 answers")
    adm.add_argument("--tokenizer", default=d.tokenizer,
                     help=f"prompt token counting: {' | '.join(TOKENIZER_MODES)} | a "
                          f"tokenizer.json or model folder")
    adm.add_argument("--max-seq-len", type=int, default=None,
                     help="longest prompt + output (default: the upstreams' max_model_len)")
    adm.add_argument("--over-length", choices=("truncate", "reject"), default=None,
                     help="over-long requests (default: the controller guard's choice)")

    srv = parser.add_argument_group("server")
    srv.add_argument("--host", default=d.host,
                     help="address to bind (default loopback; 0.0.0.0 in a pod)")
    srv.add_argument("--port", type=int, default=d.port)
    srv.add_argument("--admin-token", default=None,
                     help=f"bearer token of /admin/* (better: set ${ADMIN_TOKEN_ENV}, which "
                          f"ps does not show); without one, /admin/* answers only on a "
                          f"loopback bind")
    srv.add_argument("--no-gpu-telemetry", dest="gpu_telemetry", action="store_false",
                     help="do not read GPU memory with NVML")
    srv.add_argument("--access-log", action="store_true", help="log every request")
    srv.add_argument("--log-level", default="INFO")
    srv.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                     help="event loop (auto: uvloop when installed)")


def settings_from_args(args: argparse.Namespace) -> SidecarSettings:
    """Validated settings from parsed options.

    :param args: from a parser built with :func:`add_arguments`.
    :raises ValueError: a bad value (the message names it).
    """
    return SidecarSettings(
        upstreams=tuple(UpstreamSpec.parse(u) for u in args.upstream),
        host=args.host, port=args.port, buckets=Buckets.parse(args.bucket_edges),
        tick_s=args.tick_s, window_s=args.window_s,
        sla=SLA(ttft_s=args.sla_ttft_s, tpot_s=args.sla_tpot_s),
        max_queue_len=args.max_queue_len, queue_timeout_s=args.queue_timeout_s,
        retry_after_s=args.retry_after_s, tokenizer=args.tokenizer,
        max_seq_len=args.max_seq_len, over_length=args.over_length, shadow=args.shadow,
        shadow_pool=args.shadow_pool, logdir=args.logdir, cold_start=args.cold_start,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu=args.gpu, model=args.model, scrape_timeout_s=args.scrape_timeout_s,
        connect_timeout_s=args.connect_timeout_s, request_timeout_s=args.request_timeout_s,
        admin_token=args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None,
        gpu_telemetry=args.gpu_telemetry)


def controller_spec(args: argparse.Namespace) -> str:
    """The controller name the options ask for (``--policy PATH`` means ``ppo:PATH``).

    :param args: parsed options.
    """
    return f"ppo:{args.policy}" if args.policy is not None else str(args.controller)


def run_loop(main: Callable[[], Coroutine[Any, Any, None]], loop: str = "auto") -> None:
    """Run ``main()`` on uvloop when asked for (or installed, with ``auto``), else asyncio.

    :param main: the coroutine function.
    :param loop: ``auto``, ``asyncio`` or ``uvloop``.
    """
    factory = None
    if loop in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise ValueError("--loop uvloop: uvloop is not installed") from None
        else:
            factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
