"""Which thread may mutate which state: the roles, and the `ZEROTIER_CHECK_THREADS=1` check.

[Note: thread ownership]
zerotier runs on a handful of threads, each with one role:

  compute    the thread that calls the engine (forward, engine.backward/step, the plain
             loop) and autograd's threads, which run the module and gradient hooks
  optimizer  `zerotier-optim`: the early and speculative updates during backward ([Note: early
             step], [Note: speculative step]) and the delayed update during the next window
  fetch      `zerotier-fetch-*`: NVMe reads and H2D copies of parameter prefetches
  grad-add   `zerotier-grad-*`: host adds of offloaded gradients (CUDA, host gradients)
  grad-io    `zerotier-grad-io-*`: folds of gradients into their NVMe files
  io         completion threads of the NVMe engine (`zt-aio-*`, the native engine's)

Every piece of a store's state has one owner role (the table in docs/design.md,
"Threads"). A worker never mutates a store: it returns its result through a ticket
or a future (a fetch's copy ticket, an add's future, a fold's future), and the owner
applies it. The exceptions are structures made for sharing, each under its own
lock: HostPool, DeviceTier's budget, NVMeStore, and under ParamStore's `_lock` its slots'
`fetch` and `failed_write` and its write-back tickets (`WriteBacks.tickets`).

One role moves: the *updater*, which runs Adam and commits the new parameters
(UnitOptimizer, ParamStore's write-back state, a unit's READY/STEPPED gradient
state). It is the compute thread, except from an early or speculative update's
submission until the compute thread has waited for its future (`OverlapPolicy.on_optimizer_thread`
-> `OverlapPolicy.wait` / `quiesce`), and from a delayed update's launch until the next
step publishes it (`overlap.delayed.Delayed`, a whole window), when it is the optimizer thread. `hand()`
records each such handoff.

With `ZEROTIER_CHECK_THREADS=1` (read once, at import) every mutating method decorated
with `@owned(role)` asserts that the calling thread has that role (`UPDATER`: the
role the updater was last handed to) and raises ThreadOwnershipError otherwise. Off,
`owned` returns the method itself and `hand` returns at once: no cost.
"""
from __future__ import annotations

import functools
import os
import threading

COMPUTE, OPTIMIZER, FETCH, GRAD_ADD, GRAD_IO, IO = "compute", "optimizer", "fetch", "grad-add", "grad-io", "io"
UPDATER = "updater"  # compute, or optimizer while an early step's future is outstanding

CHECK = os.environ.get("ZEROTIER_CHECK_THREADS", "").strip().lower() not in ("", "0", "false", "no", "off")

# thread-name prefixes of zerotier's workers, longest first (zerotier-grad-io before zerotier-grad)
_PREFIXES = (("zerotier-grad-io", GRAD_IO), ("zerotier-optim", OPTIMIZER), ("zerotier-fetch", FETCH),
             ("zerotier-grad", GRAD_ADD), ("zt-aio", IO))


class ThreadOwnershipError(AssertionError):
    """A store's state was mutated from a thread whose role does not own it ([Note: thread ownership])."""


def role(thread: "threading.Thread | None" = None) -> str:
    """The role of `thread` (default: the calling thread). Any thread zerotier did not start is compute."""
    name = (thread or threading.current_thread()).name
    for prefix, which in _PREFIXES:
        if name.startswith(prefix):
            return which
    return COMPUTE


def hand(to: str, *stores) -> None:
    """The updater's state of `stores` now belongs to role `to` (COMPUTE or OPTIMIZER). Called on the
    compute thread right before the future that carries the work is submitted, and right after it
    was waited for."""
    if not CHECK:
        return
    for store in stores:
        store.__dict__["_zt_updater"] = to


def check(store, allowed: str, what: str) -> None:
    """Raise ThreadOwnershipError unless the calling thread's role is `allowed` for `store`."""
    want = store.__dict__.get("_zt_updater", COMPUTE) if allowed == UPDATER else allowed
    have = role()
    if have != want:
        owner = f"{UPDATER} (now {want})" if allowed == UPDATER else want
        raise ThreadOwnershipError(
            f"{type(store).__name__}.{what} called on thread {threading.current_thread().name!r} (role {have}); "
            f"its state belongs to the {owner} thread ([Note: thread ownership] in zerotier/threads.py): hand the "
            "work over through a ticket, future or queue")


def owned(allowed: str):
    """Decorator of a store's mutating method: with ZEROTIER_CHECK_THREADS=1, assert the caller's role."""
    def decorate(method):
        if not CHECK:
            return method

        @functools.wraps(method)
        def checked(self, *args, **kwargs):
            check(self, allowed, method.__name__)
            return method(self, *args, **kwargs)
        return checked
    return decorate
