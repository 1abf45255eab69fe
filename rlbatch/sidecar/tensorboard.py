"""The sidecar's control ticks to TensorBoard (``--logdir``), written by tensorboardX's
``SummaryWriter`` (a core dependency: the sidecar needs neither torch nor the ``tensorboard``
package): events are queued and written on the writer's own thread, so a tick never waits
for the disk.

Tags are the snapshot table's (:data:`rlbatch.control.stats_metrics.METRICS`: ``rollout/``,
``engine/``, ``decision/``, ``guard/``, the same tags training writes) plus the sidecar's own
``decision/fallback`` and ``decision/seconds``; the settings go in once as text.
"""

from __future__ import annotations

import math
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


EVENTS_QUEUED = 4096
"""Events the writer holds before a tick would wait for its thread: one tick writes about
a hundred (one per scalar), so the disk may stall for tens of ticks."""


class DecisionWriter:
    """Scalars of the control ticks, each at the tick's number as its step.

    :param logdir: TensorBoard log directory (created on :meth:`open`).
    """

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self._writer: Any = None

    def open(self, settings_text: str) -> None:
        """Create the event file and write the settings once, as text. Does I/O.

        :param settings_text: the settings, as Markdown text.
        :raises ValueError: the ``tensorboardX`` package is not installed.
        """
        try:
            from tensorboardX import SummaryWriter
        except ImportError as exc:  # pragma: no cover - a core dependency
            raise ValueError(f"--logdir needs the 'tensorboardX' package ({exc}): "
                             f"pip install tensorboardX, or drop --logdir") from None
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(str(self.logdir), max_queue=EVENTS_QUEUED, flush_secs=5,
                                     filename_suffix=".sidecar")
        self._writer.add_text("sidecar/settings", settings_text, 0)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """One tick's scalars (queued; the writer's thread writes them).

        :param step: the tick number.
        :param scalars: tag -> value.
        """
        if self._writer is None:
            return
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, float(value), step)

    def close(self) -> None:
        """Flush and close (does I/O)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
