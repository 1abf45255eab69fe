"""Length-mix randomisation: a trace slice's arrivals with another prompt-length mix.

A controller trained on one service's traffic sees one length mix: Azure conversation
traffic is 2% prompts of 4k tokens or more, Mooncake's is 60%. A student cloned from a planner
on Azure alone has never seen a state where long prompts dominate, so what it does there is
whatever its initialisation extrapolates to (measured: docs/notebook/BENCHMARKS-archive.md).
:func:`remix` keeps a slice's arrival process (its bursts and lulls) and gives each kept
arrival the lengths of a request drawn from the training traffic's own pool, bucket by bucket
at the given weights, so the mixes the student trains on cover the simplex of bucket shares
without reading any other trace.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import numpy as np

from rlbatch.request import Request
from rlbatch.workload.base import Workload, build_workload


def length_pools(requests: Iterable[Request], edges: Sequence[int]
                 ) -> list[list[tuple[int, int]]]:
    """``(prompt_tokens, max_output_tokens)`` of every request, per bucket."""
    pools: list[list[tuple[int, int]]] = [[] for _ in range(len(edges) + 1)]
    for r in requests:
        pools[bisect.bisect_right(edges, r.prompt_tokens)].append(
            (r.prompt_tokens, r.max_output_tokens))
    return pools


def remix(workload: Workload, pools: Sequence[Sequence[tuple[int, int]]],
          weights: Sequence[float], rng: np.random.Generator, *,
          keep_tokens: bool = True, token_scale: float = 1.0) -> Workload:
    """``workload``'s arrivals with lengths drawn from ``pools`` at bucket ``weights``.

    :param workload: the slice whose arrival times are kept.
    :param pools: per bucket, the ``(prompt, output)`` pairs to draw from
        (:func:`length_pools` of the training traffic).
    :param weights: per bucket, the share of requests in the new mix (normalised; buckets
        with an empty pool get none).
    :param rng: the draws' generator.
    :param keep_tokens: thin the arrivals so that the expected prompt + output tokens per
        second stays the slice's own (a long-heavy mix at the same request rate would be
        several times the load: the rate scale the caller chose keeps its meaning);
        arrivals are never added.
    :param token_scale: with ``keep_tokens``, keep ``token_scale`` times the slice's token
        rate instead (as far as its arrivals allow).
    :raises ValueError: weights of the wrong length, negative, or none on a non-empty pool;
        ``token_scale`` not > 0.
    """
    if not token_scale > 0:
        raise ValueError(f"token_scale must be > 0, got {token_scale}")
    if len(weights) != len(pools):
        raise ValueError(f"need one weight per bucket ({len(pools)}), got {len(weights)}")
    w = np.array([float(x) if pool else 0.0 for x, pool in zip(weights, pools, strict=True)])
    if any(float(x) < 0 for x in weights) or not w.sum() > 0:
        raise ValueError(f"bucket weights must be >= 0 with one > 0 on a bucket that has "
                         f"requests; got {list(weights)}")
    w /= w.sum()
    keep = 1.0
    if keep_tokens and workload.requests:
        old = float(np.mean([r.prompt_tokens + r.max_output_tokens
                             for r in workload.requests]))
        new = sum(float(p) * float(np.mean([a + b for a, b in pool]))
                  for p, pool in zip(w, pools, strict=True) if p > 0)
        keep = min(1.0, token_scale * old / new)
    rows = []
    for r in workload.requests:
        if keep < 1.0 and rng.random() >= keep:
            continue
        pool = pools[int(rng.choice(len(w), p=w))]
        prompt, output = pool[int(rng.integers(len(pool)))]
        rows.append((r.arrival_s, prompt, output, None))
    if not rows:
        rows = [(0.0, *pools[int(np.argmax(w))][0], None)]
    mix = "/".join(f"{x:.2f}" for x in w)
    return build_workload(rows, name=f"{workload.name}~mix", source=workload.source,
                          transforms=(*workload.transforms,
                                      f"length mix {mix}" + (f", kept {keep:.2f} of arrivals"
                                                             if keep < 1.0 else "")))


def remix_at_random(workload: Workload, source: Workload, source_end_s: float,
                    edges: Sequence[int], rng: np.random.Generator,
                    token_scale: float = 1.0) -> Workload:
    """:func:`remix` at bucket weights drawn uniformly from the simplex, lengths from the
    requests of ``source`` that arrive before ``source_end_s`` (its training window), at
    ``token_scale`` times the slice's token rate."""
    pools = length_pools((r for r in source.requests if r.arrival_s < source_end_s), edges)
    weights = [float(x) for x in rng.dirichlet(np.ones(len(pools)))]
    return remix(workload, pools, weights, rng, token_scale=token_scale)
