"""Experiments: diagnostic scripts that answered one question each (see README.md here)."""
