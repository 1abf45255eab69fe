"""Serving: admission, deployments of engines, the control loop and run metrics."""
