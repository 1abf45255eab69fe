"""ObservationBuilder: shape, bounds and the meaning of single features."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbatch.control.observation import (
    CLIP,
    GLOBAL_FEATURES,
    PER_BUCKET_FEATURES,
    ObservationBuilder,
    feature_names,
    observation_size,
)
from rlbatch.control.types import SLA, DeploymentInfo, DeploymentStats
from tests.factories import BUCKETS, deployment_stats, engine_stats, random_deployment_stats

INFO = DeploymentInfo(buckets=BUCKETS, pools={"fp16": 1, "fp8": 1}, gpu="g", model="m",
                      default_max_num_seqs=8, max_num_batched_tokens=256,
                      num_kv_blocks={"fp16": 64, "fp8": 64}, block_size=16,
                      max_model_len=512, tick_s=1.0, sla=SLA())
BUILDER = ObservationBuilder(INFO, max_cap=64)
G = len(BUCKETS) * len(PER_BUCKET_FEATURES)


def _feature(obs: np.ndarray, name: str) -> float:
    return float(obs[feature_names(BUCKETS.names).index(name)])


@settings(max_examples=80, deadline=None)
@given(stats=random_deployment_stats(),
       flags=st.tuples(*(st.sampled_from((0.0, 1.0)),) * 5))
def test_observation_is_finite_bounded_and_sized(stats: DeploymentStats,
                                                 flags: tuple[float, ...]) -> None:
    obs = BUILDER.build(stats, flags)
    assert obs.shape == (observation_size(len(BUCKETS)),) == (BUILDER.size,)
    assert obs.dtype == np.float32
    assert np.all(np.isfinite(obs)) and obs.min() >= 0.0 and obs.max() <= CLIP
    assert tuple(obs[-5:]) == flags
    assert len(feature_names(BUCKETS.names)) == BUILDER.size


def test_initial_observation() -> None:
    obs = BUILDER.initial()
    assert obs.shape == (BUILDER.size,)
    assert _feature(obs, "batch_efficiency") == 1.0 and _feature(obs, "sla_attainment") == 1.0
    assert float(obs.sum()) == 2.0


def test_single_features_mean_what_the_docs_say() -> None:
    stats = deployment_stats(
        (engine_stats(0, "fp16", running=(2, 0, 0), waiting=(1, 0, 0), kv=0.25,
                      prefill=100, decode=100, recomputed=50, committed=512, capacity=1024),
         engine_stats(1, "fp8", running=(1, 0, 0), kv=math.nan)),
        queued=(0, 3, 0), caps=(32, None, 4), pools=("fp16", "fp8", "fp16"))
    obs = BUILDER.build(stats, (0.0,) * 5)
    b0, b1, _ = BUCKETS.names
    assert _feature(obs, f"{b0}/running") == np.float32(4 / 64)
    assert _feature(obs, f"{b0}/cap") == np.float32(0.5)
    assert _feature(obs, f"{b1}/cap") == 1.0  # no cap = the ladder's top
    assert _feature(obs, f"{b1}/pool") == 1.0
    assert _feature(obs, f"{b1}/queue_len") == np.float32(math.log1p(3) / math.log1p(1000))
    assert _feature(obs, "batch_efficiency") == 0.75
    assert _feature(obs, "kv_committed") == 0.5
    # max over engines keeps the real reading ahead of a NaN; a lone NaN reading must not
    # look like an empty cache: it counts as full
    assert _feature(obs, "kv_cache_usage") == 0.25
    nan_first = deployment_stats((engine_stats(kv=math.nan),))
    assert _feature(BUILDER.build(nan_first, (0.0,) * 5), "kv_cache_usage") == 1.0
    assert len(GLOBAL_FEATURES) == 13 and obs[G] == np.float32(0.25)
