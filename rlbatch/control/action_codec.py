"""MultiDiscrete action <-> ControlAction, shared by the env, PPO serving and the sidecar."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlbatch.control.types import ControlAction


class ActionCodec:
    """Per bucket ``[cap index on the ladder, pool index]``, buckets in order.

    :param ladder: the cap ladder.
    :param pools: pool names in index order.
    :param num_buckets: number of buckets.
    """

    def __init__(self, ladder: Sequence[int], pools: Sequence[str], num_buckets: int) -> None:
        if not ladder or not pools or num_buckets < 1:
            raise ValueError(f"need a ladder, pools and buckets; got {ladder}, {pools}, "
                             f"{num_buckets}")
        self.ladder = tuple(int(c) for c in ladder)
        self.pools = tuple(pools)
        self.num_buckets = num_buckets

    @property
    def nvec(self) -> list[int]:
        return [len(self.ladder), len(self.pools)] * self.num_buckets

    def decode(self, action: np.ndarray | Sequence[int]) -> ControlAction:
        """Raise ValueError (naming the offending value) on anything that is not a valid
        action."""
        arr = np.asarray(action)
        n_b = self.num_buckets
        if arr.shape != (2 * n_b,):
            raise ValueError(f"action must have shape ({2 * n_b},), got {arr.shape}: {action}")
        if not np.issubdtype(arr.dtype, np.integer):
            if (not np.issubdtype(arr.dtype, np.number) or not np.all(np.isfinite(arr))
                    or not np.all(arr == np.round(arr))):
                raise ValueError(f"action must hold integers, got {action}")
            arr = arr.astype(np.int64)
        caps: list[int] = []
        pools: list[str] = []
        for b in range(n_b):
            ci, pi = int(arr[2 * b]), int(arr[2 * b + 1])
            if not 0 <= ci < len(self.ladder):
                raise ValueError(f"bucket {b}: cap index {ci} outside [0, {len(self.ladder)})")
            if not 0 <= pi < len(self.pools):
                raise ValueError(f"bucket {b}: pool index {pi} outside [0, {len(self.pools)})")
            caps.append(self.ladder[ci])
            pools.append(self.pools[pi])
        return ControlAction(tuple(caps), tuple(pools))

    def encode(self, action: ControlAction) -> np.ndarray:
        """Nearest action (cap rounded down the ladder; unknown pool -> index 0)."""
        out: list[int] = []
        for cap, pool in zip(action.caps, action.pools, strict=True):
            c = self.ladder[-1] if cap is None else cap
            idx = max((i for i, v in enumerate(self.ladder) if v <= c), default=0)
            out.extend([idx, self.pools.index(pool) if pool in self.pools else 0])
        return np.array(out, dtype=np.int64)
