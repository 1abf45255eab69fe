"""The evaluation protocol with every ``total_share`` student's per-bucket shares set to 1.

    .venv/bin/python experiments/total_only.py --controllers ppo:policies/two-pool \
        --pools fp16:1,fp8:1 --jobs 2

A diagnostic (issue 14, stop 17): each student keeps choosing its total cap (and routes), but
no bucket is held to a share of it, so the run shows what the student's trims add or cost.
Takes the arguments of ``python -m policies.evaluation.protocol``. Every ``TotalShareCodec``
decodes with the top share in this process and in the protocol's worker processes (forked
from it), so static rows are unchanged; students lose their trims (and ``mpc``, which decodes its
candidates with the same codec, its own). Training (``train.py
--shares 1``) gives a student without the share head instead.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlbatch.control.action_codec import TotalShareCodec
from rlbatch.control.types import ControlAction


def decode_without_trims(codec: TotalShareCodec,
                         action: np.ndarray | Sequence[int]) -> ControlAction:
    """``codec.decode`` of ``action`` with every share index set to the top (share 1)."""
    arr = np.array(action, dtype=np.int64)
    if arr.shape == (1 + 2 * codec.num_buckets,):
        arr[1::2] = len(codec.shares) - 1
    return _DECODE(codec, arr)


_DECODE = TotalShareCodec.decode


def main(argv: list[str] | None = None) -> int:
    from policies.evaluation.protocol import main as protocol_main

    TotalShareCodec.decode = decode_without_trims  # type: ignore[method-assign,assignment]
    try:
        return protocol_main(argv)
    finally:
        TotalShareCodec.decode = _DECODE  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main())
