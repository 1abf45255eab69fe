"""Gymnasium environments over rlbatch engines (the env/guard issue fills this package)."""
