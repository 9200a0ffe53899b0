"""zerotier: train models larger than GPU memory on one node."""
__version__ = "0.1.0"

from .errors import BudgetError, ConfigError, TierIOError, ZerotierError  # noqa: F401
from .config import Config  # noqa: E402,F401
from .engine import Engine, initialize  # noqa: E402,F401
from .stop import TrainingStopped  # noqa: E402,F401
from .pretrained import from_pretrained  # noqa: E402,F401
from .planning import plan  # noqa: E402,F401
