"""Benchmarks: scripts that print measured figures (ratios against a baseline run in the same
process), recorded in BENCHMARKS.md with their commands."""
