"""Traffic families: lengths as published, prefixes shared, specs parsed, drift in turn; the
family judge and the recipe's family episodes."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from policies.evaluation.families import (
    CONSTANTS,
    STATICS,
    Baselines,
    FamilyRun,
    evaluate_families,
    guarded_constants,
    judge_family,
    judge_settings,
    pick_constant,
)
from policies.training.episodes import (
    TRAINING_FAMILIES,
    draw_family,
    family_episode,
    sample_episodes,
)
from policies.training.recipe import RecipeConfig
from rlbatch.control.action_codec import TOTAL_LADDER
from rlbatch.control.controllers import make_controller
from rlbatch.control.types import SLA
from rlbatch.request import PREFIX_BLOCK_TOKENS
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.workload import resolve_workload
from rlbatch.workload.families import FAMILIES, chat_mix, drift, family_workload, rag, report_mix
from rlbatch.workload.lengths import DEFAULT_CONTEXT_TOKENS


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_is_deterministic_fits_the_context_and_runs_at_its_reference_rate(
        name: str) -> None:
    a = family_workload(name, 1.0, 600.0, seed=3)
    b = family_workload(name, 1.0, 600.0, seed=3)
    assert [(r.arrival_s, r.prompt_tokens, r.max_output_tokens, r.prefix_ids)
            for r in a.requests] == [(r.arrival_s, r.prompt_tokens, r.max_output_tokens,
                                      r.prefix_ids) for r in b.requests]
    assert family_workload(name, 1.0, 600.0, seed=4).requests != a.requests
    assert max(r.prompt_tokens + r.max_output_tokens for r in a.requests) <= (
        DEFAULT_CONTEXT_TOKENS)
    # bursty arrivals spend minutes in one state: rates over an hour
    hour = len(family_workload(name, 1.0, 3600.0, seed=3).requests)
    assert hour / 3600.0 == pytest.approx(FAMILIES[name].reference_rps, rel=0.15)
    assert len(family_workload(name, 2.0, 3600.0, seed=3).requests) == pytest.approx(
        2 * hour, rel=0.15)


def test_chat_is_short_prompts_long_answers_and_report_long_answers() -> None:
    rng = np.random.default_rng(0)
    prompts, outputs = chat_mix().sample(rng, 20_000)
    assert 60 <= np.median(prompts) <= 90 and 450 <= np.median(outputs) <= 520
    prompts, outputs = report_mix().sample(rng, 20_000)
    assert 1500 <= np.median(prompts) <= 2000 and 400 <= np.median(outputs) <= 500


def test_rag_requests_of_one_document_share_its_blocks_and_nothing_else() -> None:
    w = rag(5.0, 300.0, seed=1, documents=8)
    by_doc: dict[tuple[int, ...], list[int]] = {}
    for r in w.requests:
        assert r.prefix_ids is not None
        assert len(r.prefix_ids) == -(-r.prompt_tokens // PREFIX_BLOCK_TOKENS)
        by_doc.setdefault(r.prefix_ids[:-1], []).append(r.prefix_ids[-1])
    assert 1 < len(by_doc) <= 8
    last = [i for ids in by_doc.values() for i in ids]
    assert len(set(last)) == len(last)  # each question's block is its own
    counts = sorted((len(v) for v in by_doc.values()), reverse=True)
    assert counts[0] > 3 * counts[-1]  # Zipf: a hot document


def test_drift_serves_the_families_in_turn() -> None:
    w = drift(("code", "chat"), 1.0, 1200.0, 300.0, seed=2)
    for start, short_output in ((0, True), (300, False), (600, True), (900, False)):
        seg = [r for r in w.requests if start + 5 <= r.arrival_s < start + 295]
        median = float(np.median([r.max_output_tokens for r in seg]))
        assert (median < 40) == short_output, (start, median)


@pytest.mark.parametrize(("spec", "count"), [
    ("rag:load=1,duration=300", None),
    ("report:rate=2,duration=300", 600),
    ("drift:families=rag/report,load=0.5,duration=600,segment=200", None),
])
def test_specs_build_families(spec: str, count: int | None) -> None:
    w = resolve_workload(spec, 0)
    assert len(w.requests) > 0
    if count is not None:
        assert len(w.requests) == pytest.approx(count, rel=0.3)
    doubled = resolve_workload(spec, 0, rate_scale=2.0)
    assert len(doubled.requests) > 1.6 * len(w.requests)


@pytest.mark.parametrize(("spec", "message"), [
    ("code:duration=300", "exactly one of load and rate"),
    ("code:load=1,rate=2,duration=300", "exactly one of load and rate"),
    ("code:load=1,duration=300,mix=chat", "unknown key"),
    ("drift:families=code/poem,load=1,duration=300", "unknown family 'poem'"),
    ("drift:load=1,duration=300", "missing families"),
    ("rag:load=0,duration=300", "must be a finite number > 0"),
    ("chat:load=nan,duration=300", "must be a finite number > 0"),
])
def test_bad_family_specs_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_workload(spec, 0)


def test_mixes_of_the_families_are_generator_mixes() -> None:
    w = resolve_workload("poisson:rate=3,duration=300,mix=chat", 0)
    assert float(np.median([r.max_output_tokens for r in w.requests])) > 400


def _row(controller: str, goodput: float, sla: float, family: str = "code",
         load: float = 1.0, seed: int = 1, total: float = 16.0,
         buckets: dict[str, float] | None = None) -> dict[str, object]:
    per_bucket = {b: {"sla_attainment": v, "completed": 100, "rejected": 0}
                  for b, v in (buckets or {"0-1k": sla}).items()}
    return {"controller": controller, "goodput_rps": goodput, "sla_attainment": sla,
            "family": family, "load": load, "trace": f"{family}@{seed}", "seed": seed,
            "kv_overflows": 0, "fp8_token_share": 0.0, "max_num_seqs_median": total,
            "per_bucket": per_bucket}


def test_pick_constant_takes_the_best_mean_and_the_smaller_total_on_ties() -> None:
    rows = [_row(CONSTANTS[2], 1.0, 0.8), _row(CONSTANTS[2], 1.0, 0.5, load=1.2),
            _row(CONSTANTS[4], 1.5, 0.8), _row(CONSTANTS[4], 1.5, 0.5, load=1.2),
            _row(CONSTANTS[6], 1.5, 0.8), _row(CONSTANTS[6], 1.5, 0.5, load=1.2),
            _row("static:16", 9.0, 0.9)]
    assert pick_constant(rows) == CONSTANTS[4]
    with pytest.raises(ValueError, match="no constant"):
        pick_constant([_row("static:16", 1.0, 0.9)])


def test_judge_family_ratios_regimes_and_starved_buckets() -> None:
    rows = [
        # contested run: best static 2.0 (80%), candidate 2.2, mpc 2.0, the constant 1.1
        _row("static:16", 2.0, 0.8, buckets={"0-1k": 0.9, "1k-2k": 0.7}),
        _row("static:256", 1.0, 0.4),
        _row("cand", 2.2, 0.85, buckets={"0-1k": 0.95, "1k-2k": 0.6}),
        _row("mpc", 2.0, 0.8), _row("gradient", 2.2, 0.85),
        _row(CONSTANTS[2], 1.1, 0.5), _row(CONSTANTS[3], 2.75, 0.9),
        # light run: not counted in the geo-means
        _row("static:16", 1.0, 0.99, load=0.8), _row("cand", 0.5, 0.5, load=0.8),
        # another family: ignored
        _row("static:16", 1.0, 0.5, family="chat"), _row("cand", 9.0, 0.9, family="chat"),
    ]
    res = judge_family(rows, "cand", "code", CONSTANTS[2])
    s = res["summary"]
    assert (s["runs"], s["contested_runs"]) == (2, 1)
    assert s["vs_best_static_gmean"] == pytest.approx(1.1)
    assert s["vs_best_static_min"] == pytest.approx(1.1)
    assert s["vs_mpc_gmean"] == pytest.approx(1.1)
    assert s["vs_gradient_gmean"] == pytest.approx(1.0)
    assert s["vs_constant_gmean"] == pytest.approx(2.0)
    assert s["vs_best_constant_gmean"] == pytest.approx(0.8)
    assert s["runs_with_starved_bucket"] == 1  # 1k-2k: 60% against 70%
    assert s["must_met"] is False
    contested = next(v for v in res["runs"] if v["contested"])
    assert contested["best_constant"] == CONSTANTS[3]
    assert contested["starved"] == ["1k-2k"]
    fixed = [r if r["controller"] != "cand" or r["load"] != 1.0
             else _row("cand", 2.2, 0.85, buckets={"0-1k": 0.95, "1k-2k": 0.7}) for r in rows]
    assert judge_family(fixed, "cand", "code", CONSTANTS[2])["summary"]["must_met"] is True
    assert math.isnan(judge_family(rows, "cand", "rag", CONSTANTS[2])["summary"][
        "vs_best_static_gmean"])


def test_pick_constant_picks_among_the_constants_given() -> None:
    behind = guarded_constants("fixed:8[guard.tpot_fit=true]")
    rows = [_row(behind[1], 1.0, 0.8), _row(behind[3], 1.2, 0.8), _row(CONSTANTS[5], 9.0, 0.9)]
    assert pick_constant(rows, behind) == behind[3] and pick_constant(rows) == CONSTANTS[5]


def test_guarded_constants_carry_the_candidates_guard_settings() -> None:
    behind = guarded_constants("ppo:policies/default")
    assert [int(c.split("[")[0].removeprefix("fixed:")) for c in behind] == list(TOTAL_LADDER)
    policy = make_controller("ppo:policies/default").pipeline
    for spec in behind:
        assert spec.startswith("fixed:") and "order=deadline" in spec
        pipeline = make_controller(spec).pipeline
        assert policy is not None and pipeline is not None
        assert pipeline.config == replace(policy.config, ladder=tuple(policy.config.ladder))
        assert pipeline.order == "deadline"
    off = guarded_constants("fixed:8[guard.kv_budget=none,guard.p99=false]")
    pipeline = make_controller(off[0]).pipeline
    assert pipeline is not None and pipeline.config.kv_budget is None
    assert not pipeline.config.p99
    # no guard of its own: the plain constants are the ones
    for spec in ("fixed:8[order=deadline]", "fixed:8", "static:8", "mpc"):
        assert guarded_constants(spec) == (), spec


def test_judge_runs_name_every_static_and_constant_on_the_ladder() -> None:
    assert STATICS[0] == "static:4" and STATICS[-1] == "static:256"
    assert CONSTANTS[0] == "fixed:4[order=deadline]"
    assert FamilyRun("drift", 1.0, 7).spec(600.0) == (
        "drift:families=code/chat,load=1,duration=1200,segment=300")
    assert FamilyRun("code", 0.9, 7).label == "code@7"


def test_a_judge_on_an_earlier_judges_baselines_runs_only_the_candidates(tmp_path: Path) -> None:
    spec = DeploymentSpec(admission=AdmissionConfig(over_length="truncate"), sla=SLA(1.0, 0.05))
    small = {"families": ["code"], "loads": (1.0,), "seeds": (7001,), "training_seeds": (11,),
             "duration_s": 40.0, "n_jobs": 1, "quiet": True}
    judgement = evaluate_families(["fixed:8"], spec, **small)  # type: ignore[arg-type]
    full, constant = judgement.rows, judgement.constant
    assert judgement.guarded == {}
    path = tmp_path / "judge.json"
    path.write_text(json.dumps({"constant": constant, "rows": full, "settings": judge_settings(
        spec, 40.0, (11,))}))
    baselines = Baselines.load(path)
    assert len(baselines.rows) == len(STATICS) + len(CONSTANTS) + 2  # fixed:8 is no baseline
    judged = evaluate_families(["fixed:8", "fixed:12"], spec, baselines=baselines,
                               **small)  # type: ignore[arg-type]
    again = judged.rows
    assert judged.constant == constant and "### fixed:12" in judged.report

    def fixed8(rows: list[dict[str, Any]]) -> str:  # as text: NaN != NaN; wall time aside
        return json.dumps([{k: v for k, v in r.items() if k not in ("speedup_x",)
                            and not k.endswith("seconds")}
                           for r in rows if r["controller"] == "fixed:8"])

    assert fixed8(again) == fixed8(full)
    assert {r["controller"] for r in again} == {r["controller"] for r in full} | {"fixed:12"}
    with pytest.raises(ValueError, match="sla_tpot_s"):
        evaluate_families(["fixed:8"], replace(spec, sla=SLA(1.0, 0.1)), baselines=baselines,
                          **small)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no static:4 row for code@7002"):
        evaluate_families(["fixed:8"], spec, baselines=baselines,
                          **{**small, "seeds": (7002,)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pools"):
        evaluate_families(["fixed:8"], replace(spec, pools={"fp16": 2}), baselines=baselines,
                          **small)  # type: ignore[arg-type]
    for key, value in (("duration_s", 30.0), ("training_seeds", (12,))):
        with pytest.raises(ValueError, match=f"judged with {key}"):
            evaluate_families(["fixed:8"], spec, baselines=baselines,
                              **{**small, key: value})  # type: ignore[arg-type]
    # a file written before the settings were recorded: the request counts check the duration
    unrecorded = replace(baselines, settings=None)
    with pytest.raises(ValueError, match="another duration"):
        evaluate_families(["fixed:8"], spec, baselines=unrecorded,
                          **{**small, "duration_s": 30.0})  # type: ignore[arg-type]
    # the constants behind a candidate's own guard: run on the training and judged runs
    rule = "fixed:8[guard.tpot_fit=true]"
    behind = evaluate_families([rule, "fixed:12"], spec, baselines=baselines,
                               against_guard=True, **small)  # type: ignore[arg-type]
    constants, picked = behind.guarded[rule]
    assert list(behind.guarded) == [rule] and constants == guarded_constants(rule)
    assert picked in constants
    mine = {r["controller"]: r["goodput_rps"] for r in behind.rows}
    assert set(constants) <= set(mine) and len(behind.rows) == len(again) + len(constants)
    summary = behind.summaries([rule], ["code"])[0]
    run = judge_family(behind.rows, rule, "code", constant, constants, picked)["runs"][0]
    assert run["vs_guarded_constant"] == pytest.approx(mine[rule] / mine[picked])
    assert run["vs_best_guarded_constant"] == pytest.approx(
        mine[rule] / max(mine[c] for c in constants))
    assert run["best_guarded_constant"] in constants
    plain = judge_family(again, "fixed:12", "code", constant)["summary"]
    assert behind.summaries(["fixed:12"], ["code"])[0] == pytest.approx(plain, nan_ok=True)
    assert summary["candidate"] == rule
    assert f"Constant behind its guard picked on the training seeds: `{picked}`" in behind.report
    for text in ("{}", '{"constant": "c", "rows": [{"controller": "mpc"}]}', "[1]"):
        path.write_text(text)
        with pytest.raises(ValueError, match="not a family judge's --json"):
            Baselines.load(path)


def test_family_episodes_cover_every_family_and_only_when_asked() -> None:
    cfg = RecipeConfig(traces=(), family_share=1.0, episode_s=120.0, deployments=())
    rng = np.random.default_rng(0)
    names = {family_episode(cfg, rng, 1.0, draw_family(rng)).name.split("-")[0] for _ in range(60)}
    assert names == {"bursty", "poisson", "rag", "drift"}
    episodes = sample_episodes(cfg, np.random.default_rng(1), 4, [])
    assert len(episodes) == 4 and all(d == 0 for d, _ in episodes)
    plain = replace(cfg, family_share=0.0)
    drawn = sample_episodes(plain, np.random.default_rng(1), 4, [])
    assert all(w.name.split("-")[0] in {"bursty", "diurnal", "poisson"} for _, w in drawn)
    assert "drift" in TRAINING_FAMILIES


def test_recipe_refuses_bad_family_options() -> None:
    with pytest.raises(ValueError, match="family_share"):
        RecipeConfig(traces=(), family_share=1.5, deployments=())
    with pytest.raises(ValueError, match="family_loads"):
        RecipeConfig(traces=(), family_loads=(1.0, 0.5), deployments=())
