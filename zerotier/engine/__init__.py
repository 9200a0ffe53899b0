"""The training engine: the façade (engine.py), the accumulation window, hooks and the parameter surface."""
