"""The hold release: what a policy holds back is released once its queue head waits too long."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from envs.batch_size import BatchSizeEnv
from policies.artifact import copy_artifact, load_artifact
from policies.ppo import PpoController, artifact_release, ppo_factory
from rlbatch.buckets import Buckets
from rlbatch.control.controllers import make_controller
from rlbatch.control.guard import GuardConfig
from rlbatch.control.hold_release import (
    HOLD_RELEASE_FRACTION,
    RELEASE_TPOT_TOLERANCE,
    HoldRelease,
    release_late_holds,
)
from rlbatch.control.types import SLA, ControlAction, DeploymentInfo, DeploymentStats, WindowStats
from tests.factories import deployment_stats, engine_stats, window

POOLS = ("fp16",) * 4


def _stats(queued: tuple[int, ...], waits: tuple[float, ...],
           tpot_p99_s: float = 0.2, unserved_s: float = 0.0) -> DeploymentStats:
    # TPOT P99 over the 0.1 s SLA by default
    window = WindowStats(30.0, (0.0,) * 4, (0.0,) * 4, 0.0, tpot_p99_s, 0.0, (0,) * 4, (0,) * 4)
    return DeploymentStats(10.0, 1.0, (), queued, (0,) * 4, (0,) * 4, window,
                           ControlAction((None,) * 4, POOLS), oldest_wait_s=waits,
                           oldest_unserved_s=unserved_s)


TRIMMED = ControlAction((2, 4, 8, None), POOLS, max_num_seqs=16)
INFO = DeploymentInfo(buckets=Buckets(), pools={"fp16": 1}, gpu="a100-80g", model="llama-2-7b",
                      default_max_num_seqs=256, max_num_batched_tokens=2048,
                      num_kv_blocks={"fp16": 2000}, block_size=16, max_model_len=4096,
                      tick_s=1.0, sla=SLA(), capacity_rps=4.0)


def release(action: ControlAction, stats: DeploymentStats | None,
            wait_s: float = 1.0, tolerance: float = RELEASE_TPOT_TOLERANCE) -> ControlAction:
    return release_late_holds(action, stats, wait_s=wait_s, tpot_sla_s=0.1, max_total=256,
                              tpot_tolerance=tolerance)


@pytest.mark.parametrize(("queued", "waits", "caps"), [
    ((1, 1, 1, 1), (0.5, 0.99, 1.0, 5.0), (2, 4, None, None)),  # at the wait it is released
    ((0, 3, 0, 0), (0.0, 4.0, 0.0, 0.0), (2, None, 8, None)),
    ((0, 0, 0, 9), (0.0, 0.0, 0.0, 9.0), (2, 4, 8, None)),  # untrimmed: nothing to release
    ((0, 0, 0, 0), (0.0, 0.0, 0.0, 0.0), (2, 4, 8, None)),
])
def test_only_trims_of_buckets_whose_queue_head_waited_are_released(
        queued: tuple[int, ...], waits: tuple[float, ...], caps: tuple[int | None, ...]) -> None:
    released = release(TRIMMED, _stats(queued, waits), tolerance=1.0)  # the total stands
    assert released.caps == caps
    assert released.max_num_seqs == 16 and released.pools == POOLS


def test_a_cap_at_the_total_or_without_a_total_is_not_a_trim() -> None:
    late = _stats((1, 1, 1, 1), (3.0,) * 4)
    at_total = ControlAction((16, 16, 2, None), POOLS, max_num_seqs=16)
    assert release(at_total, late).caps == (16, 16, None, None)
    per_bucket = ControlAction((2, 4, 8, 16), POOLS)  # no engine-wide total
    assert release(per_bucket, late) is per_bucket


@pytest.mark.parametrize(("waits", "tpot_p99_s", "tolerance", "total"), [
    ((0.0, 0.0, 2.0, 0.0), 0.1, 1.0, 256),  # a late head, TPOT within its SLA: the total goes
    ((0.0, 0.0, 2.0, 0.0), 0.11, 1.0, 16),  # stops 24-26: TPOT over it, the total stands
    ((0.0, 0.0, 2.0, 0.0), 0.11, math.inf, 256),  # the default: the late head wins
    ((0.0, 0.5, 0.9, 0.0), 0.05, math.inf, 16),  # nobody late
])
def test_the_total_is_released_for_a_late_queue_head_within_the_tpot_tolerance(
        waits: tuple[float, ...], tpot_p99_s: float, tolerance: float, total: int) -> None:
    action = ControlAction((None,) * 4, POOLS, max_num_seqs=16)
    queued = tuple(int(w > 0) for w in waits)
    stats = _stats(queued, waits, tpot_p99_s)
    assert release(action, stats, tolerance=tolerance).max_num_seqs == total
    top = ControlAction((None,) * 4, POOLS, max_num_seqs=256)
    assert release(top, stats, tolerance=tolerance) is top


@pytest.mark.parametrize(("unserved_s", "tpot_p99_s", "tolerance", "total"), [
    (1.0, 0.1, 1.0, 256),  # a request held inside an engine for the wait: the total goes
    (0.99, 0.1, math.inf, 16),
    (5.0, 0.11, 1.0, 16),  # stops 24-26: TPOT over its SLA, the total stands
    (5.0, 0.11, math.inf, 256),
])
def test_the_total_is_released_for_a_request_held_inside_an_engine(
        unserved_s: float, tpot_p99_s: float, tolerance: float, total: int) -> None:
    # every admission queue empty: only the engines' waiting queues hold anyone
    stats = _stats((0,) * 4, (0.0,) * 4, tpot_p99_s, unserved_s=unserved_s)
    action = ControlAction((None,) * 4, POOLS, max_num_seqs=16)
    assert release(action, stats, tolerance=tolerance).max_num_seqs == total
    assert release(TRIMMED, stats).caps == TRIMMED.caps  # trims read their own queue only


@pytest.mark.parametrize(("tolerance", "tpot_p99_s", "total"), [
    (1.5, 0.15, 256),  # TPOT at the tolerance: the late request outweighs it
    (1.5, 0.151, 16),
    (math.inf, 10.0, 256),  # whatever TPOT is
])
def test_the_total_is_released_while_tpot_is_within_the_tolerance(
        tolerance: float, tpot_p99_s: float, total: int) -> None:
    stats = _stats((0,) * 4, (0.0,) * 4, tpot_p99_s, unserved_s=1.0)
    action = ControlAction((None,) * 4, POOLS, max_num_seqs=16)
    assert release(action, stats, tolerance=tolerance).max_num_seqs == total
    assert release(action, stats, tolerance=1.0).max_num_seqs == 16  # within the SLA only


def test_a_release_of_the_trims_only_keeps_the_total() -> None:
    late = _stats((1, 1, 1, 1), (3.0,) * 4, 0.05, unserved_s=3.0)
    both = release_late_holds(TRIMMED, late, wait_s=1.0, tpot_sla_s=0.1, max_total=256)
    assert both.caps == (None, None, None, None) and both.max_num_seqs == 256
    trims = release_late_holds(TRIMMED, late, wait_s=1.0, tpot_sla_s=0.1, max_total=256,
                               release_total=False)
    assert trims.caps == (None, None, None, None) and trims.max_num_seqs == 16
    served = make_controller("ppo:policies/default[release.total=false]").pipeline
    assert served is not None and served.release == HoldRelease(total=False)


@pytest.mark.parametrize("tolerance", [1.0, math.inf])
def test_a_window_without_tpot_does_not_hold_the_total(tolerance: float) -> None:
    # no decode finished in the window (a stall): nothing says the total keeps TPOT in check
    stats = _stats((0,) * 4, (0.0,) * 4, math.nan, unserved_s=1.0)
    action = ControlAction((None,) * 4, POOLS, max_num_seqs=16)
    assert release(action, stats, tolerance=tolerance).max_num_seqs == 256


@pytest.mark.parametrize("tolerance", [0.99, 0.0, float("nan")])
def test_a_tolerance_under_one_raises(tolerance: float) -> None:
    with pytest.raises(ValueError, match="TPOT tolerance"):
        release_late_holds(TRIMMED, None, wait_s=1.0, tpot_sla_s=0.1, max_total=256,
                           tpot_tolerance=tolerance)


def test_nothing_to_judge_leaves_the_action() -> None:
    assert release(TRIMMED, None) is TRIMMED
    assert release(TRIMMED, replace(_stats((1,) * 4, (9.0,) * 4, 0.0), oldest_wait_s=())) \
        is TRIMMED


@pytest.mark.parametrize("wait_s", [0.0, -1.0, float("nan")])
def test_a_wait_that_is_not_positive_raises(wait_s: float) -> None:
    with pytest.raises(ValueError, match="hold release wait"):
        release(TRIMMED, None, wait_s)


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A student trained with the hold release (the shipped ones were trained without)."""
    return str(copy_artifact(Path("policies/default"), tmp_path_factory.mktemp("held"),
                             {"hold_release": True}))


