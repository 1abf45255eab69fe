"""MultiDiscrete action <-> ControlAction, shared by the env, PPO serving and the sidecar.

Two action kinds: ``per_bucket`` (a cap per bucket on a ladder, the first policies') and
``total_share`` (an engine-wide total cap plus per-bucket shares of it). A bucket's route
index points into :func:`~rlbatch.control.types.route_choices` of the pools: each pool,
plus ``any`` (least loaded across pools) when there are several.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from rlbatch.control.types import ControlAction, route_choices


class ActionCodec:
    """``per_bucket``: per bucket ``[cap index on the ladder, pool index]``, buckets in order.

    :param ladder: the cap ladder.
    :param pools: pool names in index order.
    :param num_buckets: number of buckets.
    """

    kind = "per_bucket"

    def __init__(self, ladder: Sequence[int], pools: Sequence[str], num_buckets: int) -> None:
        if not ladder or not pools or num_buckets < 1:
            raise ValueError(f"need a ladder, pools and buckets; got {ladder}, {pools}, "
                             f"{num_buckets}")
        self.ladder = tuple(int(c) for c in ladder)
        self.pools = tuple(pools)
        self.routes = route_choices(self.pools)
        self.num_buckets = num_buckets

    @property
    def nvec(self) -> list[int]:
        return [len(self.ladder), len(self.routes)] * self.num_buckets

    def decode(self, action: np.ndarray | Sequence[int]) -> ControlAction:
        """Raise ValueError (naming the offending value) on anything that is not a valid
        action."""
        n_b = self.num_buckets
        arr = _as_int_vector(action, 2 * n_b)
        caps: list[int] = []
        pools: list[str] = []
        for b in range(n_b):
            ci, pi = int(arr[2 * b]), int(arr[2 * b + 1])
            if not 0 <= ci < len(self.ladder):
                raise ValueError(f"bucket {b}: cap index {ci} outside [0, {len(self.ladder)})")
            if not 0 <= pi < len(self.routes):
                raise ValueError(f"bucket {b}: pool index {pi} outside [0, {len(self.routes)})")
            caps.append(self.ladder[ci])
            pools.append(self.routes[pi])
        return ControlAction(tuple(caps), tuple(pools))

    def encode(self, action: ControlAction) -> np.ndarray:
        """Nearest action (cap rounded down the ladder; unknown pool -> index 0)."""
        out: list[int] = []
        for cap, pool in zip(action.caps, action.pools, strict=True):
            c = self.ladder[-1] if cap is None else cap
            idx = max((i for i, v in enumerate(self.ladder) if v <= c), default=0)
            out.extend([idx, self.routes.index(pool) if pool in self.routes else 0])
        return np.array(out, dtype=np.int64)


TOTAL_LADDER: tuple[int, ...] = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Total caps (engine-wide ``max_num_seqs``) the ``total_share`` action chooses from: the
static caps a user would configure, 4 to 256."""
SHARE_LADDER: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0)
"""Per-bucket shares of the total: a bucket's cap is ``ceil(share * total)``; share 1 puts no
per-bucket limit under the total."""
ACTION_KINDS: tuple[str, ...] = ("per_bucket", "total_share")


