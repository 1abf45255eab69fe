"""``rlbatch calibrate``: fit the simulator's step-time model to a live vLLM engine.

``python -m rlbatch calibrate --engine vllm --model tiny --pools fp16,fp8 --out PROFILE.json``
runs the profiling sweep of :func:`rlbatch.tools.calibrate.calibrate` on a live engine per
pool, writes the profile (:mod:`rlbatch.profiles.calibrated`) and prints the fit.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rlbatch.commands.catalog import HELP
from rlbatch.commands.options import add_live_engine_options, live_engine_config_from_args
from rlbatch.profiles.calibrated import save_profile
from rlbatch.tools.calibrate import (
    DEFAULT_BATCHES,
    DEFAULT_OUTPUT_LENS,
    DEFAULT_PROMPT_LENS,
    calibrate,
)

__all__ = ["add_arguments", "positive_ints", "register", "run"]


def register(sub: Any) -> None:
    """Add the ``calibrate`` sub-command.

    :param sub: the dispatcher's subparsers.
    """
    ca = sub.add_parser("calibrate", help=HELP["calibrate"],
                        description="Profiling sweep on a live vLLM engine (batch x prompt x "
                                    "output lengths), fit of the simulator's step-time model, "
                                    "written as a profile file (--profile FILE).")
    add_arguments(ca)
    ca.set_defaults(func=run)


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated positive integers.

    :param text: e.g. ``1,2,4``.
    """
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """calibrate's options: the live engine group, the sweep, the output.

    :param parser: the sub-command's parser.
    """
    add_live_engine_options(parser)
    s = parser.add_argument_group("sweep")
    s.add_argument("--batches", type=positive_ints, default=list(DEFAULT_BATCHES),
                   help="batch sizes (default 1,2,4,8,16,32)")
    s.add_argument("--prompt-lens", type=positive_ints, default=list(DEFAULT_PROMPT_LENS),
                   help="prompt lengths (default 16,128,512,1024)")
    s.add_argument("--output-lens", type=positive_ints, default=list(DEFAULT_OUTPUT_LENS),
                   help="output lengths (default 16,96)")
    s.add_argument("--traffic-s", type=float, default=8.0,
                   help="seconds of Poisson calibration traffic after the sweep (default 8; "
                        "0 = none)")
    s.add_argument("--stagger-ms", type=float, default=None,
                   help="arrival gap of the staggered runs in ms (default ~2.5 decode steps; "
                        "0 = bursts only)")
    parser.add_argument("--name", default=None, help="profile name")
    parser.add_argument("--out", required=True, help="write the profile JSON here")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Sweep, fit, write the profile, print the fit.

    :param args: parsed options of :func:`add_arguments`.
    """
    config = live_engine_config_from_args(args)
    stagger = None if args.stagger_ms is None else args.stagger_ms / 1000.0
    profile = calibrate(config, pools=list(args.pools), batches=args.batches,
                        prompt_lens=args.prompt_lens, output_lens=args.output_lens,
                        stagger_s=stagger, traffic_s=args.traffic_s, name=args.name,
                        log=_stderr)
    path = save_profile(profile, args.out)
    for pool, p in profile.pools.items():
        c = p.coefficients
        e = p.fit.errors
        print(f"{pool}: fixed {c.fixed_s * 1e3:.3f} ms, prefill +{c.prefill_fixed_s * 1e3:.3f} "
              f"ms, {c.per_token_s * 1e6:.2f} us/token, {c.per_seq_s * 1e6:.2f} us/seq, "
              f"{c.per_attn_work_s * 1e9:.3f} ns/attn pair, {c.per_kv_token_s * 1e9:.2f} "
              f"ns/KV token + {c.per_kv_token_seq_s * 1e12:.2f} ps/KV token/seq; overheads: "
              f"{c.per_new_seq_s * 1e3:.3f} ms/new request, {c.per_finished_s * 1e3:.3f} "
              f"ms/finished request, wake {c.wake_s * 1e3:.3f} ms (decay {p.wake.decay:g}/"
              f"iteration, idle scale {p.wake.tau_s * 1e3:g} ms), new iteration size "
              f"{c.new_shape_s * 1e3:.3f} ms + {c.new_shape_per_token_s * 1e6:.2f} us/token "
              f"(primitive cache {p.shape_cache or 'unbounded'} sizes); "
              f"fit over "
              f"{p.fit.rows} iterations ({p.fit.dropped} stalls dropped): median "
              f"{e.median:.1%}, p90 {e.p90:.1%}, p99 {e.p99:.1%}, total "
              f"{p.fit.total_rel_err:.1%} ({p.num_kv_blocks} KV blocks)")
    print(f"wrote {path}")
    return 0
