"""Controllers built on the rlbatch core: rule baselines and PPO (later issues fill this)."""
