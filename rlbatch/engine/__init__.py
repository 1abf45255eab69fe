"""Engines: the Engine protocol, its stats snapshot, the vLLM V1 simulator and live vLLM."""
