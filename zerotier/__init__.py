"""zerotier: train models larger than GPU memory on one node."""
__version__ = "0.1.0"

from .errors import BudgetError, ConfigError, TierIOError, ZerotierError  # noqa: F401
