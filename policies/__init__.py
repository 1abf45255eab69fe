"""Served controllers built on the rlbatch core: the rule baselines, ``fixed``, ``mpc`` and
trained policies (``ppo:PATH``), registered as ``rlbatch.controllers`` plugins.

Training lives in :mod:`policies.training`, evaluation in :mod:`policies.evaluation`; the
served controllers import neither (an import-linter contract).
"""
