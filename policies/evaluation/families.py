"""Judge controllers per traffic family: does the controller read the traffic?

For every family of :mod:`rlbatch.workload.families` (and a drift between code completion and
chat) at loads around its knee, on validation seeds no recipe draws, every candidate runs
beside the static caps 4-256 and the constant totals in deadline order
(``fixed:N[order=deadline]``, N on the same ladder). Per family, over the contested runs (the
hindsight-best static meets the SLA for 20-95%):

* goodput against the hindsight-best static (geo-mean and worst run), against ``mpc`` and the
  hand-built adaptive rule (``gradient``) when they are among the candidates;
* against **the best constant controller**: the ``fixed:N[order=deadline]`` with the best mean
  goodput over the training seeds' runs of every family (N picked on training traffic, one N
  for the deployment), and the hindsight-best constant of each run;
* with ``--guarded-constants``, the same two against the constants behind **the candidate's
  own guard** (``fixed:N[order=deadline,guard.…]`` with every guard setting of the candidate
  that differs from the constants'): what the learning adds over the rules the candidate is
  served behind, the learning claim. A guard rule that reads the traffic (``tpot_fit``) helps
  a constant as much as a policy;
* buckets more than 5 points under the best static's SLA attainment, KV overflows, and the
  FP8 pool's token share (two engines: both used);
* the median total in force (``max_num_seqs``) per family: a controller that reads the traffic
  moves it between families.

    python -m policies.evaluation.families --controllers 'ppo:policies/default,gradient' \\
        --markdown families.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from policies.evaluation.compare import CONTESTED, gmean, goodput_ratio, starved_buckets
from policies.evaluation.protocol import deployment_rate_scale
from rlbatch.commands.options import (
    CONTROLLER_HELP,
    add_deployment_options,
    add_settings_option,
    controllers_from_args,
    deployment_spec_from_args,
)
from rlbatch.control.action_codec import TOTAL_LADDER
from rlbatch.control.controllers import make_controller
from rlbatch.control.guard_record import GUARD_REVISION
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.settings import override_items
from rlbatch.tools.evaluate import EvalJob, run_jobs
from rlbatch.workload.families import FAMILIES

STATICS = tuple(f"static:{n}" for n in TOTAL_LADDER)
CONSTANTS = tuple(f"fixed:{n}[order=deadline]" for n in TOTAL_LADDER)
LOADS = (0.8, 0.9, 1.0, 1.1, 1.2)
VALIDATION_SEEDS = (7001, 7002)
"""Seeds of the judged runs: the recipe draws its generator seeds from its own generator
(``rng.integers(2**31)``), never these fixed ones."""
TRAINING_SEEDS = (11,)
"""Seeds of the runs the constant is picked on."""
DRIFT = "drift"
REFERENCES = ("mpc", "gradient")
"""Adaptive references every candidate is judged against (run on every judged workload)."""


@dataclass(frozen=True)
class FamilyRun:
    """One judged workload: a family at a load (in its reference units) and a seed."""

    family: str
    load: float
    seed: int

    @property
    def label(self) -> str:
        return f"{self.family}@{self.seed}"

    def spec(self, duration_s: float) -> str:
        if self.family == DRIFT:
            return (f"drift:families=code/chat,load=1,duration={2 * duration_s:g},"
                    f"segment={duration_s / 2:g}")
        return f"{self.family}:load=1,duration={duration_s:g}"


def family_runs(families: Sequence[str], loads: Sequence[float], seeds: Sequence[int]
                ) -> list[FamilyRun]:
    return [FamilyRun(f, load, s) for f in families for s in seeds for load in loads]


def family_jobs(controllers: Sequence[str], runs: Sequence[FamilyRun], spec: DeploymentSpec,
                rate_scale: float, duration_s: float) -> list[EvalJob]:
    return [EvalJob(c, r.spec(duration_s), r.load * rate_scale, replace(spec), None, None,
                    r.seed, 600.0) for r in runs for c in controllers]


def _label(rows: list[dict[str, Any]], jobs: Sequence[EvalJob], runs: Sequence[FamilyRun],
           n_controllers: int) -> list[dict[str, Any]]:
    for i, (row, job) in enumerate(zip(rows, jobs, strict=True)):
        run = runs[i // n_controllers]
        row.update(family=run.family, load=run.load, seed=job.seed, trace=run.label)
    return rows


def _goodput(row: dict[str, Any]) -> float:
    return float(row["goodput_rps"] or 0.0)


def pick_constant(training_rows: Sequence[dict[str, Any]],
                  constants: Sequence[str] = CONSTANTS) -> str:
    """The constant (one per total of the ladder, in its order) with the best mean goodput
    over the training runs of every family (ties: the smaller N).

    :param training_rows: the training runs' rows.
    :param constants: the constants to pick from, one per :data:`TOTAL_LADDER` total.
    """
    goodput: dict[str, list[float]] = defaultdict(list)
    for row in training_rows:
        if row["controller"] in constants:
            goodput[row["controller"]].append(_goodput(row))
    if not goodput:
        raise ValueError("no constant-controller runs to pick from")
    return max(goodput, key=lambda c: (statistics.fmean(goodput[c]),
                                       -TOTAL_LADDER[list(constants).index(c)]))


def guarded_constants(candidate: str) -> tuple[str, ...]:
    """The constants behind ``candidate``'s guard: ``fixed:N[order=deadline,guard.…]`` for
    every N of the ladder, with each guard setting of the candidate that differs from the
    constants' own; empty when the candidate has no guard or the constants' one (the plain
    constants are then the same controllers).

    :param candidate: a controller spec.
    :raises ValueError: a bad spec.
    """
    pipeline = make_controller(candidate).pipeline
    base = make_controller(CONSTANTS[-1]).pipeline
    if pipeline is None or base is None:
        return ()
    items = override_items(pipeline.config, base.config, "guard.")
    if not items:
        return ()
    return tuple(f"fixed:{n}[order=deadline,{','.join(items)}]" for n in TOTAL_LADDER)


def judge_family(rows: Sequence[dict[str, Any]], candidate: str, family: str,
                 constant: str, guarded: Sequence[str] = (),
                 guarded_constant: str | None = None) -> dict[str, Any]:
    """The checks of one candidate on one family's runs (see the module docstring).

    :param rows: the judged rows.
    :param candidate: the candidate's controller name.
    :param family: the family.
    :param constant: the constant picked on training traffic.
    :param guarded: the constants behind the candidate's guard (:func:`guarded_constants`;
        empty: not judged against them).
    :param guarded_constant: the one of them picked on training traffic.
    """
    by_run: dict[tuple[str, float], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        if row["family"] == family:
            by_run[(row["trace"], float(row["load"]))][row["controller"]] = row
    runs = []
    for (trace, load), r in sorted(by_run.items()):
        if candidate not in r:
            continue
        statics = [r[s] for s in STATICS if s in r]
        best = max(statics, key=_goodput)
        mine = r[candidate]
        constants = [r[c] for c in CONSTANTS if c in r]
        best_constant = max(constants, key=_goodput) if constants else None
        behind = [r[c] for c in guarded if c in r]
        best_behind = max(behind, key=_goodput) if behind else None
        runs.append({
            "trace": trace, "load": load,
            "contested": CONTESTED[0] <= float(best["sla_attainment"] or 0) <= CONTESTED[1],
            "best_static": best["controller"], "best_static_sla": best["sla_attainment"],
            "goodput_rps": _goodput(mine), "sla_attainment": mine["sla_attainment"],
            "vs_best_static": goodput_ratio(mine, best),
            "vs_mpc": goodput_ratio(mine, r.get("mpc")),
            "vs_gradient": goodput_ratio(mine, r.get("gradient")),
            "vs_constant": goodput_ratio(mine, r.get(constant)),
            "best_constant": None if best_constant is None else best_constant["controller"],
            "vs_best_constant": goodput_ratio(mine, best_constant),
            "vs_guarded_constant": goodput_ratio(
                mine, None if guarded_constant is None else r.get(guarded_constant)),
            "best_guarded_constant": None if best_behind is None else best_behind["controller"],
            "vs_best_guarded_constant": goodput_ratio(mine, best_behind),
            "starved": starved_buckets(mine, best),
            "kv_overflows": int(mine["kv_overflows"] or 0),
            "fp8_token_share": mine.get("fp8_token_share"),
            "total_median": mine.get("max_num_seqs_median"),
        })
    contested = [v for v in runs if v["contested"]]

    def over(key: str) -> float:
        return gmean([v[key] for v in contested])

    summary = {
        "family": family, "candidate": candidate, "runs": len(runs),
        "contested_runs": len(contested),
        "vs_best_static_gmean": over("vs_best_static"),
        "vs_best_static_min": min((v["vs_best_static"] for v in contested), default=math.nan),
        "vs_mpc_gmean": over("vs_mpc"), "vs_gradient_gmean": over("vs_gradient"),
        "vs_constant_gmean": over("vs_constant"),
        "vs_best_constant_gmean": over("vs_best_constant"),
        "vs_guarded_constant_gmean": over("vs_guarded_constant"),
        "vs_best_guarded_constant_gmean": over("vs_best_guarded_constant"),
        "runs_with_starved_bucket": sum(1 for v in contested if v["starved"]),
        "kv_overflows": sum(v["kv_overflows"] for v in runs),
        "total_median": statistics.median(
            [v["total_median"] for v in runs if v["total_median"] is not None]
            or [math.nan]),
        "fp8_token_share_min": min((float(v["fp8_token_share"]) for v in contested
                                    if v["fp8_token_share"] is not None), default=math.nan),
    }
    summary["must_met"] = bool(
        contested and summary["vs_best_static_gmean"] >= 1.0
        and summary["vs_best_static_min"] >= 0.97
        and all(not summary[k] < 1.0 for k in ("vs_mpc_gmean", "vs_gradient_gmean"))
        and summary["runs_with_starved_bucket"] == 0 and summary["kv_overflows"] == 0)
    return {"summary": summary, "runs": runs}


def _cell(x: float, suffix: str = "x") -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.2f}{suffix}"


def render(rows: Sequence[dict[str, Any]], candidates: Sequence[str], families: Sequence[str],
           constant: str, guarded: Mapping[str, tuple[tuple[str, ...], str]] | None = None
           ) -> str:
    """Markdown: one table of per-family summaries per candidate, then the runs.

    :param guarded: per candidate, the constants behind its guard and the one picked
        (:attr:`Judgement.guarded`; the columns show ``-`` for a candidate without).
    """
    guarded = guarded or {}
    behind_note = (" Behind its guard: the constants with the candidate's guard settings "
                   "(`--guarded-constants`), the one picked on the training seeds and the "
                   "hindsight best of each run." if guarded else "")
    out = [f"Constant picked on the training seeds: `{constant}`. Contested: the best static "
           f"meets the SLA for {100 * CONTESTED[0]:.0f}-{100 * CONTESTED[1]:.0f}%. Ratios are "
           f"geo-means of goodput over the contested runs.{behind_note}", ""]
    for cand in candidates:
        behind, picked = guarded.get(cand, ((), None))
        out += [f"### {cand}", ""]
        if picked is not None:
            out += [f"Constant behind its guard picked on the training seeds: `{picked}`.", ""]
        out += ["| family | contested | vs best static | worst | vs mpc | vs gradient | "
                "vs constant | vs best constant (hindsight) | vs constant behind its guard | "
                "(hindsight) | starved runs | KV overflows | median total | must |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        detail = []
        for family in families:
            res = judge_family(rows, cand, family, constant, behind, picked)
            s = res["summary"]
            out.append(
                f"| {family} | {s['contested_runs']}/{s['runs']} | "
                f"{_cell(s['vs_best_static_gmean'])} | {_cell(s['vs_best_static_min'])} | "
                f"{_cell(s['vs_mpc_gmean'])} | {_cell(s['vs_gradient_gmean'])} | "
                f"{_cell(s['vs_constant_gmean'])} | {_cell(s['vs_best_constant_gmean'])} | "
                f"{_cell(s['vs_guarded_constant_gmean'])} | "
                f"{_cell(s['vs_best_guarded_constant_gmean'])} | "
                f"{s['runs_with_starved_bucket']} | {s['kv_overflows']} | "
                f"{_cell(s['total_median'], '')} | {'met' if s['must_met'] else 'NOT met'} |")
            detail += [
                f"| {v['trace']} | {v['load']:g} | "
                f"{'contested' if v['contested'] else '-'} | {v['best_static']} "
                f"({100 * float(v['best_static_sla'] or 0):.0f}%) | {v['goodput_rps']:.2f} | "
                f"{_cell(v['vs_best_static'])} | {v['best_constant']} | "
                f"{_cell(v['vs_best_constant'])} | {_cell(v['vs_best_guarded_constant'])} | "
                f"{_cell(v['total_median'], '')} | {', '.join(v['starved']) or '-'} |"
                for v in res["runs"]]
        out += ["", "| run | load | regime | best static | goodput/s | vs best static | "
                "best constant | vs it | vs best behind its guard | median total | starved |",
                "|---|---:|---|---|---:|---:|---|---:|---:|---:|---|", *detail, ""]
    return "\n".join(out)


BASELINES = (*STATICS, *CONSTANTS, *REFERENCES)
"""The controllers every judge runs beside its candidates."""


@dataclass(frozen=True)
class Baselines:
    """An earlier judge's baseline rows and constant (its ``--json``), reused for new
    candidates on the same runs: the statics, constants and references take most of a
    judge's time (``mpc`` plans by rollouts) and give the same rows every time.

    :param rows: the earlier judge's rows.
    :param constant: the constant it picked on its training seeds.
    :param settings: what it was run with (:func:`judge_settings`; ``None`` in files written
        before it was recorded: the runs' request counts are then the check on the duration).
    """

    rows: tuple[dict[str, Any], ...]
    constant: str
    settings: dict[str, Any] | None = None

    @classmethod
    def load(cls, path: Path) -> Baselines:
        """:raises ValueError: not a family judge's JSON."""
        try:
            data = json.loads(path.read_text())
            rows, constant = data["rows"], str(data["constant"])
            settings = data.get("settings")
            kept = tuple(r for r in rows if r.get("controller") in BASELINES)
            if not all({"family", "load", "seed"} <= r.keys() for r in kept):
                raise ValueError("rows without their family, load and seed")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a family judge's --json ({e!r})") from None
        return cls(kept, constant, settings if isinstance(settings, dict) else None)

    def check_settings(self, settings: dict[str, Any]) -> None:
        """:raises ValueError: the baselines were run with other settings."""
        if self.settings is None:
            return
        for key, value in settings.items():
            if key in self.settings and not _same(self.settings[key], value):
                raise ValueError(f"the baselines were judged with {key}={self.settings[key]!r}, "
                                 f"this judge has {value!r}: judge in full")

    def for_runs(self, runs: Sequence[FamilyRun], spec: DeploymentSpec,
                 rate_scale: float) -> list[dict[str, Any]]:
        """The baseline rows of ``runs``, every one of them.

        :raises ValueError: a run or a baseline missing, or rows of another deployment, SLA
            or load.
        """
        have = {(r["family"], float(r["load"]), int(r["seed"]), r["controller"]): r
                for r in self.rows}
        out = []
        for run_ in runs:
            for c in BASELINES:
                row = have.get((run_.family, run_.load, run_.seed, c))
                if row is None:
                    raise ValueError(f"the baselines have no {c} row for {run_.label} at load "
                                     f"{run_.load:g}: judge that run in full")
                expected = {"gpu": spec.gpu, "model": spec.model,
                            "pools": ",".join(f"{p}:{n}" for p, n in spec.pools.items()),
                            "sla_ttft_s": spec.sla.ttft_s, "sla_tpot_s": spec.sla.tpot_s,
                            "rate_scale": run_.load * rate_scale}
                for key, value in expected.items():
                    if not _same(row.get(key), value):
                        raise ValueError(f"the baselines' {c} row for {run_.label} has "
                                         f"{key}={row.get(key)!r}, this judge {value!r}")
                out.append(row)
        return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def judge_settings(spec: DeploymentSpec, duration_s: float,
                   training_seeds: Sequence[int]) -> dict[str, Any]:
    """What a judge's ``--json`` records of how it ran, beyond what each row says: checked
    when a later judge reuses it as baselines."""
    return {"duration_s": duration_s, "training_seeds": list(training_seeds),
            "guard_revision": GUARD_REVISION, "tp": spec.tp,
            "max_num_seqs": spec.max_num_seqs,
            "max_num_batched_tokens": spec.max_num_batched_tokens, "tick_s": spec.tick_s,
            "clients": str(spec.clients)}


@dataclass(frozen=True)
class Judgement:
    """What a family judge gives.

    :param rows: the judged rows (baselines, candidates and the constants behind their
        guards).
    :param constant: the constant picked on the training seeds.
    :param guarded: per candidate with a guard of its own, the constants behind it
        (:func:`guarded_constants`) and the one picked on the training seeds.
    :param report: the Markdown report.
    """

    rows: list[dict[str, Any]]
    constant: str
    guarded: dict[str, tuple[tuple[str, ...], str]]
    report: str

    def summaries(self, candidates: Sequence[str], families: Sequence[str]
                  ) -> list[dict[str, Any]]:
        """Every candidate's summary on every family (:func:`judge_family`)."""
        return [judge_family(self.rows, c, f, self.constant, *self.guarded.get(c, ((), None)))
                ["summary"] for c in candidates for f in families]


def evaluate_families(candidates: Sequence[str], spec: DeploymentSpec, *,
                      families: Sequence[str], loads: Sequence[float] = LOADS,
                      seeds: Sequence[int] = VALIDATION_SEEDS,
                      training_seeds: Sequence[int] = TRAINING_SEEDS,
                      duration_s: float = 600.0, rate_scale: float = 1.0, n_jobs: int = 2,
                      quiet: bool = False, baselines: Baselines | None = None,
                      against_guard: bool = False) -> Judgement:
    """Run the training runs (for the constant) and the judged runs. With ``baselines`` only
    the candidates run and the baselines' rows and constant stand for the rest; each
    candidate's run must have been given the same requests as the baselines' (checked). With
    ``against_guard`` the constants behind each candidate's guard run too, on the training
    seeds (to pick one) and on the judged runs.

    :raises ValueError: the baselines do not cover the runs (:meth:`Baselines.for_runs`).
    """
    judged_runs = family_runs(families, loads, seeds)
    train_runs = family_runs(families, loads, training_seeds)
    behind = {c: guarded_constants(c) for c in candidates} if against_guard else {}
    extra = list(dict.fromkeys(k for ks in behind.values() for k in ks))
    if baselines is not None:
        baselines.check_settings(judge_settings(spec, duration_s, training_seeds))
        reused = baselines.for_runs(judged_runs, spec, rate_scale)
        controllers = list(dict.fromkeys([*(c for c in candidates if c not in BASELINES),
                                           *extra]))
        train_controllers = extra
        constant: str | None = baselines.constant
    else:
        reused = []
        controllers = list(dict.fromkeys([*BASELINES, *candidates, *extra]))
        train_controllers = [*CONSTANTS, *extra]
        constant = None
    train_jobs = family_jobs(train_controllers, train_runs, spec, rate_scale, duration_s)
    judged_jobs = family_jobs(controllers, judged_runs, spec, rate_scale, duration_s)
    done = run_jobs([*train_jobs, *judged_jobs], n_jobs=n_jobs, quiet=quiet, desc="families")
    train_rows = _label(done[:len(train_jobs)], train_jobs, train_runs, len(train_controllers))
    rows = _label(done[len(train_jobs):], judged_jobs, judged_runs, len(controllers))
    if reused:
        submitted = {(r["trace"], float(r["load"])): r["submitted"] for r in reused}
        for row in rows:
            if row["submitted"] != submitted[(row["trace"], float(row["load"]))]:
                raise ValueError(f"{row['controller']} on {row['trace']} at load "
                                 f"{row['load']:g} was given {row['submitted']} requests, the "
                                 f"baselines {submitted[(row['trace'], float(row['load']))]}: "
                                 f"another duration or workload; judge in full")
    judged = [*reused, *rows]
    if constant is None:
        constant = pick_constant(train_rows)
    guarded = {c: (ks, pick_constant(train_rows, ks)) for c, ks in behind.items() if ks}
    return Judgement(judged, constant, guarded,
                     render(judged, candidates, families, constant, guarded))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m policies.evaluation.families",
        description="Judge controllers per traffic family (chat, code, rag, report, drift) on "
        "validation seeds against the static caps, the constant totals in deadline order, "
        "mpc and gradient: does the controller read the traffic?",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--controllers", required=True,
                   help=f"comma-separated candidates, each {CONTROLLER_HELP}")
    add_settings_option(p)
    p.add_argument("--families", default=",".join([*FAMILIES, DRIFT]),
                   help="families to judge (drift: code and chat in turn)")
    p.add_argument("--loads", type=_floats, default=LOADS,
                   help="loads in each family's reference units (1: its knee on A100 / "
                        "Llama-2-7B)")
    p.add_argument("--seeds", type=_ints, default=VALIDATION_SEEDS, help="judged seeds")
    p.add_argument("--training-seeds", type=_ints, default=TRAINING_SEEDS,
                   help="seeds the constant is picked on")
    p.add_argument("--duration-s", type=float, default=600.0,
                   help="seconds of arrivals per run (drift: twice as long)")
    p.add_argument("--rate-scale", type=float, default=None, metavar="X",
                   help="multiply every load by X; default: the measured one for the "
                        "deployment (DEPLOYMENT_RATE_SCALES)")
    p.add_argument("--json", type=Path, help="write the judged rows and summaries here")
    p.add_argument("--markdown", type=Path, help="write the report here")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--baselines", type=Path, metavar="JSON",
                   help="an earlier judge's --json on the same deployment, SLA, loads, seeds "
                        "and duration: its statics, constants, mpc and gradient rows and its "
                        "constant are reused and only the candidates run (minutes instead of "
                        "half an hour)")
    p.add_argument("--guarded-constants", action="store_true",
                   help="also judge each candidate against the constant totals behind its "
                        "own guard (fixed:N[order=deadline,guard...] with the candidate's "
                        "guard settings; N picked on the training seeds, and the hindsight "
                        "best of each run): what learning adds over the rules it is served "
                        "behind (the ladder's 12 constants more on the training and judged "
                        "runs)")
    add_deployment_options(p)
    p.set_defaults(over_length="truncate")
    args = p.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    for f in families:
        if f not in FAMILIES and f != DRIFT:
            p.error(f"unknown family {f!r}; choose from {', '.join([*FAMILIES, DRIFT])}")
    try:
        candidates = controllers_from_args(args.controllers, args.settings)
        spec = deployment_spec_from_args(args)
    except ValueError as e:
        p.error(str(e))
    scale = (args.rate_scale if args.rate_scale is not None
             else deployment_rate_scale(spec.gpu, spec.model, spec.pools))
    try:
        baselines = None if args.baselines is None else Baselines.load(args.baselines)
        judgement = evaluate_families(
            candidates, spec, families=families, loads=args.loads, seeds=args.seeds,
            training_seeds=args.training_seeds, duration_s=args.duration_s, rate_scale=scale,
            n_jobs=args.jobs, quiet=args.quiet, baselines=baselines,
            against_guard=args.guarded_constants)
    except ValueError as e:
        p.error(str(e))
    print(judgement.report)
    if args.markdown:
        args.markdown.write_text(judgement.report + "\n")
    if args.json:
        settings = judge_settings(spec, args.duration_s, args.training_seeds)
        args.json.write_text(json.dumps(
            {"constant": judgement.constant, "settings": settings,
             "guarded_constants": {c: picked for c, (_, picked) in judgement.guarded.items()},
             "summaries": judgement.summaries(candidates, families), "rows": judgement.rows},
            indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
