"""Tools built on serving: evaluation, sweep, calibration, fidelity."""
