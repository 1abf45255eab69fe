"""The recipe's TensorBoard (policies/training/board.py) on small synthetic run rows, the
run rows' tick fields it reads, --method ppo's caps, and one --smoke run (slow)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from policies.training.board import (
    PHASES,
    Board,
    hparam_values,
    log_runs,
    recipe_layout,
    run_histograms,
    run_scalars,
    ticks_median,
)
from policies.training.command import SMOKE_OPTIONS, parse_args
from policies.training.episodes import sample_episodes
from policies.training.ppo_trainer import bucket_limits, caps_figure, row_limits
from policies.training.recipe import Recipe, RecipeConfig
from rlbatch.buckets import Buckets
from rlbatch.control.types import ControlAction
from rlbatch.serving.run import tick_fields

BUCKETS = Buckets().names  # 0-1k, 1k-2k, 2k-4k, 4k+
ROOT = Path(__file__).resolve().parent.parent


def _bucket(goodput: float, attainment: float) -> dict[str, float]:
    return {"goodput_rps": goodput, "sla_attainment": attainment, "ttft_p99_s": 0.5,
            "tpot_p99_s": 0.04}


def _row(actions: dict[tuple[int | None, tuple[int | None, ...]], int]) -> dict[str, Any]:
    """A run row as rlbatch.serving.run writes it, its tick fields from ``actions``."""
    row: dict[str, Any] = {
        "goodput_rps": 3.0, "sla_attainment": 0.9, "sla_ttft_s": 2.0, "sla_tpot_s": 0.1,
        "kv_cache_usage_peak": 0.7, "guard_overrides": 2,
        # no 4k+ request: its attainment is NaN and its P99s are None
        "per_bucket": {"0-1k": _bucket(2.0, 0.95), "1k-2k": _bucket(0.5, 0.8),
                       "2k-4k": _bucket(0.5, 0.7),
                       "4k+": {"goodput_rps": 0.0, "sla_attainment": math.nan,
                               "ttft_p99_s": None, "tpot_p99_s": None}},
    }
    row.update(tick_fields(Counter(actions), BUCKETS))
    return row


# 0-1k capped at 32 then 16; 1k-2k and 2k-4k without caps of their own (the total holds
# them); 4k+ capped at 4 while a total is set, then nothing at all
ACTIONS = {(64, (32, None, None, 4)): 6, (None, (16, None, None, None)): 4}


class FakeWriter:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.histograms: dict[str, list[float]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def add_histogram(self, tag: str, values: Any, step: int) -> None:
        self.histograms[tag] = sorted(float(v) for v in values)


def test_tick_fields_count_an_uncapped_bucket_at_the_total() -> None:
    fields = tick_fields(Counter(ACTIONS), BUCKETS)
    assert fields["max_num_seqs_ticks"] == {"64": 6, "none": 4}
    assert fields["max_num_seqs_median"] == 64.0
    assert fields["bucket_cap_ticks"] == {"0-1k": {"16": 4, "32": 6},
                                          "1k-2k": {"64": 6, "none": 4},
                                          "2k-4k": {"64": 6, "none": 4},
                                          "4k+": {"4": 6, "none": 4}}


def test_run_scalars_name_buckets_and_leave_out_what_a_chart_cannot_hold() -> None:
    scalars = run_scalars("teacher", _row(ACTIONS))
    per_bucket = {f"teacher/{key}/{b}" for key in ("goodput_rps", "sla_attainment",
                                                    "ttft_p99_s", "tpot_p99_s")
                  for b in ("0-1k", "1k-2k", "2k-4k")}
    assert set(scalars) == per_bucket | {
        "teacher/goodput_rps", "teacher/sla_attainment", "teacher/sla_ttft_s",
        "teacher/sla_tpot_s", "teacher/kv_cache_usage_peak", "teacher/guard_overrides",
        "teacher/total_median", "teacher/goodput_rps/4k+",
        "teacher/batch_cap/0-1k", "teacher/batch_cap/1k-2k", "teacher/batch_cap/2k-4k",
        "teacher/batch_cap/4k+"}
    assert scalars["teacher/batch_cap/0-1k"] == 32.0
    assert scalars["teacher/batch_cap/1k-2k"] == 64.0  # no cap of its own: the total
    assert scalars["teacher/batch_cap/4k+"] == 4.0
    assert scalars["teacher/total_median"] == 64.0
    assert scalars["teacher/goodput_rps/4k+"] == 0.0  # a real zero stays
    # mostly uncapped: no point, never 0
    loose = run_scalars("select", _row({(None, (None, None, None, None)): 7,
                                        (64, (None, None, None, None)): 3}))
    assert not any("batch_cap" in tag or "total_median" in tag for tag in loose)


def test_histograms_hold_ticks_per_limit_without_the_uncapped_ticks() -> None:
    board = Board(FakeWriter())
    row = _row(ACTIONS)
    assert set(run_histograms("dagger", row)) == {
        "dagger/total_hist", *(f"dagger/batch_cap_hist/{b}" for b in BUCKETS)}
    step = log_runs(board, "dagger", [row], 100)
    writer = board.writer
    assert step == 110  # ten ticks
    assert writer.histograms["dagger/total_hist"] == [64.0] * 6
    assert writer.histograms["dagger/batch_cap_hist/0-1k"] == [16.0] * 4 + [32.0] * 6
    assert writer.histograms["dagger/batch_cap_hist/1k-2k"] == [64.0] * 6
    assert {s for _, _, s in writer.scalars} == {110}
    assert all(v != 0 for t, v, _ in writer.scalars if "batch_cap" in t)


def test_runs_follow_one_another_on_the_global_step() -> None:
    logged: list[tuple[str, float, int]] = []
    rows = [_row({(64, (None,) * 4): 5}), _row({(32, (None,) * 4): 3})]
    end = log_runs(lambda t, v, s: logged.append((t, v, s)), "teacher", rows, 0)
    assert end == 8
    caps = [(v, s) for t, v, s in logged if t == "teacher/batch_cap/0-1k"]
    assert caps == [(64.0, 5), (32.0, 8)]


def test_board_drops_non_finite_values_and_prefixes_members() -> None:
    writer = FakeWriter()
    board = Board(writer).prefixed("member-1/")
    board("select/score", math.nan, 3)
    board("select/score", math.inf, 3)
    board("select/score", 0.9, 4)
    board.histogram("select/total_hist", {"none": 9}, 4)
    assert writer.scalars == [("member-1/select/score", 0.9, 4)] and not writer.histograms


def test_ticks_median() -> None:
    assert ticks_median({"8": 2, "16": 1}) == 8.0
    assert ticks_median({"8": 1, "none": 2}) == math.inf
    assert math.isnan(ticks_median({}))


def test_layout_puts_the_buckets_of_each_phase_on_one_chart() -> None:
    layout = recipe_layout()
    assert set(layout) == {f"recipe: {p}" for p in PHASES}
    for phase in PHASES:
        tags = set(run_scalars(phase, _row(ACTIONS)))
        charts = layout[f"recipe: {phase}"]
        for title, (kind, patterns) in charts.items():
            assert kind == "Multiline"
            matched = {t for t in tags for p in patterns if re.match(p, t)}
            assert matched, title
            member = {t for t in tags for p in patterns if re.match(p, f"member-0/{t}")}
            assert member == matched
        caps = next(ps for title, (_, ps) in charts.items() if "batch cap" in title)
        assert {t for t in tags for p in caps if re.match(p, t)} == {
            f"{phase}/total_median", *(f"{phase}/batch_cap/{b}" for b in BUCKETS)}
        p99 = next(ps for title, (_, ps) in charts.items() if "TTFT" in title)
        assert {t for t in tags for p in p99 if re.match(p, t)} == {
            f"{phase}/sla_ttft_s", *(f"{phase}/ttft_p99_s/{b}" for b in BUCKETS[:3])}


def test_hparam_values_are_what_the_dashboard_takes() -> None:
    values = hparam_values({"seed": 1, "dagger_focus": True, "learning_rate": 3e-3,
                            "traces": ("/data/traces/azure_conv_2023.csv",),
                            "net_arch": (64, 64), "teacher": "mpc", "knee": None})
    assert values == {"seed": 1, "dagger_focus": True, "learning_rate": 3e-3,
                      "traces": "azure_conv_2023.csv", "net_arch": "64,64",
                      "teacher": "mpc", "knee": "None"}


def test_ppo_caps_are_per_bucket_name_and_never_zero() -> None:
    def stats(total: int | None, caps: tuple[int | None, ...]) -> Any:
        return SimpleNamespace(time_s=0.0, arrived=(1, 0, 0, 0),
                               action=ControlAction(caps, ("fp16",) * 4, total))

    assert bucket_limits(stats(64, (8, None, None, None)), BUCKETS) == {
        "0-1k": 8.0, "1k-2k": 64.0, "2k-4k": 64.0, "4k+": 64.0}
    assert bucket_limits(stats(None, (8, None, None, None)), BUCKETS) == {"0-1k": 8.0}
    assert row_limits(_row(ACTIONS)) == {"total_median": 64.0, "batch_cap/0-1k": 32.0,
                                         "batch_cap/1k-2k": 64.0, "batch_cap/2k-4k": 64.0,
                                         "batch_cap/4k+": 4.0}
    ticks = [stats(64, (8, None, None, None))] * 10 + [stats(None, (8, None, None, None))]
    fig = caps_figure(ticks, "night", BUCKETS)
    lines = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].lines}
    assert lines["cap 0-1k"] == [8.0] * 11
    assert lines["cap 1k-2k"][:10] == [64.0] * 10 and math.isnan(lines["cap 1k-2k"][10])


def test_smoke_is_a_preset_that_explicit_options_override() -> None:
    args = parse_args(["--smoke", "--episodes", "2"])
    assert args.episodes == 2 and args.dagger_rounds == SMOKE_OPTIONS["distill"]["dagger_rounds"]
    assert args.no_compare and args.out == "runs/smoke" and args.train_deployments == ()
    ppo = parse_args(["--smoke", "--method", "ppo"])
    assert ppo.timesteps == SMOKE_OPTIONS["ppo"]["timesteps"] and ppo.out == "runs/smoke-ppo"
    assert parse_args([]).episodes != 2 and not parse_args([]).no_compare


@pytest.mark.parametrize("quiet", [True, False])
def test_recipe_phase_bars_follow_quiet(azure_trace: Path, tmp_path: Path, quiet: bool,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    # --no-progress passes quiet down to the phases' bars (here: the teacher's episodes)
    cfg = RecipeConfig(traces=(str(azure_trace),), episodes=1, episode_s=20.0,
                       dagger_rounds=0, deployments=(), out=str(tmp_path))
    recipe = Recipe(cfg, quiet=quiet)
    recipe.collect(sample_episodes(cfg, np.random.default_rng(0), 1, recipe.traces))
    assert ("teacher:" in capsys.readouterr().err) is not quiet


@pytest.mark.slow
def test_smoke_recipe_writes_every_phase_to_tensorboard(tmp_path: Path) -> None:
    """``train.py --smoke``: every phase runs, the artifact is written, and the TensorBoard
    run holds each phase's per-bucket figures, histograms, hparams and the layout."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    out = tmp_path / "smoke"
    done = subprocess.run([sys.executable, "train.py", "--smoke", "--no-progress", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "best" / "policy.json").exists() and (out / "student-finetuned").is_dir()
    board = EventMultiplexer()
    board.AddRunsFromDirectory(str(out / "tb"))
    board.Reload()
    assert list(board.Runs()) == ["recipe"]
    tags = board.Runs()["recipe"]
    scalars, histograms = set(tags["scalars"]), set(tags["histograms"])
    for phase in PHASES:
        for key in ("goodput_rps", "sla_attainment", "total_median", "kv_cache_usage_peak",
                    "guard_overrides", "sla_ttft_s", "sla_tpot_s"):
            assert f"{phase}/{key}" in scalars, (phase, key)
        for b in BUCKETS:
            assert f"{phase}/batch_cap/{b}" in scalars and f"{phase}/goodput_rps/{b}" in scalars
            assert f"{phase}/batch_cap_hist/{b}" in histograms
        assert f"{phase}/total_hist" in histograms
    assert not any(re.search(r"bucket ?\d", t) for t in scalars | histograms)
    for tag in scalars:
        if "/batch_cap/" in tag or tag.endswith("/total_median"):
            assert all(e.value > 0 for e in board.Scalars("recipe", tag)), tag
    steps = {p: min(e.step for e in board.Scalars("recipe", f"{p}/goodput_rps"))
             for p in PHASES}
    assert steps["teacher"] < steps["dagger"] < steps["finetune"] < steps["select"]
    assert {"student/bc_loss", "select/score", "select/best_score",
            "hparams/best_score"} <= scalars
    content = board.PluginRunToTagToContent("hparams")["recipe"]
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(content)
    assert b"episodes" in content["_hparams_/session_start_info"]
    assert "custom_scalars__config__" in board.PluginRunToTagToContent("custom_scalars")[
        "recipe"]
