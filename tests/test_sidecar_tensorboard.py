"""The sidecar's TensorBoard writer (rlbatch/sidecar/tensorboard.py): tensorboardX events that
TensorBoard reads, written without torch or the tensorboard package."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from rlbatch.sidecar.tensorboard import DecisionWriter

ROOT = Path(__file__).resolve().parent.parent


def test_ticks_are_scalars_at_their_tick_and_the_settings_text(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = DecisionWriter(tmp_path / "tb")
    writer.write(0, {"decision/batch_cap/0-1k": 1.0})  # before open: nothing, no error
    writer.open("# settings\n\n--controller static:4")
    writer.write(1, {"decision/batch_cap/0-1k": 4.0, "engine/kv_cache_usage/fp16": 0.25})
    writer.write(2, {"decision/batch_cap/0-1k": 8.0})
    writer.close()
    writer.close()  # twice is fine
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*.sidecar")
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"decision/batch_cap/0-1k",
                                          "engine/kv_cache_usage/fp16"}
    assert [(e.step, e.value) for e in acc.Scalars("decision/batch_cap/0-1k")] == [
        (1, 4.0), (2, 8.0)]
    assert math.isclose(acc.Scalars("engine/kv_cache_usage/fp16")[0].value, 0.25)
    (text,) = acc.Tags()["tensors"]
    assert text.startswith("sidecar/settings")
    assert b"static:4" in acc.Tensors(text)[0].tensor_proto.string_val[0]


def test_writes_without_torch_or_tensorboard(tmp_path: Path) -> None:
    """The sidecar's image has neither: importing them fails, the writer still writes."""
    code = (
        "import sys\n"
        "for m in ('torch', 'tensorboard'): sys.modules[m] = None\n"
        "from pathlib import Path\n"
        "from rlbatch.sidecar.tensorboard import DecisionWriter\n"
        f"w = DecisionWriter(Path({str(tmp_path)!r}))\n"
        "w.open('settings'); w.write(1, {'decision/fallback': 0.0}); w.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (events,) = tmp_path.glob("events.out.tfevents.*")
    assert events.stat().st_size > 0
