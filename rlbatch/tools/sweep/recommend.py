"""What the sweep recommends per sequence length: the batch sizes that pass the guide's test.

A point passes ("ok") when P99 latency and P99 TPOT are within the SLA and the engine neither
preempted nor ran out of KV blocks. Per sequence length the sweep recommends the largest
passing batch (the guide's question: how far can the batch go?) and the passing batch with
the most output tokens/s (the same one unless preemption or a saturated GPU makes a larger
batch slower).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rlbatch.tools.sweep.memory import MemoryPlan
from rlbatch.tools.sweep.point import SweepPoint


@dataclass(frozen=True)
class SeqLenRecommendation:
    """The sweep's answer for one sequence length.

    :param seq_len: prompt tokens.
    :param runnable: whether the model's context admits this length at all.
    :param largest_batch_meeting_sla: largest batch that passes (``None``: none passes).
    :param max_throughput_batch: passing batch with the most output tokens/s.
    :param max_throughput_output_tok_s: its output tokens/s.
    :param max_throughput_total_tok_s: its prompt + output tokens/s.
    :param first_kv_overflow_batch: smallest swept batch at which the KV cache ran short:
        the engine preempted, a running request found no free block, or fewer than ``batch``
        sequences could be admitted (``None``: at no swept batch).
    :param kv_fit_batch: how many sequences of ``seq_len + output_len`` tokens the KV pool
        holds at once; larger batches must preempt before they finish.
    :param note: a short explanation where the answer is empty.
    """

    seq_len: int
    runnable: bool
    largest_batch_meeting_sla: int | None
    max_throughput_batch: int | None
    max_throughput_output_tok_s: float | None
    max_throughput_total_tok_s: float | None
    first_kv_overflow_batch: int | None
    kv_fit_batch: int
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object."""
        return asdict(self)


def recommend(points: Sequence[SweepPoint], seq_lens: Sequence[int], output_len: int,
              plan: MemoryPlan) -> list[SeqLenRecommendation]:
    """One recommendation per sequence length, from the grid's points.

    :param points: the grid (one precision).
    :param seq_lens: the sequence lengths, in order.
    :param output_len: output tokens per request.
    :param plan: the memory plan of the grid's precision.
    """
    out: list[SeqLenRecommendation] = []
    for seq_len in seq_lens:
        row = sorted((p for p in points if p.seq_len == seq_len), key=lambda p: p.batch)
        runnable = [p for p in row if p.runnable]
        passing = [p for p in runnable if p.ok]
        best = max(passing, key=lambda p: p.throughput_output_tok_s or 0.0, default=None)
        overflowed = [p.batch for p in runnable if p.overflowed]
        note = ""
        if not runnable:
            note = (row[0].reason or "not runnable") if row else "not swept"
        elif not passing:
            note = "no swept batch meets the SLA without preemption"
        out.append(SeqLenRecommendation(
            seq_len=seq_len,
            runnable=bool(runnable),
            largest_batch_meeting_sla=max((p.batch for p in passing), default=None),
            max_throughput_batch=best.batch if best else None,
            max_throughput_output_tok_s=best.throughput_output_tok_s if best else None,
            max_throughput_total_tok_s=best.throughput_total_tok_s if best else None,
            first_kv_overflow_batch=min(overflowed, default=None),
            kv_fit_batch=plan.max_sequences(seq_len + output_len),
            note=note,
        ))
    return out
