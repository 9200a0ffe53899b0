"""zerotier: train models larger than GPU memory on one node.

The names that need torch (initialize, Engine, plan, from_pretrained) are imported on first use
(PEP 562), so `import zerotier` alone stays light: `zerotier --help` must not load torch (cli/).
"""
__version__ = "0.1.0"

import importlib

from .errors import BudgetError, ConfigError, TierIOError, TrainingStopped, ZerotierError  # noqa: F401
from .config import Config  # noqa: E402,F401

_LAZY = {"Engine": "engine.engine", "initialize": "engine.engine", "from_pretrained": "pretrained", "plan": "planner.planning"}


def __getattr__(name: str):
    """A name of _LAZY from its module; else a submodule, as `import zerotier.x` would bind it."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    else:
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
