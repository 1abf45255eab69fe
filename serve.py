"""Run a trained policy as an admission-control sidecar in front of vLLM (not built yet)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="serve.py",
        description="Admission-control sidecar in front of `vllm serve` servers. NOT AVAILABLE "
                    "YET: it arrives with the sidecar issue.")
    parser.parse_args(argv)
    parser.print_help()
    print("\nserve.py: the sidecar is not implemented yet.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
