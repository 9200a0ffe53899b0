"""Integrations with other libraries' training loops (each module imports its library lazily)."""
