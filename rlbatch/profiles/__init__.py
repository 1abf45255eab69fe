"""Hardware and model profiles and the simulator's step-time model.

Profiles are data: ``gpus/*.json`` and ``models/*.json`` ship with the package and a user adds
one by writing a JSON file and passing its path to :func:`load_gpu` / :func:`load_model`.
:class:`RooflineStepTimeModel` turns a (GPU, model, precision, TP) into the time of one vLLM
V1 iteration and the KV-cache capacity; its efficiency factors are fitted to measured GPU
timings (:mod:`rlbatch.profiles.fit`) and checked with :func:`profile_check`.
"""

from rlbatch.profiles.check import profile_check
from rlbatch.profiles.specs import (
    Efficiency,
    GpuSpec,
    ModelSpec,
    ProfileError,
    list_gpus,
    list_models,
    load_gpu,
    load_model,
)
from rlbatch.profiles.step_time import Precision, RooflineStepTimeModel, StepTimeModel

__all__ = [
    "Efficiency",
    "GpuSpec",
    "ModelSpec",
    "Precision",
    "ProfileError",
    "RooflineStepTimeModel",
    "StepTimeModel",
    "list_gpus",
    "list_models",
    "load_gpu",
    "load_model",
    "profile_check",
]
