"""Length-mix randomisation of training slices (rlbatch.workload.remix, recipe --mix-share)."""

from __future__ import annotations

import bisect
from dataclasses import replace

import numpy as np
import pytest

from policies.evaluation.protocol import training_window
from policies.training.episodes import sample_episodes
from policies.training.recipe import RecipeConfig
from rlbatch.buckets import DEFAULT_EDGES
from rlbatch.workload import Workload, build_workload, load_trace
from rlbatch.workload.remix import length_pools, remix

EDGES = list(DEFAULT_EDGES)


def _bucket(prompt: int) -> int:
    return bisect.bisect_right(EDGES, prompt)


def _source() -> Workload:
    """Short-heavy traffic: 92.5% of prompts under 1k, 2.5% in each other bucket."""
    rows = [(0.1 * i, (300, 1500, 3000, 6000)[0 if i % 10 else (i // 10) % 4], 100 + i % 50,
             None) for i in range(4000)]
    return build_workload(rows, name="src", source="test")


def _shares(w: Workload) -> np.ndarray:
    counts = np.bincount([_bucket(r.prompt_tokens) for r in w.requests], minlength=4)
    return counts / counts.sum()


def test_pools_hold_every_request_in_its_bucket() -> None:
    pools = length_pools(_source().requests, EDGES)
    assert [len(p) for p in pools] == [3700, 100, 100, 100]
    assert all(_bucket(p) == b for b, pool in enumerate(pools) for p, _ in pool)


def test_remix_keeps_arrivals_and_draws_lengths_from_the_pools_at_the_weights() -> None:
    src = _source()
    pools = length_pools(src.requests, EDGES)
    out = remix(src, pools, [0.25, 0.25, 0.25, 0.25], np.random.default_rng(0),
                keep_tokens=False)
    assert len(out) == len(src)
    assert [r.arrival_s for r in out.requests] == pytest.approx(
        [r.arrival_s for r in src.requests])
    pairs = {pair for pool in pools for pair in pool}
    assert all((r.prompt_tokens, r.max_output_tokens) in pairs for r in out.requests)
    assert _shares(out) == pytest.approx([0.25] * 4, abs=0.03)
    assert _shares(src)[0] == pytest.approx(0.925)


def test_a_zero_weight_bucket_gets_no_request() -> None:
    src = _source()
    out = remix(src, length_pools(src.requests, EDGES), [0.0, 1.0, 0.0, 3.0],
                np.random.default_rng(1), keep_tokens=False)
    shares = _shares(out)
    assert shares[0] == 0.0 and shares[2] == 0.0
    assert shares[3] == pytest.approx(0.75, abs=0.03)


def _tokens(w: Workload) -> int:
    return sum(r.prompt_tokens + r.max_output_tokens for r in w.requests)


def test_a_heavier_mix_is_thinned_to_the_slice_token_rate_and_a_lighter_one_is_not() -> None:
    src = _source()
    pools = length_pools(src.requests, EDGES)

    heavy = remix(src, pools, [0.0, 0.0, 0.0, 1.0], np.random.default_rng(2))
    assert len(heavy) < len(src) / 5
    assert _tokens(heavy) == pytest.approx(_tokens(src), rel=0.1)
    assert "kept" in heavy.transforms[-1]
    light = remix(src, pools, [1.0, 0.0, 0.0, 0.0], np.random.default_rng(2))
    assert len(light) == len(src)
    assert "kept" not in light.transforms[-1]


def test_same_generator_state_gives_the_same_workload() -> None:
    src = _source()
    pools = length_pools(src.requests, EDGES)
    a = remix(src, pools, [0.1, 0.2, 0.3, 0.4], np.random.default_rng(7))
    b = remix(src, pools, [0.1, 0.2, 0.3, 0.4], np.random.default_rng(7))
    assert a.requests == b.requests


@pytest.mark.parametrize("weights, message", [
    ([1.0, 1.0, 1.0], "one weight per bucket"),
    ([1.0, -0.5, 1.0, 1.0], ">= 0"),
    ([0.0, 0.0, 0.0, 0.0], ">= 0"),
])
def test_bad_weights_are_refused(weights: list[float], message: str) -> None:
    src = _source()
    with pytest.raises(ValueError, match=message):
        remix(src, length_pools(src.requests, EDGES), weights, np.random.default_rng(0))


def test_weight_on_an_empty_pool_only_is_refused() -> None:
    src = build_workload([(0.0, 100, 10, None), (1.0, 200, 10, None)], name="s", source="t")
    with pytest.raises(ValueError, match="has requests"):
        remix(src, length_pools(src.requests, EDGES), [0.0, 0.0, 0.0, 1.0],
              np.random.default_rng(0))


def test_recipe_remixes_only_trace_slices_and_only_when_asked() -> None:
    base = RecipeConfig(deployments=(), family_share=0.0)
    traces = [load_trace(t) for t in base.traces]
    plain = sample_episodes(base, np.random.default_rng(3), 12, traces)
    assert not any(w.name.endswith("~mix") for _, w in plain)
    mixed = sample_episodes(RecipeConfig(deployments=(), mix_share=1.0, family_share=0.0),
                            np.random.default_rng(3), 12, traces)
    slices = [w for _, w in mixed if w.name.startswith(traces[0].name)]
    assert slices and all(w.name.endswith("~mix") for w in slices)
    # every remixed slice draws its lengths from the training window only
    end = training_window(base.traces[0])[1]
    window = {(r.prompt_tokens, r.max_output_tokens) for r in traces[0].requests
              if r.arrival_s < end}
    assert all((r.prompt_tokens, r.max_output_tokens) in window
               for w in slices for r in w.requests)
    assert any(_shares(w)[3] > 0.2 for w in slices)  # the trace itself is 2% 4k+


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_recipe_refuses_a_mix_share_outside_0_1(share: float) -> None:
    with pytest.raises(ValueError, match="mix_share"):
        RecipeConfig(mix_share=share)


def test_token_scale_keeps_that_many_times_the_slice_token_rate() -> None:
    src = _source()
    pools = length_pools(src.requests, EDGES)

    once = remix(src, pools, [0.0, 0.0, 0.0, 1.0], np.random.default_rng(2))
    twice = remix(src, pools, [0.0, 0.0, 0.0, 1.0], np.random.default_rng(2), token_scale=2.0)
    assert _tokens(twice) == pytest.approx(2 * _tokens(src), rel=0.1)
    assert _tokens(twice) == pytest.approx(2 * _tokens(once), rel=0.15)
    # never more arrivals than the slice has
    assert len(remix(src, pools, [0.0, 0.0, 0.0, 1.0], np.random.default_rng(2),
                     token_scale=1e6)) == len(src)
    with pytest.raises(ValueError, match="token_scale"):
        remix(src, pools, [1.0, 0.0, 0.0, 0.0], np.random.default_rng(2), token_scale=0.0)


def test_recipe_mix_load_raises_the_remixed_slices_load() -> None:
    base = RecipeConfig(deployments=(), mix_share=1.0, generated_share=0.0, family_share=0.0)
    traces = [load_trace(t) for t in base.traces]
    ratios = []
    for seed in range(6):
        one, two = (sample_episodes(replace(base, mix_load=(x, x)),
                                    np.random.default_rng(seed), 1, traces)[0][1]
                    for x in (1.0, 2.0))
        assert len(two) >= len(one)
        if "kept" in two.transforms[-1]:  # thinned at both loads
            ratios.append(len(two) / len(one))
    assert ratios and all(1.6 < r < 2.5 for r in ratios)
    with pytest.raises(ValueError, match="mix_load"):
        RecipeConfig(mix_load=(2.0, 1.0))


@pytest.mark.parametrize("text, expected", [("1,2.5", (1.0, 2.5)), ("2", (2.0, 2.0)),
                                            ("2,1", None), ("0,1", None), ("1,2,3", None)])
def test_train_mix_load_option(text: str, expected: tuple[float, float] | None,
                               capsys: pytest.CaptureFixture[str]) -> None:
    import train

    parser = train.build_parser()
    if expected is None:
        with pytest.raises(SystemExit):
            parser.parse_args(["--mix-load", text])
        assert "--mix-load" in capsys.readouterr().err
    else:
        assert parser.parse_args(["--mix-load", text]).mix_load == expected
    assert parser.parse_args([]).mix_load == (1.0, 1.0)
