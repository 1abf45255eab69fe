"""The candidates the ``mpc`` planner rolls out (:mod:`policies.mpc`), and which of them it
may choose: keys on the :class:`~rlbatch.control.action_codec.TotalShareCodec`'s ladders,
the per-bucket trims and route splits tried around the best, and the fairness filter."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from rlbatch.control.types import ANY_POOL

Key = tuple[int, tuple[int, ...], tuple[int, ...]]
"""A candidate as (total index, per-bucket share indices, per-bucket route indices) on the
codec's ladders and routes."""


def untrimmed(key: Key, top: int) -> Key:
    """The same total and routes with every share at the top of the ladder (what a static
    cap at that total does)."""
    total, shares, routes = key
    return (total, (top,) * len(shares), routes)


def fair_keys(candidates: Collection[Key], missed: Mapping[Key, Sequence[float]],
              decided: Mapping[Key, Sequence[float]], top: int, slack: float,
              min_requests: float) -> set[Key]:
    """The candidates that starve no bucket: every candidate without trims, and each one with
    trims whose rollouts miss, in every bucket, at most ``max(min_requests, slack x decided)``
    more requests than its :func:`untrimmed` reference (which must be in ``missed``).

    :param candidates: candidate keys.
    :param missed: per key, per bucket, requests missed in its rollouts.
    :param decided: per key, per bucket, requests met + missed.
    :param top: the share index that means no per-bucket cap.
    :param slack: extra misses allowed, as a fraction of the reference's decided requests.
    :param min_requests: extra misses always allowed.
    """
    keep: set[Key] = set()
    for key in candidates:
        ref = untrimmed(key, top)
        if ref != key and any(
                lost > ref_lost + max(min_requests, slack * ref_done)
                for lost, ref_lost, ref_done in zip(missed[key], missed[ref], decided[ref],
                                                    strict=True)):
            continue
        keep.add(key)
    return keep


def trims(num_buckets: int, top: int) -> list[tuple[int, ...]]:
    """Share-index vectors that hold longer-prompt buckets to smaller shares of the total:
    mild (each bucket after the second one share step below the previous), strong (from the
    second bucket on), and long-only (the last bucket at the smallest share)."""
    mild = tuple(max(0, top - max(0, b - 1)) for b in range(num_buckets))
    strong = tuple(max(0, top - b) for b in range(num_buckets))
    last = tuple(top if b < num_buckets - 1 else 0 for b in range(num_buckets))
    out: list[tuple[int, ...]] = []
    for t in (mild, strong, last):
        if t not in out and any(s != top for s in t):
            out.append(t)
    return out


def splits(routes: Sequence[str], num_buckets: int) -> list[tuple[int, ...]]:
    """Route-index vectors that serve short and long prompts on different pools: for every
    boundary, the buckets below it on one pool and the rest on the other (both ways round),
    so long prefills stop inflating the short requests' TPOT. ``routes`` are the codec's
    (pools, then ``any``)."""
    pools = [i for i, r in enumerate(routes) if r != ANY_POOL]
    out: list[tuple[int, ...]] = []
    for a in pools:
        for b in pools:
            if a == b:
                continue
            for k in range(1, num_buckets):
                out.append(tuple(a if i < k else b for i in range(num_buckets)))
    return out
