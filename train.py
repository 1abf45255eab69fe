"""Train a PPO batch-size policy on the embedded simulator (not built yet).

Until the training issue lands this script only explains itself; the main job meanwhile is
``python -m rlbatch evaluate`` (see README.md).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Train a PPO batch-size policy on the rlbatch simulator. NOT AVAILABLE YET: "
                    "training arrives with the PPO issue; use `python -m rlbatch evaluate` "
                    "to compare the baseline controllers meanwhile.")
    parser.parse_args(argv)
    parser.print_help()
    print("\ntrain.py: training is not implemented yet.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
