"""The ``serve`` command: the admission-control sidecar's options, settings and event loop.

    python serve.py --upstream fp16=http://127.0.0.1:8000 [--upstream fp8=URL] \\
        (--policy PATH | --controller playbook|static:N) [--shadow] [--logdir DIR]

Clients talk to the sidecar's /v1/completions and /v1/chat/completions; it buckets each
request by prompt length, queues it per bucket, forwards it to the pool its bucket is routed
to while the bucket is under its cap, and every control tick reads the upstreams' /metrics,
asks the controller (policy + guard) and sets the caps. See docs/sidecar.md.

Options shared with the other commands (``--gpu``, ``--model``, ``--buckets``, ``--sla-*``)
come from :mod:`rlbatch.commands.options`, spelled the same everywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from prometheus_client import disable_created_metrics

from rlbatch.commands.options import (
    CONTROLLER_HELP,
    add_buckets_option,
    add_gpu_model_options,
    add_over_length_option,
    add_settings_option,
    add_sla_options,
    sla_from_args,
)
from rlbatch.control.controllers import make_controller
from rlbatch.control.specs import with_overrides
from rlbatch.settings import add_flags, from_flags
from rlbatch.sidecar.app import create_app, serve
from rlbatch.sidecar.options import (
    add_production_options,
    check_start_policy,
    production_settings,
)
from rlbatch.sidecar.settings import SidecarSettings, UpstreamSpec

ADMIN_TOKEN_ENV = "RLBATCH_ADMIN_TOKEN"

# SidecarSettings fields whose flags derive from them (type, default, docstring)
UPSTREAM_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "capacity_rps",
                  "scrape_timeout_s", "connect_timeout_s", "request_timeout_s")
CONTROL_FLAGS = ("shadow", "shadow_pool", "tick_s", "window_s", "cold_start")
ADMISSION_FLAGS = ("max_queue_len", "kv_reserve", "kv_reserve_quantile", "queue_timeout_s",
                   "reject_ttft_slack", "max_num_queued_tokens", "drain_window_s",
                   "max_retry_after_s", "retry_overload",
                   "retry_after_s", "tokenizer", "max_model_len")
SERVER_FLAGS = ("host", "port", "gpu_telemetry")


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where its help already tells it (the shared
    options do)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action)


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
    add_flags(up, SidecarSettings, only=UPSTREAM_FLAGS, defaults=d)
    add_gpu_model_options(up, gpu=d.gpu, model=d.model)

    ctl = parser.add_argument_group("control")
    which = ctl.add_mutually_exclusive_group(required=True)
    which.add_argument("--policy", type=Path, metavar="PATH",
                       help="a trained policy artifact (folder with policy.json + "
                            "policy.safetensors): the controller ppo:PATH")
    which.add_argument("--controller", metavar="SPEC",
                       help=f"the controller: {CONTROLLER_HELP}")
    add_settings_option(ctl)
    add_flags(ctl, SidecarSettings, only=CONTROL_FLAGS, defaults=d)
    add_buckets_option(ctl)
    add_sla_options(ctl)
    ctl.add_argument("--logdir", type=Path, default=None,
                     help="write the decisions to TensorBoard here")

    adm = parser.add_argument_group("admission")
    add_flags(adm, SidecarSettings, only=ADMISSION_FLAGS, defaults=d)
    add_over_length_option(adm, default=None,
                           default_text="default: vLLM's own rule (the output is shortened "
                                        "to fit; a prompt alone too long is refused)")

    srv = parser.add_argument_group("server")
    add_flags(srv, SidecarSettings, only=SERVER_FLAGS, defaults=d)
    srv.add_argument("--admin-token", default=None,
                     help=f"bearer token of /admin/* (better: set ${ADMIN_TOKEN_ENV}, which "
                          f"ps does not show; at least 16 characters); without one, /admin/* "
                          f"is off (403)")
    srv.add_argument("--access-log", action="store_true", help="log every request")
    srv.add_argument("--log-level", default="INFO")
    srv.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                     help="event loop (auto: uvloop when installed)")
    add_production_options(parser)


def settings_from_args(args: argparse.Namespace) -> SidecarSettings:
    """Validated settings from parsed options.

    :param args: from a parser built with :func:`add_arguments`.
    :raises ValueError: a bad value (the message names it).
    """
    return from_flags(
        SidecarSettings, args,
        only=(*UPSTREAM_FLAGS, *CONTROL_FLAGS, *ADMISSION_FLAGS, *SERVER_FLAGS),
        upstreams=tuple(UpstreamSpec.parse(u) for u in args.upstream),
        buckets=args.buckets, sla=sla_from_args(args), over_length=args.over_length,
        logdir=args.logdir, gpu=args.gpu, model=args.model,
        admin_token=args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None,
        **production_settings(args))


def controller_spec(args: argparse.Namespace) -> str:
    """The controller spec the options ask for (``--policy PATH`` means ``ppo:PATH``), with
    the ``--set`` settings.

    :param args: parsed options.
    :raises ValueError: a ``--set`` that is not KEY=VALUE or is given twice.
    """
    spec = f"ppo:{args.policy}" if args.policy is not None else str(args.controller)
    return with_overrides(spec, args.settings)


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


def main(argv: list[str] | None = None, prog: str = "serve.py") -> int:
    """Parse the options, build the controller and the app, serve until SIGINT/SIGTERM.

    :param argv: the arguments (default: ``sys.argv[1:]``).
    :param prog: the program name in usage and error messages.
    :returns: the exit status (2: the controller cannot start, 1: cannot bind).
    """
    parser = argparse.ArgumentParser(
        prog=prog, description="Admission-control sidecar in front of vLLM OpenAI servers "
        "(docs/sidecar.md).",
        formatter_class=_DefaultsHelp)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        spec = controller_spec(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        check_start_policy(spec, settings)
        controller = make_controller(spec)
        app = create_app(settings, controller, controller_factory=make_controller)
    except (ValueError, OSError) as exc:
        print(f"{prog}: cannot start with controller {spec!r}: {exc}", file=sys.stderr)
        return 2
    try:
        run_loop(lambda: serve(app, settings, access_log=args.access_log), args.loop)
    except OSError as exc:
        print(f"{prog}: cannot serve on {settings.host}:{settings.port}: {exc}",
              file=sys.stderr)
        return 1
    return 0
