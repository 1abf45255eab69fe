"""rlbatch: reinforcement-learning batch-size control for LLM serving on vLLM.

The core package (engines, simulator, workloads, metrics, admission, guard, sidecar) never
imports ``envs``, ``policies`` or the scripts; the scripts wire the pieces together.
"""

__version__ = "0.1.0"
