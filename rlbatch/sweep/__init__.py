"""The tuning guide's benchmark checklist as a tool: ``python -m rlbatch sweep``.

Per ``(batch, seq_len)``: a fixed-length closed-loop run under ``static:batch`` reporting
tokens/s, requests/s, TTFT / TPOT / e2e percentiles, KV cache peak, preemptions, KV overflows
and the memory breakdown; plots; and verdicts on the guide's two production configurations.

Public API: :func:`run_sweep` -> :class:`SweepResult` (``to_dict()`` is the JSON document),
:func:`add_arguments` / :func:`run` for the project CLI, :func:`render_markdown`,
:func:`register_engine` for the live vLLM backend.
"""

from rlbatch.sweep.cli import add_arguments, main, run
from rlbatch.sweep.engines import EngineSetup, SweepEngine, engine_names, register_engine
from rlbatch.sweep.guide import GUIDE_CONFIGS, GuideCheck, GuideConfig
from rlbatch.sweep.markdown import render_markdown
from rlbatch.sweep.memory import MemoryBreakdown, MemoryPlan, memory_plan
from rlbatch.sweep.point import SweepPoint
from rlbatch.sweep.recommend import SeqLenRecommendation
from rlbatch.sweep.spec import SweepSLA, SweepSpec
from rlbatch.sweep.sweep import SweepResult, run_spec, run_sweep

__all__ = [
    "GUIDE_CONFIGS",
    "EngineSetup",
    "GuideCheck",
    "GuideConfig",
    "MemoryBreakdown",
    "MemoryPlan",
    "SeqLenRecommendation",
    "SweepEngine",
    "SweepPoint",
    "SweepResult",
    "SweepSLA",
    "SweepSpec",
    "add_arguments",
    "engine_names",
    "main",
    "memory_plan",
    "register_engine",
    "render_markdown",
    "run",
    "run_spec",
    "run_sweep",
]
