"""Log a sweep to TensorBoard under ``sweep/``.

The figures go in as images and the key figures of every point as scalars (step = batch
size).

Uses ``torch.utils.tensorboard`` (torch is installed with the ``rl`` extra); imported only
when called, so the sweep itself needs neither torch nor tensorboard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlbatch.tools.sweep.checklist import SweepResult
from rlbatch.tools.sweep.plot import PANELS, build_figure, panel_figure, to_rgb_array

#: Point fields logged as scalars, with their TensorBoard names.
SCALARS: tuple[tuple[str, str], ...] = (
    ("throughput_output_tok_s", "output_tok_s"),
    ("throughput_total_tok_s", "total_tok_s"),
    ("ttft_p99_s", "ttft_p99_s"),
    ("tpot_p99_s", "tpot_p99_s"),
    ("e2e_p99_s", "e2e_p99_s"),
    ("kv_cache_usage_peak", "kv_cache_usage_peak"),
    ("preemptions", "preemptions"),
)


def _writer(logdir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(f"--logdir needs torch with tensorboard ({exc}); install the 'rl' "
                         f"extra or drop --logdir") from None
    return SummaryWriter(log_dir=str(logdir))


def log_to_tensorboard(result: SweepResult, logdir: Path) -> None:
    """Write the sweep's figures and scalars to an event file in ``logdir``.

    :param result: the sweep.
    :param logdir: TensorBoard log directory (created if missing).
    """
    writer = _writer(logdir)
    try:
        tag = f"{result.gpu}/{result.model}/{result.precision}"
        writer.add_image(f"sweep/overview/{tag}", to_rgb_array(build_figure(result)), 0,
                         dataformats="HWC")
        for name in PANELS:
            writer.add_image(f"sweep/{name}/{tag}", to_rgb_array(panel_figure(result, name)),
                             0, dataformats="HWC")
        for point in result.points:
            if not point.runnable:
                continue
            for field_name, scalar in SCALARS:
                value = getattr(point, field_name)
                if value is not None:
                    writer.add_scalar(f"sweep/{scalar}/{tag}/seq{point.seq_len}", value,
                                      point.batch)
        writer.add_text(f"sweep/guide/{tag}",
                        "\n\n".join(c.summary for c in result.guide_checks) or "not checked", 0)
    finally:
        writer.close()
