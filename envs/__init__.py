"""Gymnasium environments over rlbatch engines; importing registers them."""

from gymnasium.envs.registration import register, registry

from envs.batch_size import BatchSizeEnv

ENV_ID = "rlbatch/BatchSize-v0"

if ENV_ID not in registry:
    register(id=ENV_ID, entry_point="envs.batch_size:BatchSizeEnv", max_episode_steps=1000)

__all__ = ["ENV_ID", "BatchSizeEnv"]
