"""The reference capacity (observation version 3's unit of load)."""

from __future__ import annotations

import pytest

from policies.evaluation.protocol import DEPLOYMENT_RATE_SCALES
from rlbatch.buckets import Buckets
from rlbatch.profiles import RooflineStepTimeModel, load_gpu, load_model
from rlbatch.profiles.capacity import profile_capacity_rps, reference_capacity_rps
from rlbatch.serving.builders import build_sim_deployment
from rlbatch.serving.deployment import DeploymentSpec


def _capacity(gpu: str, model: str, pools: str = "fp16:1") -> float:
    spec = DeploymentSpec(gpu=gpu, model=model, pools=dict(
        (p.split(":")[0], int(p.split(":")[1])) for p in pools.split(",")), buckets=Buckets())
    return build_sim_deployment(spec).info.capacity_rps


@pytest.mark.parametrize("key", [k for k in DEPLOYMENT_RATE_SCALES if k[2] == "fp16:1"])
def test_capacity_tracks_the_measured_knee_multipliers(key: tuple[str, str, str]) -> None:
    # The multipliers were measured by sweeping load to the knee; an estimate that does not
    # follow them would make "80% of capacity" mean different loads on different GPUs.
    gpu, model, pools = key
    ratio = _capacity(gpu, model, pools) / _capacity("a100-80g", "llama-2-7b")
    assert ratio == pytest.approx(DEPLOYMENT_RATE_SCALES[key], rel=0.11)


def test_capacity_sums_engines_and_counts_fp8_kv() -> None:
    one = _capacity("a100-80g", "llama-2-7b", "fp16:1")
    assert _capacity("a100-80g", "llama-2-7b", "fp16:2") == pytest.approx(2 * one)
    # An FP8 KV pool holds twice the sequences of a KV-bound engine: more throughput.
    assert _capacity("a100-80g", "llama-2-7b", "fp16:1,fp8:1") > 2.2 * one


def test_capacity_grows_with_kv_until_max_num_seqs_binds() -> None:
    step = RooflineStepTimeModel(load_gpu("a100-80g"), load_model("llama-2-7b"))
    small = reference_capacity_rps(step, 20 * 1280, 256)
    large = reference_capacity_rps(step, 100 * 1280, 256)
    assert small < large
    assert reference_capacity_rps(step, 10**7, 64) == reference_capacity_rps(step, 10**6, 64)
    # A pool that holds less than one request still serves one at a time.
    assert reference_capacity_rps(step, 100, 256) == reference_capacity_rps(step, 1280, 256)


def test_bad_arguments_raise() -> None:
    step = RooflineStepTimeModel(load_gpu("a100-80g"), load_model("llama-2-7b"))
    with pytest.raises(ValueError, match="must be >= 1"):
        reference_capacity_rps(step, 0, 256)
    with pytest.raises(ValueError, match="must be >= 1"):
        reference_capacity_rps(step, 1000, 256, output_tokens=0)
    with pytest.raises(ValueError, match="unknown"):
        profile_capacity_rps("no-such-gpu", "llama-2-7b", {"fp16": 1}, max_num_seqs=256,
                             max_num_batched_tokens=8192)


def test_profile_capacity_equals_the_simulated_deployments() -> None:
    from rlbatch.engine.config import vllm_default_budgets

    seqs, tokens = vllm_default_budgets("h100-80g")
    assert profile_capacity_rps("h100-80g", "llama-3.1-8b", {"fp16": 1}, max_num_seqs=seqs,
                                max_num_batched_tokens=tokens) == pytest.approx(
        _capacity("h100-80g", "llama-3.1-8b"))
