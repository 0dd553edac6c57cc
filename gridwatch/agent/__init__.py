"""The node agent: sources, detectors, actions, the SSH subsystem and /metrics."""
