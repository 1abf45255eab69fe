"""The tuning guide's benchmark checklist as a tool (command line: ``rlbatch sweep``).

Per ``(batch, seq_len)``: a fixed-length closed-loop run under ``static:batch`` reporting
tokens/s, requests/s, TTFT / TPOT / e2e percentiles, KV cache peak, preemptions, KV overflows
and the memory breakdown; plots; and verdicts on the guide's two production configurations.
Engines: the simulator (``sim``) or a live vLLM engine (``vllm``,
:mod:`rlbatch.tools.sweep.live`).

Public API: :func:`run_sweep` / :func:`run_spec` -> :class:`SweepResult` (``to_dict()`` is
the JSON document), :func:`render_markdown`, :func:`open_backend` (engine name ->
:class:`SweepBackend`). The command is :mod:`rlbatch.commands.sweep`.
"""

from rlbatch.tools.sweep.backend import BackendInfo, SweepBackend, SweepEngine
from rlbatch.tools.sweep.checklist import SweepResult, run_spec, run_sweep
from rlbatch.tools.sweep.engines import EngineSetup, SimBackend, engine_names, open_backend
from rlbatch.tools.sweep.guide import GUIDE_CONFIGS, GuideCheck, GuideConfig
from rlbatch.tools.sweep.markdown import render_markdown
from rlbatch.tools.sweep.memory import MemoryBreakdown, MemoryPlan, measured_breakdown, memory_plan
from rlbatch.tools.sweep.point import SweepPoint
from rlbatch.tools.sweep.recommend import SeqLenRecommendation
from rlbatch.tools.sweep.spec import LIVE_DEFAULTS, SIM_DEFAULTS, GridDefaults, SweepSLA, SweepSpec

__all__ = [
    "GUIDE_CONFIGS",
    "LIVE_DEFAULTS",
    "SIM_DEFAULTS",
    "BackendInfo",
    "EngineSetup",
    "GridDefaults",
    "GuideCheck",
    "GuideConfig",
    "MemoryBreakdown",
    "MemoryPlan",
    "SeqLenRecommendation",
    "SimBackend",
    "SweepBackend",
    "SweepEngine",
    "SweepPoint",
    "SweepResult",
    "SweepSLA",
    "SweepSpec",
    "engine_names",
    "measured_breakdown",
    "memory_plan",
    "open_backend",
    "render_markdown",
    "run_spec",
    "run_sweep",
]
