"""Traffic families: the kinds of traffic operators serve, as seeded generators.

Each family fixes a length distribution, an arrival process and (for RAG) the prompt
prefixes requests share, calibrated from published statistics of public traces; every number
is cited in ``docs/notebook/traffic-families-research.md`` (its tags say how each was read).
All keep ``prompt + output <= 4096`` so that every shipped deployment (Llama-2-7B has a 4k
context) serves them unchanged, which cuts the RAG and report prompts published for longer
contexts.

A family's load is given in units of its **reference rate**: requests per second at which,
on the default deployment (Llama-2-7B on one A100-80G, SLA 2 s / 100 ms), the best static
cap meets the SLA for about 80% of requests (measured with ``experiments/family_knee.py``).
``load=1`` is that knee, ``0.5`` light, ``2`` overload; other deployments scale it by their
rate scale as every workload does.

| family | prompt tokens (median, log-sd) | output tokens (median, log-sd) | arrivals |
|---|---|---|---|
| ``chat`` | 74, 1.7 (ShareGPT, Llumnix) | 487, 0.5 | bursty |
| ``code`` | 1,500, 0.79 (Azure 2023 code) | 13, 1.24 | bursty |
| ``rag`` | hot document (Zipf 1.1 over 64) + question | 60, 0.8 | Poisson |
| ``report`` | 1,800, 0.45 (summaries, capped) | 450, 0.35 (cap 1,024) | Poisson |

``drift`` alternates families within one run (``families=code/chat``, each for
``segment`` seconds), each at the same load in its own units: the right batch changes
mid-run, so no static is right throughout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rlbatch.request import PREFIX_BLOCK_TOKENS
from rlbatch.workload.base import RequestRow, Workload, build_workload
from rlbatch.workload.generators import bursty, poisson, poisson_arrivals
from rlbatch.workload.lengths import (
    DEFAULT_CONTEXT_TOKENS,
    LengthDist,
    LogNormalLengths,
    code_completion_mix,
)

__all__ = ["FAMILIES", "TrafficFamily", "chat_mix", "drift", "family_workload", "rag",
           "report_mix"]


def chat_mix() -> LogNormalLengths:
    """Chat: short prompts, long answers (ShareGPT as Llumnix reports it: input p50 74,
    p80 348, p99 3,388; output p50 487, p80 781, p99 1,234). The log-sds follow from p50
    and p80/p99 (1.7 for prompts, 0.5 for outputs)."""
    return LogNormalLengths(prompt_median=74, prompt_sigma=1.7, output_median=487,
                            output_sigma=0.5, prompt_min=4, prompt_max=3584, output_min=4,
                            output_max=2048, total_max=DEFAULT_CONTEXT_TOKENS, name="chat")


def report_mix() -> LogNormalLengths:
    """Batch report generation: long documents summarised into long answers (arxiv-
    summarisation prompts, median 7k tokens, cut to fit a 4k context; outputs of 200-500
    tokens capped at 512-1,024 as in LongBench's summary tasks)."""
    return LogNormalLengths(prompt_median=1800, prompt_sigma=0.45, output_median=450,
                            output_sigma=0.35, prompt_min=256, prompt_max=3072, output_min=64,
                            output_max=1024, total_max=DEFAULT_CONTEXT_TOKENS, name="report")


def rag(rate_rps: float, duration_s: float, seed: int = 0, *, documents: int = 64,
        zipf_a: float = 1.1, document_tokens: tuple[int, int] = (1536, 3072),
        question_median: float = 60.0, output_median: float = 60.0) -> Workload:
    """Retrieval-augmented questions over a hot set of documents, Poisson arrivals.

    Each request is one of ``documents`` documents (picked Zipf-like: a few hot ones, as the
    three prefixes that cover 99% of Mooncake's tool-and-agent requests) followed by a
    question (log-normal, log-sd 0.6) and answered in tens of tokens (log-normal, log-sd 0.8,
    LongBench's 32-128-token answer caps). Requests of one document share its prompt blocks
    (``prefix_ids``), so a prefix cache serves the document once and the question after it.

    :param rate_rps: requests per second.
    :param duration_s: arrivals within ``[0, duration_s)``.
    :param seed: generator seed.
    :param documents: distinct documents.
    :param zipf_a: popularity exponent (document ``k`` has weight ``k ** -zipf_a``).
    :param document_tokens: document lengths, uniform in ``[lo, hi]``, whole blocks.
    :param question_median: median question tokens.
    :param output_median: median answer tokens.
    :raises ValueError: bad arguments.
    """
    if not (rate_rps > 0 and duration_s > 0 and math.isfinite(rate_rps * duration_s)):
        raise ValueError(f"rate_rps and duration_s must be > 0, got {rate_rps}, {duration_s}")
    if documents < 1 or not zipf_a >= 0:
        raise ValueError(f"need documents >= 1 and zipf_a >= 0, got {documents}, {zipf_a}")
    lo, hi = document_tokens
    if not PREFIX_BLOCK_TOKENS <= lo <= hi or hi + 4 * question_median + 256 > (
            DEFAULT_CONTEXT_TOKENS):
        raise ValueError(f"document_tokens {document_tokens} must be >= one block and leave "
                         f"room for a question and answer in {DEFAULT_CONTEXT_TOKENS} tokens")
    rng = np.random.default_rng(seed)
    blocks = rng.integers(lo // PREFIX_BLOCK_TOKENS, hi // PREFIX_BLOCK_TOKENS + 1, documents)
    weights = np.arange(1, documents + 1, dtype=float) ** -zipf_a
    arrivals = poisson_arrivals(rng, rate_rps, 0.0, duration_s)
    count = int(arrivals.size)
    docs = rng.choice(documents, size=count, p=weights / weights.sum())
    room = DEFAULT_CONTEXT_TOKENS - int(blocks.max()) * PREFIX_BLOCK_TOKENS
    questions = np.clip(np.rint(rng.lognormal(math.log(question_median), 0.6, count)), 4,
                        room // 2)
    outputs = np.clip(np.rint(rng.lognormal(math.log(output_median), 0.8, count)), 4,
                      room // 2)
    rows: list[RequestRow] = []
    for arrival, doc, question, output in zip(arrivals.tolist(), docs.tolist(),
                                              questions.tolist(), outputs.tolist(),
                                              strict=True):
        shared = int(blocks[doc])
        prompt = shared * PREFIX_BLOCK_TOKENS + int(question)
        # the document's blocks are shared; the block holding the question is the request's
        ids = (*(1 + doc * 64 + i for i in range(shared)), 1_000_000 + len(rows))
        rows.append((arrival, prompt, int(output), ids))
    if not rows:
        raise ValueError(f"no request arrived in {duration_s} s at {rate_rps}/s")
    return build_workload(rows, name="rag", source=(
        f"rag(rate_rps={rate_rps:g}, duration_s={duration_s:g}, seed={seed}, "
        f"documents={documents}, zipf_a={zipf_a:g})"))


@dataclass(frozen=True)
class TrafficFamily:
    """A named kind of traffic.

    :param name: its name (a workload spec's generator word).
    :param description: one line for reports.
    :param reference_rps: requests per second at ``load=1`` (see the module docstring).
    :param make: ``(rate_rps, duration_s, seed) -> Workload``.
    """

    name: str
    description: str
    reference_rps: float
    make: Callable[[float, float, int], Workload]


def _lengths_family(lengths: Callable[[], LengthDist],
                    arrivals: Callable[[float, float, LengthDist, int], Workload]
                    ) -> Callable[[float, float, int], Workload]:
    """A family that is a length distribution under an arrival process."""
    def make(rate_rps: float, duration_s: float, seed: int) -> Workload:
        return arrivals(rate_rps, duration_s, lengths(), seed)
    return make


FAMILIES: dict[str, TrafficFamily] = {f.name: f for f in (
    TrafficFamily("chat", "chat: short prompts, long answers (ShareGPT), bursty", 4.2,
                  _lengths_family(chat_mix, bursty)),
    TrafficFamily("code", "code completion: ~1.5k-token prompts, tens of output tokens "
                          "(Azure 2023 code), bursty", 3.3,
                  _lengths_family(code_completion_mix, bursty)),
    TrafficFamily("rag", "RAG: questions over hot documents sharing prefixes, short answers, "
                         "Poisson", 8.5, lambda r, d, s: rag(r, d, s)),
    TrafficFamily("report", "batch reports: ~1.8k-token documents, ~450-token answers, "
                            "Poisson", 1.65, _lengths_family(report_mix, poisson)),
)}


def family_workload(name: str, load: float, duration_s: float, seed: int = 0) -> Workload:
    """One family's workload at ``load`` times its reference rate.

    :raises ValueError: an unknown family or a load that is not > 0.
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown traffic family {name!r}; choose one of "
                         f"{', '.join(FAMILIES)}")
    if not (math.isfinite(load) and load > 0):
        raise ValueError(f"load must be a finite number > 0, got {load}")
    family = FAMILIES[name]
    return family.make(load * family.reference_rps, duration_s, seed)


def drift(families: tuple[str, ...], load: float, duration_s: float, segment_s: float,
          seed: int = 0) -> Workload:
    """Families in turn, each for ``segment_s`` seconds, all at ``load``.

    :param families: the families, in order (repeated until ``duration_s``).
    :param load: each family's load in its own reference units.
    :param duration_s: arrivals within ``[0, duration_s)``.
    :param segment_s: how long each family lasts.
    :param seed: seed (each segment draws from its own).
    :raises ValueError: no families, an unknown one, or bad numbers.
    """
    if not families:
        raise ValueError("drift needs at least one family")
    if not (segment_s > 0 and duration_s > 0):
        raise ValueError(f"segment_s and duration_s must be > 0, got {segment_s}, "
                         f"{duration_s}")
    rows: list[RequestRow] = []
    start, k = 0.0, 0
    while start < duration_s:
        length = min(segment_s, duration_s - start)
        part = family_workload(families[k % len(families)], load, length, seed * 1009 + k)
        rows += [(start + r.arrival_s, r.prompt_tokens, r.max_output_tokens,
                  None if r.prefix_ids is None
                  else tuple(i + 10_000_000 * k for i in r.prefix_ids))
                 for r in part.requests]
        start += segment_s
        k += 1
    return build_workload(rows, name="drift-" + "-".join(families), source=(
        f"drift(families={'/'.join(families)}, load={load:g}, duration_s={duration_s:g}, "
        f"segment_s={segment_s:g}, seed={seed})"))
