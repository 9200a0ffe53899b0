"""Overlap policies: what of a window's update runs during its last backward, or after its step."""
