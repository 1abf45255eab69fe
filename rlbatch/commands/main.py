"""The dispatcher: ``rlbatch COMMAND`` / ``python -m rlbatch COMMAND``.

The contract (DESIGN.md) other tools rely on:

* ``evaluate --trace FILE... --controllers static:16,playbook --gpu a100-80g --model llama-2-7b
  --rate-scale 1,2 --json OUT``: one JSON row per (controller, trace, rate_scale);
* ``simulate --trace FILE --controller static:16 --json OUT``: one run, same row fields;
* ``profile-check --gpu a100-80g FILE.csv... --json OUT``: step-time model vs measured timings;
* ``profile-fit``, ``calibrate``, ``fidelity``, ``sweep``: see each command's ``--help``;
* ``serve`` and ``train``: the same commands as ``serve.py`` and ``train.py``, arguments
  handed on untouched. ``train`` lives in :mod:`policies.training.command`, a layer above
  this package: it is found through the ``rlbatch.commands`` entry-point group (as plugin
  controllers are), so the core never imports ``policies``.

Each command is one module of :mod:`rlbatch.commands` with ``register(subparsers)``; the
options they share come from :mod:`rlbatch.commands.options`. A command's module is imported
only when that command runs (the list and its one-line help come from
:mod:`rlbatch.commands.catalog`), so ``rlbatch --help`` imports none of them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

from rlbatch import __version__
from rlbatch.commands.catalog import HELP, OWN_PARSER

ENTRY_POINT_GROUP = "rlbatch.commands"
"""Entry points ``NAME = module:main`` of the commands above this package (``train``)."""


def _register(name: str, sub: Any) -> None:
    """Import the command ``name`` and add its full parser (imports spelled out, so that the
    layer contracts see them)."""
    if name == "evaluate":
        from rlbatch.commands import evaluate
        evaluate.register(sub)
    elif name == "simulate":
        from rlbatch.commands import simulate
        simulate.register(sub)
    elif name == "profile-check":
        from rlbatch.commands import profile_check
        profile_check.register(sub)
    elif name == "profile-fit":
        from rlbatch.commands import profile_fit
        profile_fit.register(sub)
    elif name == "calibrate":
        from rlbatch.commands import calibrate
        calibrate.register(sub)
    elif name == "fidelity":
        from rlbatch.commands import fidelity
        fidelity.register(sub)
    elif name == "sweep":
        from rlbatch.commands import sweep
        sweep.register(sub)
    else:
        raise KeyError(name)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``rlbatch`` parser.

    :param command: register only this command in full (the others as their one-line
        entries, enough for the command list and its errors); ``None``: every command.
    """
    parser = argparse.ArgumentParser(
        prog="rlbatch",
        description="rlbatch: batch-size control for LLM serving on vLLM. Simulate and "
                    "evaluate controllers on real traces, sweep, calibrate and check the "
                    "simulator against a live engine.")
    parser.add_argument("--version", action="version", version=f"rlbatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in HELP.items():
        if (command is None or name == command) and name not in OWN_PARSER:
            _register(name, sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; bad input is a one-line error and exit status 2.

    :param argv: arguments (default ``sys.argv[1:]``).
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    # The command is the first word that is not an option (the top level has -h and
    # --version only).
    named = next((a for a in args_list if not a.startswith("-")), "")
    if named in OWN_PARSER and args_list[0] == named:
        return _run_own_parser(named, args_list[1:])
    parser = build_parser(named if named in HELP else "")
    args = parser.parse_args(args_list)
    try:
        rc: int = args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"rlbatch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return rc


def _run_own_parser(name: str, argv: list[str]) -> int:
    """Run a command that parses its own arguments, as its script would (its usage, errors
    and exit status)."""
    if name == "serve":
        from rlbatch.commands import serve
        return serve.main(argv, prog="rlbatch serve")
    from importlib import metadata  # ~25 ms: not on the path of `rlbatch --help`

    found = metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)
    if not found:
        print(f"rlbatch {name}: not installed: no {ENTRY_POINT_GROUP!r} entry point {name!r} "
              f"(install rlbatch with pip, e.g. pip install -e .)", file=sys.stderr)
        return 2
    try:
        command = cast(Callable[[list[str]], int], next(iter(found)).load())
    except ModuleNotFoundError as exc:
        # training needs the rl extra (SB3, gymnasium, torch), which serving does not
        print(f"rlbatch {name}: needs the rl extra: pip install 'rlbatch[rl]' (and torch) "
              f"({exc})", file=sys.stderr)
        return 2
    return command(argv)
