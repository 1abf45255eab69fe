"""The commands of ``rlbatch`` and their one-line help, readable without importing them.

The dispatcher (:mod:`rlbatch.commands.main`) lists every command from here and imports only
the module of the command being run, so ``rlbatch --help`` starts in a few tens of
milliseconds and ``rlbatch simulate`` never imports the live engine, the sweep or the sidecar.
"""

from __future__ import annotations

HELP: dict[str, str] = {
    "evaluate": "compare controllers on traces at several rate scales",
    "simulate": "one controller on one trace",
    "profile-check": "step-time model vs measured layer timings",
    "profile-fit": "fit a GPU profile to measured layer timings",
    "calibrate": "fit the simulator's step-time model to a live vLLM engine",
    "fidelity": "replay workloads on the live engine and the calibrated simulator",
    "sweep": "throughput-latency sweep over batch x sequence length",
    "serve": "the admission-control sidecar in front of vLLM (serve.py)",
    "train": "train a policy on the simulator and judge it (train.py)",
}
"""Command name -> its one-line help, in the order ``rlbatch --help`` lists them."""

OWN_PARSER: frozenset[str] = frozenset({"serve", "train"})
"""Commands that parse their own arguments (the same parser as ``serve.py`` / ``train.py``):
``rlbatch serve ARGS`` hands ``ARGS`` to it untouched."""
