"""Every error zerotier raises on purpose derives from ZerotierError.

Messages follow one rule: say what happened, where (config path, file, offset,
tier), and what the user can do about it.
"""


class ZerotierError(Exception):
    """Base class of all errors raised by zerotier."""


class ConfigError(ZerotierError, ValueError):
    """A configuration key or value is invalid. The message names the key path."""


class BudgetError(ZerotierError, MemoryError):
    """A tier budget cannot hold what was asked of it."""


class TierIOError(ZerotierError, OSError):
    """An I/O operation on a tier failed (ENOSPC, EIO, short read, checksum...)."""


class NativeUnavailableError(ZerotierError, RuntimeError):
    """The native library was required but could not be loaded."""


class NativeError(ZerotierError, RuntimeError):
    """A native (C++) call failed; the message names the function and the native reason."""


class TrainingStopped(SystemExit):
    """Training stopped at a step boundary after SIGTERM / SIGINT / engine.request_stop()
    ([Note: graceful stop]). A SystemExit: uncaught, the process exits with `code`
    (128 + signal number, 0 for request_stop()); `checkpoint` is the checkpoint written, or None.
    Not a ZerotierError: a stop is no failure."""

    def __init__(self, message: str, code: int, checkpoint=None):
        super().__init__(code)
        self.message, self.checkpoint = message, checkpoint

    def __str__(self) -> str:
        return self.message
