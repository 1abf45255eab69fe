"""Issue 11: evaluation grids, sweeps and teacher episodes on a real local Ray cluster.

One local cluster (``ray.init``, 2 CPU slots) serves the module; every test compares with
the run without Ray, exactly (wall-clock fields aside).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rlbatch.commands.main import main as rlbatch_main
from rlbatch.engine.config import parse_pools
from rlbatch.scale import LOCAL, TaskError, connect, failed, run_tasks
from rlbatch.scale.cluster import shutdown
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.tools.evaluate import EvalJob, comparable_rows, run_jobs

REPO = Path(__file__).resolve().parents[1]
GRID = ["--trace", "poisson:rate=3,duration=40,mix=day", "scenario:bursty:60",
        "--controllers", "static:{8,32},playbook,aimd", "--rate-scale", "0.5,1", "--quiet"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    startup = connect(LOCAL, num_cpus=2)
    assert startup > 0  # a real cluster started here
    yield
    shutdown()


def _rows(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(path.read_text())
    return rows


def test_evaluate_grid_on_ray_equals_serial(cluster: None, tmp_path: Path) -> None:
    assert rlbatch_main(["evaluate", *GRID, "--json", str(tmp_path / "serial.json")]) == 0
    assert rlbatch_main(["evaluate", *GRID, "--json", str(tmp_path / "ray.json"),
                         "--ray"]) == 0
    serial, on_ray = _rows(tmp_path / "serial.json"), _rows(tmp_path / "ray.json")
    assert len(serial) == 2 * 2 * 4
    assert [(r["controller"], r["trace"], r["rate_scale"]) for r in on_ray] == \
        [(r["controller"], r["trace"], r["rate_scale"]) for r in serial]
    assert comparable_rows(on_ray) == comparable_rows(serial)
    assert all("error" not in r for r in on_ray)


def test_failing_task_is_an_error_row_and_exit_1(cluster: None, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # The shipped policy was trained on one fp16 pool: on a two-pool deployment it builds
    # (the up-front check passes) but fails at reset, on the worker, every time.
    args = ["evaluate", "--trace", "poisson:rate=3,duration=30,mix=day", "--controllers",
            "static:16,ppo:policies/default", "--pools", "fp16:1,fp8:1", "--quiet"]
    assert rlbatch_main([*args, "--json", str(tmp_path / "ray.json"), "--ray"]) == 1
    out = capsys.readouterr()
    rows = _rows(tmp_path / "ray.json")
    assert [r["controller"] for r in rows] == ["static:16", "ppo:policies/default"]
    bad = rows[1]
    assert bad["error"] == ("ArtifactError: policy was trained on pools ['fp16'], the "
                            "deployment has ['fp16', 'fp8']")
    assert bad["attempts"] == 2
    assert (bad["trace"], bad["rate_scale"], bad["seed"], bad["window"]) == \
        ("poisson-day_mix", 1.0, 0, None)
    assert "retrying" in out.err and "failed 2 times" in out.err
    assert "FAILED (2 attempts): ppo:policies/default" in out.out
    # The good run is the serial run's row.
    assert rlbatch_main(["evaluate", "--trace", "poisson:rate=3,duration=30,mix=day",
                         "--controllers", "static:16", "--pools", "fp16:1,fp8:1", "--quiet",
                         "--json", str(tmp_path / "serial.json")]) == 0
    assert comparable_rows(rows[:1]) == comparable_rows(_rows(tmp_path / "serial.json"))


def test_run_jobs_keeps_its_signature_and_window_jobs(cluster: None,
                                                      azure_trace: Path) -> None:
    # policies/evaluation/protocol.py calls run_jobs(jobs, n_jobs=..., quiet=..., desc=...).
    spec = DeploymentSpec(gpu="a100-80g", model="llama-2-7b", pools=parse_pools("fp16"),
                          admission=AdmissionConfig(over_length="truncate"))
    jobs = [EvalJob(c, str(azure_trace), rate, replace(spec), (0.0, 300.0), None, 0, 120.0)
            for rate in (0.5, 1.0) for c in ("static:16", "playbook")]
    serial = run_jobs(jobs, n_jobs=1, quiet=True, desc="t")
    assert comparable_rows(run_jobs(jobs, quiet=True, ray=LOCAL)) == comparable_rows(serial)


def _flaky(item: tuple[str, int], shared: list[int]) -> int:
    # Fails on its first attempt only (a marker file says it ran): a transient failure.
    marker, value = Path(item[0]), item[1]
    if not marker.exists():
        marker.write_text("ran")
        raise RuntimeError("transient")
    return value + sum(shared)


def _always_fails(item: int, shared: None) -> int:
    raise ValueError(f"bad input {item}")


def test_run_tasks_retries_once_and_keeps_order(cluster: None, tmp_path: Path) -> None:
    items = [(str(tmp_path / f"m{i}"), i) for i in range(5)]
    results = run_tasks(_flaky, items, shared={"s": [10, 20]}, shared_key=lambda _: "s",
                        quiet=True)
    assert results == [30, 31, 32, 33, 34]
    assert all(Path(m).exists() for m, _ in items)
    bad = run_tasks(_always_fails, [7], quiet=True, describe=lambda i: f"item {i}")
    assert failed(bad) == bad
    assert isinstance(bad[0], TaskError)
    assert (bad[0].index, bad[0].inputs, bad[0].error, bad[0].attempts) == \
        (0, "item 7", "ValueError: bad input 7", 2)


def test_sweep_on_ray_equals_serial(cluster: None, tmp_path: Path) -> None:
    args = ["sweep", "--max-num-seqs", "4,16", "--seq-len", "512,2048", "--num-requests",
            "32", "--quiet"]
    assert rlbatch_main([*args, "--json", str(tmp_path / "serial.json")]) == 0
    assert rlbatch_main([*args, "--json", str(tmp_path / "ray.json"), "--ray"]) == 0
    serial = json.loads((tmp_path / "serial.json").read_text())
    on_ray = json.loads((tmp_path / "ray.json").read_text())
    for doc in (serial, on_ray):  # each point's measured wall time: the only clock field
        for point in doc["points"]:
            assert point.pop("wall_seconds") >= 0
    assert len(on_ray["points"]) == 4
    assert on_ray == serial


def test_without_ray_nothing_imports_ray() -> None:
    code = ("import sys; from rlbatch.commands.main import build_parser; build_parser(); "
            "import rlbatch.tools.evaluate, rlbatch.tools.sweep_ray, policies.training.multiseed; "
            "import train; train.build_parser(); assert 'ray' not in sys.modules, 'ray'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
