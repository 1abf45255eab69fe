"""Admission-control sidecar in front of vLLM OpenAI servers.

    python serve.py --upstream fp16=http://127.0.0.1:8000 [--upstream fp8=URL] \\
        (--policy PATH | --controller playbook|static:N) [--shadow] [--logdir DIR]

Clients talk to the sidecar's /v1/completions and /v1/chat/completions; it buckets each
request by prompt length, queues it per bucket, forwards it to the pool its bucket is routed
to while the bucket is under its cap, and every control tick reads the upstreams' /metrics,
asks the controller (policy + guard) and sets the caps. See docs/sidecar.md.
"""

from __future__ import annotations

import argparse
import logging
import sys

from prometheus_client import disable_created_metrics

from rlbatch.control.controllers import make_controller
from rlbatch.sidecar import create_app, serve
from rlbatch.sidecar.cli import add_arguments, controller_spec, run_loop, settings_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="serve.py", description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    spec = controller_spec(args)
    try:
        controller = make_controller(spec)
        app = create_app(settings, controller, controller_factory=make_controller)
    except (ValueError, OSError) as exc:
        print(f"serve.py: cannot start with controller {spec!r}: {exc}", file=sys.stderr)
        return 2
    try:
        run_loop(lambda: serve(app, settings, access_log=args.access_log), args.loop)
    except OSError as exc:
        print(f"serve.py: cannot serve on {settings.host}:{settings.port}: {exc}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
