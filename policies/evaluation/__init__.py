"""Evaluation: the protocol that judges controllers on traffic they never trained on, and the
comparisons against the baselines."""
