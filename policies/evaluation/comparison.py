"""The final comparison of a trained policy with every baseline on both shipped traces."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from policies.evaluation.compare import compare, format_verdicts, user_pick_static
from rlbatch.engine.config import parse_pools
from rlbatch.paths import traces_dir
from rlbatch.serving.admission import AdmissionConfig
from rlbatch.serving.deployment import DeploymentSpec
from rlbatch.tools.evaluate import EvalJob, run_jobs
from rlbatch.tools.report import format_table, write_json

BASELINES = ("static:4", "static:8", "static:16", "static:32", "static:64", "vllm-default",
             "playbook", "aimd")
MOONCAKE_RATES = (0.1, 0.25, 0.5)


def comparison_jobs(policy: Path, gpu: str, model: str, pools: str,
                    azure_rates: list[float],
                    mooncake_rates: tuple[float, ...] = MOONCAKE_RATES) -> list[EvalJob]:
    """Every baseline and ``ppo:policy`` on the Azure trace (training traffic) and the
    Mooncake trace (never trained on; prompts beyond the model's context are truncated and
    counted)."""
    spec = DeploymentSpec(gpu=gpu, model=model, pools=parse_pools(pools),
                          admission=AdmissionConfig(over_length="truncate"))
    controllers = [*BASELINES, f"ppo:{policy}"]
    jobs = []
    for trace, rates in ((traces_dir() / "azure_conv_2023.csv", azure_rates),
                         (traces_dir() / "mooncake_synthetic.jsonl", list(mooncake_rates))):
        for rate in rates:
            for c in controllers:
                jobs.append(EvalJob(c, str(trace), rate, replace(spec), None, None, 0, 600.0))
    return jobs


def final_comparison(policy: Path, cfg: Any, azure_rates: list[float], out: Path,
                     n_jobs: int = 2) -> str:
    """Run the comparison, write ``out/comparison.json`` and ``out/EVAL.md``; return the
    text to print."""
    rows = run_jobs(comparison_jobs(policy, cfg.gpu, cfg.model, cfg.pools, azure_rates),
                    n_jobs=n_jobs, desc="compare")
    candidate = f"ppo:{policy}"
    write_json(out / "comparison.json", rows)
    text = render(rows, candidate, policy, [Path(t).stem for t in cfg.traces])
    (out / "EVAL.md").write_text(text + "\n")
    return text


def render(rows: list[dict[str, Any]], candidate: str, policy: Path,
           training: list[str]) -> str:
    """Table of every run plus the verdicts per trace.

    :param training: names of the traces the policy was trained on (the user's static pick
        is made on them).
    """
    pick = user_pick_static(rows, training)
    parts = [f"# Evaluation of {policy}", "", "```", format_table(rows), "```", "",
             f"User's pick on the training traffic (best mean goodput on "
             f"{', '.join(training)}): {pick}.", ""]
    for trace in ("azure_conv_2023", "mooncake_synthetic"):
        subset = [r for r in rows if r["trace"] == trace]
        title = "training traffic" if trace in training else "never trained on"
        parts += [f"## {trace} ({title})", "",
                  format_verdicts(compare(subset, candidate, pick), "ppo", pick), ""]
    return "\n".join(parts)
