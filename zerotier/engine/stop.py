"""Graceful stop: SIGTERM, SIGINT, SIGHUP or `engine.request_stop()` end training at a step boundary.

[Note: graceful stop]
SLURM and Kubernetes preempt with SIGTERM, then SIGKILL after a grace period. The signal
handler only records the request on every live engine; the engine acts where its state is a
completed step (`Engine._maybe_stop`):
  - at the end of a step that applied an update (engine.step(), engine.optimizer.step()),
  - with one rank, also when a forward would begin a new accumulation window (a signal that
    lands while the loop loads data does not cost another step), unless objects are registered
    for checkpointing ([Note: what a checkpoint carries] in carried.py).
A window in progress is finished, never abandoned: its units may already be updated during
backward ([Note: early step]), so only its end is consistent.
With several ranks, stopping is a collective decision: the request rides in the all-reduce
(MAX) each window already makes (Sharding.agree), so every rank stops after the same step
(one rank's signal stops all) at no extra cost. The stop: a checkpoint to
train.checkpoint_on_signal when set (collective), close() (the run directory is removed; the
weights are not put back into the model when the checkpoint holds them), then
TrainingStopped, a SystemExit: exit status 128 + the signal's number (0 for request_stop()),
and the reason on stderr.
SIGHUP (the terminal or ssh session that started the run closed) is handled as SIGTERM: the
run directory is removed and the exit status is 128 + 1.
A second SIGINT, SIGTERM or SIGHUP interrupts at once (KeyboardInterrupt / the default action), so a
hung run can still be stopped. Handlers are installed from the main thread only, and only
over the default ones: a handler the user installed is left alone (call
engine.request_stop() from it). When the last engine closes, the previous handlers return.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import weakref

# SIGHUP: the terminal or ssh session went away (nohup not used); a stop like SIGTERM's.
SIGNALS = (signal.SIGTERM, signal.SIGINT) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())
REQUEST = 1  # the stop code of engine.request_stop(); a signal's is 1 + its number (SIGHUP is 1)


def signal_code(signum: int) -> int:
    """The stop code of signal `signum` (> REQUEST; the largest code of all ranks wins)."""
    return signum + 1

_engines: "weakref.WeakSet" = weakref.WeakSet()
_previous: dict[int, object] = {}  # signal -> the handler ours replaced (installed while non-empty)
_received: set[int] = set()         # signals handled since ours were installed
_lock = threading.Lock()


def describe(code: int) -> str:
    if code == REQUEST:
        return "engine.request_stop()"
    try:
        return signal.Signals(code - 1).name
    except ValueError:
        return f"signal {code - 1}"


def exit_status(code: int) -> int:
    return 0 if code == REQUEST else 128 + code - 1


def register(engine) -> None:
    """Deliver SIGTERM / SIGINT to `engine` from now until unregister(engine)."""
    with _lock:
        if not any(not e.closed for e in _engines):
            # a stop asked of engines that are gone (closed, or dropped without close() and collected,
            # which never unregisters) is over: this engine's first signal is a first one
            _received.clear()
        _engines.add(engine)
        if _previous or threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            current = signal.getsignal(sig)
            if current in (signal.SIG_DFL, signal.default_int_handler):
                _previous[sig] = current
                signal.signal(sig, _handle)


def unregister(engine) -> None:
    with _lock:
        _engines.discard(engine)
        if not _engines:
            _restore()


def _restore() -> None:
    """Put back the handlers ours replaced (where ours is still the one installed)."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal works only there; the handler passes signals on when no engine is left
    for sig, previous in list(_previous.items()):
        if signal.getsignal(sig) is _handle:
            signal.signal(sig, previous)
        del _previous[sig]
    _received.clear()


def _handle(signum: int, frame) -> None:
    live = [e for e in list(_engines) if not e.closed]
    if not live or _received:  # nothing to stop gracefully, or asked twice: act as if we were not here
        previous = _previous.get(signum, signal.SIG_DFL)
        _restore()
        if previous is signal.default_int_handler:
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)  # the default action, now that ours is gone
        return
    _received.add(signum)
    for engine in live:
        engine.request_stop(signal_code(signum))
    where = {e.cfg.train.checkpoint_on_signal for e in live} - {None}
    print(f"zerotier: {describe(signal_code(signum))} received: stopping after the current step"
          + (f", checkpoint to {', '.join(sorted(where))}" if where else " (no checkpoint: set "
             "train.checkpoint_on_signal to write one)")
          + f"; send {describe(signal_code(signum))} again to stop at once", file=sys.stderr, flush=True)