def test_ppo_settings_set_the_release(held: str) -> None:
    default = make_controller(f"ppo:{held}")
    assert isinstance(default, PpoController)
    assert default.pipeline.release == HoldRelease(HOLD_RELEASE_FRACTION, RELEASE_TPOT_TOLERANCE)
    assert _release(f"ppo:{held}[release.wait_fraction=0.25]") == (
        0.25, RELEASE_TPOT_TOLERANCE)
    off = make_controller(f"ppo:{held}[release=none]")
    assert off.pipeline is not None and off.pipeline.release is None
    assert off.name == f"ppo:{held}[release=none]"
    for bad in ("0", "-1", "soon", "inf"):  # inf would never release: say none
        with pytest.raises(ValueError, match="wait_fraction"):
            make_controller(f"ppo:{held}[release.wait_fraction={bad}]")
    assert _release(f"ppo:{held}[release.wait_fraction=0.25,"
                    "release.tpot_tolerance=inf]") == (0.25, math.inf)
    assert _release(f"ppo:{held}[release.tpot_tolerance=1.5,"
                    "release.wait_fraction=0.75]") == (0.75, 1.5)
    for bad in ("0.9", "fast", "nan"):
        with pytest.raises(ValueError, match="tpot_tolerance"):
            make_controller(f"ppo:{held}[release.tpot_tolerance={bad}]")
    with pytest.raises(ValueError, match=r"unknown setting 'release\.tpot_tolerence'"):
        make_controller(f"ppo:{held}[release.tpot_tolerence=2]")
    with pytest.raises(ValueError, match="given twice"):
        make_controller(f"ppo:{held}[release.wait_fraction=0.5,"
                        "release.wait_fraction=0.25]")
    with pytest.raises(ValueError, match="set as a value and as a table"):
        make_controller(f"ppo:{held}[release=none,release.tpot_tolerance=2]")
    with pytest.raises(ValueError, match="tpot_tolerance must be >= 1"):
        PpoController(default.artifact, release=HoldRelease(tpot_tolerance=0.5))
    with pytest.raises(ValueError, match="wait_fraction must be > 0"):
        PpoController(default.artifact, release=HoldRelease(0.0))


