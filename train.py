"""Entry point of the training command: train a policy on the embedded simulator, then compare
it with the baselines on traffic it never saw.

    python train.py                       # the recipe: mpc teacher -> student -> DAgger
    python train.py --help

Options and behaviour: :mod:`policies.training.command`.
"""

from __future__ import annotations

from policies.training.command import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
