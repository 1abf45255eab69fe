"""The sidecar's control ticks to TensorBoard (``--logdir``), with the ``tensorboard`` package
alone (no torch): one event per tick, on tensorboard's own writer thread, so a tick never
waits for the disk.

Tags are the snapshot table's (:data:`rlbatch.control.stats_metrics.METRICS`: ``rollout/``,
``engine/``, ``decision/``, ``guard/``, the same tags training writes) plus the sidecar's own
``decision/fallback`` and ``decision/seconds``; the settings go in once as text.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from rlbatch.control.stats_metrics import MetricContext, tensorboard_scalars
from rlbatch.control.types import DeploymentStats


def tick_scalars(stats: DeploymentStats, ctx: MetricContext, *, fallback: bool,
                 decision_s: float) -> dict[str, float]:
    """One tick's scalars: the table's, then the sidecar's; non-finite values dropped
    (TensorBoard cannot plot them: an uncapped bucket's cap, an empty window's P99).

    :param stats: the tick's snapshot.
    :param ctx: names and the tick's guard overrides.
    :param fallback: the tick applied the guard's fallback caps.
    :param decision_s: the controller's decision time (NaN: it did not decide).
    """
    scalars = tensorboard_scalars(stats, ctx)
    scalars["decision/fallback"] = float(fallback)
    scalars["decision/seconds"] = decision_s
    return {tag: value for tag, value in scalars.items() if math.isfinite(value)}


class DecisionWriter:
    """Scalars of the control ticks, one event per tick.

    :param logdir: TensorBoard log directory (created on :meth:`open`).
    """

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self._writer: Any = None
        self._pb: Any = None

    def open(self, settings_text: str) -> None:
        """Create the event file and write the settings once. Does I/O.

        :param settings_text: the settings, as Markdown text.
        :raises ValueError: the ``tensorboard`` package is not installed.
        """
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ValueError(f"--logdir needs the 'tensorboard' package ({exc}); install the "
                             f"'rl' extra or drop --logdir") from None
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._pb = (event_pb2, summary_pb2, tensor_pb2)
        self._writer = EventFileWriter(str(self.logdir), flush_secs=5,
                                       filename_suffix=".sidecar")
        meta = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        tensor = tensor_pb2.TensorProto(dtype=7, string_val=[settings_text.encode()])  # string
        value = summary_pb2.Summary.Value(tag="sidecar/settings", metadata=meta, tensor=tensor)
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=0,
                                               summary=summary_pb2.Summary(value=[value])))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """One tick's scalars (queued; tensorboard's thread writes them).

        :param step: the tick number.
        :param scalars: tag -> value.
        """
        if self._writer is None:
            return
        event_pb2, summary_pb2, _ = self._pb
        values = [summary_pb2.Summary.Value(tag=tag, simple_value=float(v))
                  for tag, v in scalars.items()]
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=step,
                                               summary=summary_pb2.Summary(value=values)))

    def close(self) -> None:
        """Flush and close (does I/O)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