class TotalShareCodec:
    """``[total index] + per bucket [share index, pool index]``.

    The total is the engine-wide cap (vLLM ``--max-num-seqs``, what ``static:N`` sets, so the
    policy can express every static cap); each bucket's share of it caps that bucket (long
    prompts can be held to a fraction of the batch while short ones fill it).

    :param totals: the total-cap ladder.
    :param shares: the share ladder (fractions in (0, 1], increasing, ending at 1).
    :param pools: pool names in index order.
    :param num_buckets: number of buckets.
    """

    kind = "total_share"

    def __init__(self, totals: Sequence[int], shares: Sequence[float], pools: Sequence[str],
                 num_buckets: int) -> None:
        if not totals or not shares or not pools or num_buckets < 1:
            raise ValueError(f"need totals, shares, pools and buckets; got {totals}, {shares}, "
                             f"{pools}, {num_buckets}")
        if list(totals) != sorted(set(totals)) or totals[0] < 1:
            raise ValueError(f"totals must be strictly increasing positive ints, got {totals}")
        if (list(shares) != sorted(set(shares)) or not shares[0] > 0
                or float(shares[-1]) != 1.0):
            raise ValueError(f"shares must increase within (0, 1] and end at 1, got {shares}")
        self.totals = tuple(int(t) for t in totals)
        self.shares = tuple(float(s) for s in shares)
        self.pools = tuple(pools)
        self.routes = route_choices(self.pools)
        self.num_buckets = num_buckets

    @property
    def nvec(self) -> list[int]:
        return [len(self.totals)] + [len(self.shares), len(self.routes)] * self.num_buckets

    def bucket_cap(self, total: int, share: float) -> int | None:
        """A bucket's cap under ``total`` at ``share`` (``None``: only the total limits it)."""
        return None if share >= 1.0 else max(1, math.ceil(share * total))

    def decode(self, action: np.ndarray | Sequence[int]) -> ControlAction:
        """Raise ValueError (naming the offending value) on anything that is not a valid
        action."""
        arr = _as_int_vector(action, 1 + 2 * self.num_buckets)
        ti = int(arr[0])
        if not 0 <= ti < len(self.totals):
            raise ValueError(f"total index {ti} outside [0, {len(self.totals)})")
        total = self.totals[ti]
        caps: list[int | None] = []
        pools: list[str] = []
        for b in range(self.num_buckets):
            si, pi = int(arr[1 + 2 * b]), int(arr[2 + 2 * b])
            if not 0 <= si < len(self.shares):
                raise ValueError(f"bucket {b}: share index {si} outside [0, "
                                 f"{len(self.shares)})")
            if not 0 <= pi < len(self.routes):
                raise ValueError(f"bucket {b}: pool index {pi} outside [0, {len(self.routes)})")
            caps.append(self.bucket_cap(total, self.shares[si]))
            pools.append(self.routes[pi])
        return ControlAction(tuple(caps), tuple(pools), total)

    def encode(self, action: ControlAction) -> np.ndarray:
        """Nearest action: the total rounded down the ladder (no total: the sum of the bucket
        caps, or the top), each bucket's cap as the smallest share that allows it."""
        if action.max_num_seqs is not None:
            total_req = action.max_num_seqs
        elif all(c is not None for c in action.caps):
            total_req = sum(int(c) for c in action.caps if c is not None)
        else:
            total_req = self.totals[-1]
        ti = max((i for i, v in enumerate(self.totals) if v <= total_req), default=0)
        total = self.totals[ti]
        out = [ti]
        for cap, pool in zip(action.caps, action.pools, strict=True):
            if cap is None or cap >= total:
                si = len(self.shares) - 1
            else:
                si = next(i for i, s in enumerate(self.shares)
                          if (self.bucket_cap(total, s) or total) >= cap)
            out.extend([si, self.routes.index(pool) if pool in self.routes else 0])
        return np.array(out, dtype=np.int64)


Codec = ActionCodec | TotalShareCodec


def make_codec(kind: str, *, ladder: Sequence[int], pools: Sequence[str], num_buckets: int,
               totals: Sequence[int] = TOTAL_LADDER,
               shares: Sequence[float] = SHARE_LADDER) -> Codec:
    """The codec of an action kind (``per_bucket``: a cap per bucket on ``ladder``;
    ``total_share``: a total cap plus per-bucket shares)."""
    if kind == "per_bucket":
        return ActionCodec(ladder, pools, num_buckets)
    if kind == "total_share":
        return TotalShareCodec(totals, shares, pools, num_buckets)
    raise ValueError(f"unknown action kind {kind!r}; kinds: {', '.join(ACTION_KINDS)}")


def _as_int_vector(action: np.ndarray | Sequence[int], size: int) -> np.ndarray:
    arr = np.asarray(action)
    if arr.shape != (size,):
        raise ValueError(f"action must have shape ({size},), got {arr.shape}: {action}")
    if not np.issubdtype(arr.dtype, np.integer):
        if (not np.issubdtype(arr.dtype, np.number) or not np.all(np.isfinite(arr))
                or not np.all(arr == np.round(arr))):
            raise ValueError(f"action must hold integers, got {action}")
        arr = arr.astype(np.int64)
    return arr