def _release(spec: str) -> tuple[float, float]:
    """The hold release a ``ppo:`` spec sets: (wait fraction, TPOT tolerance)."""
    pipeline = make_controller(spec).pipeline
    assert pipeline is not None
    release = pipeline.release
    assert release is not None
    return release.wait_fraction, release.tpot_tolerance


@pytest.mark.parametrize("tolerance", ["1", "inf"])
def test_the_controller_releases_the_total_with_its_tolerance(
        tolerance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    controller = ppo_factory("policies/default", {"release": {"tpot_tolerance": tolerance}})
    controller.reset(INFO)
    nvec = controller.artifact.nvec
    # the network's proposal pinned to the smallest total, so that only the release lifts it
    monkeypatch.setattr(controller.artifact, "act",
                        lambda obs: np.zeros(len(nvec), dtype=np.int64))
    engine = engine_stats(running=(4, 0, 0, 0), waiting=(3, 0, 0, 0))
    stats = replace(deployment_stats((engine,), n=4, win=window(4, ttft=0.5, tpot=0.11)),
                    oldest_unserved_s=5.0)  # TPOT 10% over its SLA, a request 5 s late
    held = controller.pipeline.released(controller.propose(stats), stats)
    smallest = controller._held
    assert smallest is not None and smallest.max_num_seqs is not None
    assert smallest.max_num_seqs < controller.guard.config.max_cap
    assert controller.pipeline.release is not None
    expected = (smallest.max_num_seqs if controller.pipeline.release.tpot_tolerance == 1.0
                else controller.guard.config.max_cap)
    assert held.max_num_seqs == expected


def test_env_releases_what_the_action_holds_exactly_when_a_queue_head_has_waited() -> None:
    # A total of 16 with the 0-1k bucket held to 1/8 of it (cap 2), the guard's rules off so
    # that the caps in force are the proposal. With the release, on exactly the ticks whose
    # previous snapshot had a queue head waiting 1 s or more, the 0-1k cap is lifted (if
    # that head was its own) and the total goes to 256, TPOT over its SLA or not.
    unguarded = GuardConfig(ladder=(4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256),
                            warmup=False, kv_high=False, p99=False, efficiency=False,
                            kv_budget=None)
    kwargs = {"scenario": "day", "episode_s": 60.0, "drain_s": 20.0, "guard": unguarded,
              "action_kind": "total_share", "obs_version": 3, "rate_scale": 6.0}
    action = np.array([3, 0, 0, 3, 0, 3, 0, 3, 0], dtype=np.int64)  # 16; 0-1k at 1/8
    in_force: dict[float | None, set[tuple[int | None, int | None]]] = {}
    released = {"cap": 0, "total": 0, "slow": 0, "in_engine": 0}
    for wait_s in (None, 1.0):
        release = None if wait_s is None else HoldRelease(wait_s / SLA().ttft_s)
        env = BatchSizeEnv(**kwargs, release=release)  # type: ignore[arg-type]
        env.reset(seed=3)
        seen: set[tuple[int | None, int | None]] = set()
        previous = None
        for _ in range(60):
            env.step(action)
            stats = env._last_stats
            assert stats is not None
            seen.add((stats.action.caps[0], stats.action.max_num_seqs))
            if wait_s is not None and previous is not None:
                own = previous.queued[0] > 0 and previous.oldest_wait_s[0] >= wait_s
                late = max(previous.oldest_unserved_s, *previous.oldest_wait_s) >= wait_s
                fast = previous.window.tpot_p99_all_s <= 0.1
                assert stats.action.caps[0] == (None if own else 2)
                assert stats.action.max_num_seqs == (256 if late else 16)
                released["cap"] += own
                released["total"] += late
                released["slow"] += late and not fast  # the earlier rule held the total here
                released["in_engine"] += late and max(previous.oldest_wait_s) < wait_s
            previous = stats
        in_force[wait_s] = seen
    assert in_force[None] == {(2, 16)}
    assert released["cap"] > 0 and released["total"] > 0 and released["in_engine"] > 0
    assert released["slow"] > 0


def test_a_student_trained_without_the_release_is_served_without_it(tmp_path: Path,
                                                                    held: str) -> None:
    trained_without = copy_artifact(Path("policies/default"), tmp_path / "student",
                                    {"hold_release": False})
    served = make_controller(f"ppo:{trained_without}")
    assert isinstance(served, PpoController) and served.pipeline.release is None
    assert artifact_release(served.artifact) is None
    assert PpoController(served.artifact).pipeline.release is None
    # one that records the release is served with the default one, as it was trained; the
    # shipped policies were trained without it
    assert artifact_release(load_artifact(Path(held))) == HoldRelease()
    assert artifact_release(load_artifact(Path("policies/default"))) is None
    asked = make_controller(f"ppo:{trained_without}[release.wait_fraction=0.25]").pipeline
    assert asked is not None and asked.release == HoldRelease(0.25)
