"""The dispatcher: ``rlbatch COMMAND`` / ``python -m rlbatch COMMAND``.

The contract (DESIGN.md) other tools rely on:

* ``evaluate --trace FILE... --controllers static:16,playbook --gpu a100-80g --model llama-2-7b
  --rate-scale 1,2 --json OUT``: one JSON row per (controller, trace, rate_scale);
* ``simulate --trace FILE --controller static:16 --json OUT``: one run, same row fields;
* ``profile-check --gpu a100-80g FILE.csv... --json OUT``: step-time model vs measured timings;
* ``profile-fit``, ``calibrate``, ``fidelity``, ``sweep``: see each command's ``--help``.

Each command is one module of :mod:`rlbatch.commands` with ``register(subparsers)``; the
options they share come from :mod:`rlbatch.commands.options`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rlbatch.commands import (
    calibrate,
    evaluate,
    fidelity,
    profile_check,
    profile_fit,
    simulate,
    sweep,
)

COMMANDS = (evaluate, simulate, profile_check, profile_fit, calibrate, fidelity, sweep)


def build_parser() -> argparse.ArgumentParser:
    """The ``rlbatch`` parser with every command."""
    parser = argparse.ArgumentParser(
        prog="rlbatch",
        description="rlbatch: batch-size control for LLM serving on vLLM. Simulate and "
                    "evaluate controllers on real traces, sweep, calibrate and check the "
                    "simulator against a live engine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; bad input is a one-line error and exit status 2.

    :param argv: arguments (default ``sys.argv[1:]``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc: int = args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"rlbatch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return rc
