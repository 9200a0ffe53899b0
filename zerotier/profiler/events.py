"""Recording swap traffic: the calls the engine makes while profiling is on (the Recorder).

The Recorder knows nothing of its outputs: profiler.py's Profiler adds the trace, the summary,
the file and the plot on top of it.

[Note: profiler hot path]
With profiling off the engine holds `profiler = None` and every call site is one
statement guarded by `if prof is not None:`, so the cost is one comparison.
With profiling on, each call reads `time.perf_counter_ns()` and appends one tuple
to a list: `list.append` is atomic under the GIL, so worker threads record
without locks, and nothing is built (no dicts, no strings) until the trace is
exported. A "token" returned by a `*_begin` call is a plain tuple the caller
hands back to the matching `*_end`. The one optional extra is the
torch.profiler label (`record_function`), emitted only while a torch profiler
is actually running.

The speculative step's records and sums: [Note: speculation counters] in schema.py.

Times are `perf_counter_ns()` values. Callers that measure a transfer themselves
(an async I/O ticket's issue and completion) pass them to `record(...)` /
`record_wait(...)` in that same clock.

[Note: CUDA timing]
On a GPU the host only enqueues work, so host clocks would time the enqueue. With a
CUDA device the profiler times device work with CUDA events instead: forward,
backward and device-optimizer spans by events recorded on the current (compute)
stream at their begin and end; a device-side wait (`wait_begin(..., device=True)`,
a compute stream waiting on a copy's event) by events before and after it, so its
length is the time the GPU really stood still; a host<->device copy by the start
and end events the device tier records around it on its copy stream (`end(token,
copy=ticket)`; a copy from NVMe keeps its host start, when the read began). Events
are resolved into the same perf_counter_ns clock when a trace is built: a
reference event is recorded and synchronized when the profiler starts, and every
event's time is that instant plus `reference.elapsed_time(event)`. So overlap %,
stalls and the verdict are computed by the same code on both kinds of machine. The
clock and the records waiting for their events: cuda_timing.py.
"""
from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

from ..config import ProfileConfig
from .cuda_timing import CudaClock, PendingTimings
from .schema import COMPUTE_KINDS, REASONS, ROLES, SPECULATION_TOTALS, TIERS

_TIERS, _REASONS, _ROLES, _KINDS = frozenset(TIERS), frozenset(REASONS), frozenset(ROLES), frozenset(COMPUTE_KINDS)

Residency = Callable[[], Mapping[str, "tuple[int, int]"]]   # {tier: (current_bytes, budget_bytes)}

_now = time.perf_counter_ns
_thread = threading.current_thread


class Recorder:
    """Records transfers between tiers, compute spans, stalls, prefetch outcomes and residency.

    `residency`, when given, is called every `cfg.sample_interval_ms` on a daemon thread
    and must return {tier: (current_bytes, budget_bytes)}. `unit_names`: {unit key: module path}
    ("u00003": "layers.3"), so the trace and the table name a tensor `layers.3 (u00003).exp_avg`,
    not only by its key. `planned_rollback_rate`: the speculative step's rollback rate the run's plan
    assumed, put beside the measured one in the summary ([Note: speculation counters]); None: not
    speculating. `device`: the compute device; a CUDA one is timed with events ([Note: CUDA timing]).
    """

    def __init__(self, cfg: ProfileConfig, residency: Residency | None = None, device=None,
                 unit_names: Mapping[str, str] | None = None, planned_rollback_rate: float | None = None):
        self.cfg = cfg
        # event-timed records ([Note: CUDA timing]); their clock records the events
        self._cuda = (PendingTimings(CudaClock(device), self._add_timed)
                      if device is not None and device.type == "cuda" else None)
        self.device_type = device.type if device is not None else None  # names the links in the summary
        self.t0_ns = _now()                  # trace time 0
        self.wall_t0 = time.time()           # the same instant, as wall-clock seconds
        self._residency = residency
        self.unit_names = dict(unit_names or {})
        self.planned_rollback_rate = planned_rollback_rate
        # (name, role, src, dst, nbytes, reason, stream, start_ns, end_ns, stall_ns)
        # Each kind keeps its newest cfg.max_events records: memory stays bounded on long runs.
        self._transfers: deque[tuple] = deque(maxlen=cfg.max_events)
        self._computes: deque[tuple] = deque(maxlen=cfg.max_events)  # (label, kind, thread, start_ns, end_ns, numel)
        self._waits: deque[tuple] = deque(maxlen=cfg.max_events)     # (name, thread, start_ns, end_ns)
        self._prefetch = {"issued": 0, "hit": 0, "miss": 0, "wasted": 0}  # outcome -> count, whole run
        self._prefetch_lock = threading.Lock()
        self._samples: deque[tuple] = deque(maxlen=cfg.max_events)   # (t_ns, {tier: (current_bytes, budget_bytes)})
        # [Note: speculation counters]: one record per speculated window (t_ns, speculated, rolled_back,
        # undo_bytes, rollback_bytes, rollback_s), and the whole run's sums (SPECULATION_TOTALS order)
        self._speculation: deque[tuple] = deque(maxlen=cfg.max_events)
        self._speculation_totals = [0] * 6 + [0.0]
        self._speculation_lock = threading.Lock()
        # Every transfer since the start, also those the window above dropped: (src, dst, reason) ->
        # [transfers, bytes]. Updated with the append under one lock, so a snapshot sees both agree.
        self._run_totals: dict[tuple[str, str, str], list[int]] = {}
        self._transfers_lock = threading.Lock()
        self._sampler_error: str | None = None
        self._rf = _torch_labels() if cfg.record_function else None
        self._finished = False
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        if residency is not None:
            self._sampler = threading.Thread(target=self._sample_loop, name="zerotier-profile-sampler",
                                             daemon=True)
            self._sampler.start()

    # ------------------------------------------------------------------ transfers

    def begin(self, name: str, role: str, src: str, dst: str, nbytes: int, reason: str,
              stream: str | None = None) -> tuple:
        """A transfer that this thread performs starts; returns the token for `end`.

        Its track is this thread, or `stream` (e.g. "cuda:copy" for a copy this thread only
        enqueues): a transfer on a thread's own track inside its compute spans is stall."""
        _check(role, src, dst, reason)
        rf = self._label(f"zerotier::{reason} {name} {src}->{dst}")
        return (name, role, src, dst, nbytes, reason, stream or _thread().name, _now(), rf)

    def end(self, token: tuple, stall_ns: int = 0, copy=None) -> None:
        """The transfer of `token` is complete, or, with `copy` (the device tier's ticket of a CUDA
        copy it enqueued), will be when that copy's end event is reached: it is then timed by the
        copy's events on its copy stream ([Note: CUDA timing]). `stall_ns`: compute time spent
        waiting on it, if known here."""
        events = getattr(copy, "timing_events", None)
        if self._cuda is not None and events is not None:
            self._cuda.add("transfer", token[:6] + (copy.stream_name, token[7], stall_ns), *events)
        else:
            self._add_transfer(token[:8] + (_now(), stall_ns))
        if token[8] is not None:
            token[8].__exit__(None, None, None)

    @contextmanager
    def transfer(self, name: str, role: str, src: str, dst: str, nbytes: int, reason: str,
                 stream: str | None = None) -> Iterator[None]:
        """`with prof.transfer(...):` around a synchronous copy; `begin`/`end` as a context manager."""
        token = self.begin(name, role, src, dst, nbytes, reason, stream)
        try:
            yield
        finally:
            self.end(token)

    def record(self, name: str, role: str, src: str, dst: str, nbytes: int, reason: str,
               start_ns: int, end_ns: int, stream: str | None = None, stall_ns: int = 0) -> None:
        """A transfer whose start and end the caller measured (perf_counter_ns clock), e.g. an async ticket.

        Its track is `stream`, by default "<calling thread> async": an asynchronous transfer is
        not work of the calling thread (see [Note: stall attribution] in trace.py)."""
        _check(role, src, dst, reason)
        _check_times(start_ns, end_ns)
        self._add_transfer((name, role, src, dst, nbytes, reason, stream or f"{_thread().name} async",
                            start_ns, end_ns, stall_ns))

    def _add_transfer(self, rec: tuple) -> None:
        key = rec[2], rec[3], rec[5]  # src, dst, reason
        with self._transfers_lock:
            self._transfers.append(rec)
            total = self._run_totals.get(key)
            if total is None:
                self._run_totals[key] = [1, rec[4]]
            else:
                total[0] += 1
                total[1] += rec[4]

    # ------------------------------------------------------------------ stalls

    def wait_begin(self, name: str, device: bool = False) -> tuple:
        """Compute starts waiting for tensor `name` (a prefetch in flight, a demand fetch, an I/O ticket).
        `device`: the wait is the compute stream's (e.g. on a copy's event), timed on the GPU."""
        ev = self._cuda.clock.record() if device and self._cuda is not None else None
        return (name, _thread().name, _now(), self._label(f"zerotier::stall {name}"), ev)

    def wait_end(self, token: tuple) -> None:
        if token[4] is not None:
            self._cuda.add("wait", token[:2], token[4], self._cuda.clock.record())
        else:
            self._waits.append(token[:3] + (_now(),))
        if token[3] is not None:
            token[3].__exit__(None, None, None)

    @contextmanager
    def waiting(self, name: str) -> Iterator[None]:
        token = self.wait_begin(name)
        try:
            yield
        finally:
            self.wait_end(token)

    def record_wait(self, name: str, start_ns: int, end_ns: int, thread: str | None = None) -> None:
        """Compute waited on `name` from `start_ns` to `end_ns` (measured by the caller)."""
        _check_times(start_ns, end_ns)
        self._waits.append((name, thread or _thread().name, start_ns, end_ns))

    # ------------------------------------------------------------------ compute spans

    def compute_begin(self, kind: str, label: str | None = None, numel: int = 0) -> tuple:
        """A compute span starts on this thread: forward, backward, optimizer (CPU optimizer math),
        device-optimizer (optimizer math on the accelerator) or step (an enclosing marker).
        `numel`: elements an optimizer span updates (for params/s against the cpu_adam peak)."""
        if kind not in _KINDS:
            raise ValueError(f"profiler: compute kind {kind!r} is not one of {', '.join(COMPUTE_KINDS)}")
        label = label or kind
        ev = self._cuda.clock.record() if self._cuda is not None and kind in _DEVICE_KINDS else None
        return (label, kind, _thread().name, _now(), numel, self._label(f"zerotier::{label}"), ev)

    def compute_end(self, token: tuple) -> None:
        if token[6] is not None:  # device work: timed by events on the compute stream
            self._cuda.add("compute", token[:3] + (token[4],), token[6], self._cuda.clock.record())
        else:
            self._computes.append(token[:4] + (_now(), token[4]))
        if token[5] is not None:
            token[5].__exit__(None, None, None)

    def record_compute(self, kind: str, start_ns: int, end_ns: int, label: str | None = None, numel: int = 0,
                       thread: str | None = None) -> None:
        """A compute span the caller timed itself (e.g. device work timed with CUDA events)."""
        if kind not in _KINDS:
            raise ValueError(f"profiler: compute kind {kind!r} is not one of {', '.join(COMPUTE_KINDS)}")
        _check_times(start_ns, end_ns)
        self._computes.append((label or kind, kind, thread or _thread().name, start_ns, end_ns, numel))

    @contextmanager
    def compute(self, kind: str, label: str | None = None, numel: int = 0) -> Iterator[None]:
        token = self.compute_begin(kind, label, numel)
        try:
            yield
        finally:
            self.compute_end(token)

    # ------------------------------------------------------------------ prefetch outcomes

    def prefetch_issued(self, name: str) -> None:
        """An asynchronous fetch of `name` was started ahead of its use."""
        self._count_prefetch("issued")

    def prefetch_used(self, name: str, hit: bool) -> None:
        """Compute demanded `name`: hit = a prefetch had been issued for it (done or still in flight;
        its stall shows lateness), miss = compute had to start the fetch itself."""
        self._count_prefetch("hit" if hit else "miss")

    def prefetch_wasted(self, name: str) -> None:
        """A prefetched copy of `name` was dropped without being used (order changed, evicted first)."""
        self._count_prefetch("wasted")

    def _count_prefetch(self, outcome: str) -> None:
        with self._prefetch_lock:  # counts of the whole run: a few ints, whatever profile.max_events is
            self._prefetch[outcome] += 1

    # ------------------------------------------------------------------ speculative step

    def speculation(self, speculated: int, rolled_back: int, undo_bytes: int, rollback_bytes: int,
                    rollback_s: float) -> None:
        """[Note: speculation counters] One optimizer step in which speculation ran ([Note: speculative
        step] in overlap/speculative.py): `speculated` units updated under backward, `rolled_back` of them
        undone (0: the window was validated; a rollback undoes every one), `undo_bytes` copied to make
        their undo copies, `rollback_bytes` moved by the rollback (restores and NVMe re-reads),
        `rollback_s` seconds the rollback and the redo took."""
        for name, value in (("speculated", speculated), ("rolled_back", rolled_back), ("undo_bytes", undo_bytes),
                            ("rollback_bytes", rollback_bytes)):
            if type(value) is not int or value < 0:
                raise ValueError(f"profiler.speculation: {name} must be an int >= 0, got {value!r}")
        if rolled_back > speculated:
            raise ValueError(f"profiler.speculation: rolled_back ({rolled_back}) is more than the units speculated "
                             f"({speculated})")
        rollback_s = float(rollback_s)
        if not 0.0 <= rollback_s < float("inf"):
            raise ValueError(f"profiler.speculation: rollback_s must be seconds >= 0, got {rollback_s!r}")
        record = (_now(), speculated, rolled_back, undo_bytes, rollback_bytes, rollback_s)
        with self._speculation_lock:
            self._speculation.append(record)
            for k, value in enumerate((1, int(rolled_back > 0), speculated, rolled_back, undo_bytes, rollback_bytes,
                                       rollback_s)):
                self._speculation_totals[k] += value

    # ------------------------------------------------------------------ residency

    def sample(self, values: Mapping[str, "tuple[int, int]"] | None = None, t_ns: int | None = None) -> None:
        """Record residency: `values` {tier: (current_bytes, budget_bytes)}, or the residency callable's;
        at `t_ns` (perf_counter_ns), or now."""
        if values is None:
            if self._residency is None:
                raise ValueError("profiler.sample() needs values: this Profiler was given no residency callable")
            values = self._residency()
        self._samples.append((_now() if t_ns is None else t_ns, {tier: (int(cur), int(budget)) for tier, (cur, budget) in values.items()}))

    def _sample_loop(self) -> None:
        interval = self.cfg.sample_interval_ms / 1e3
        while not self._stop.wait(interval):
            try:
                self.sample()
            except Exception as exc:  # never take training down; say so once and stop sampling
                self._sampler_error = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"zerotier profiler: residency sampling stopped: {self._sampler_error}",
                              RuntimeWarning, stacklevel=1)
                return

    # ------------------------------------------------------------------ for the exporter

    def snapshot(self) -> dict:
        """Copies of the raw records (lists of tuples, see __init__) for the exporter, and
        "run_totals": {(src, dst, reason): (transfers, bytes)} of every transfer since the start,
        "prefetch": {outcome: count} since the start, "speculation": the speculated windows' records
        (see __init__) and "speculation_totals": {SPECULATION_TOTALS key: sum} since the start.
        CUDA-timed records are resolved first (waiting for their events)."""
        if self._cuda is not None:
            self._cuda.resolve()
        full = [name for name, records in (("transfers", self._transfers), ("computes", self._computes),
                                           ("waits", self._waits), ("samples", self._samples),
                                           ("speculation", self._speculation))
                if len(records) == records.maxlen]
        if full:
            warnings.warn(f"profiler: the trace holds only the newest {self.cfg.max_events:,} records of "
                          f"{', '.join(full)} (profile.max_events); earlier ones were dropped", RuntimeWarning,
                          stacklevel=3)
        with self._transfers_lock:
            transfers = list(self._transfers)
            run_totals = {key: tuple(total) for key, total in self._run_totals.items()}
        with self._speculation_lock:
            speculation = list(self._speculation)
            speculation_totals = dict(zip(SPECULATION_TOTALS, self._speculation_totals))
        return {"transfers": transfers, "run_totals": run_totals, "computes": list(self._computes),
                "waits": list(self._waits), "prefetch": dict(self._prefetch), "samples": list(self._samples),
                "sampler_error": self._sampler_error, "speculation": speculation,
                "speculation_totals": speculation_totals}

    def finish(self) -> bool:
        """Stop the sampler and take a last sample; False when finished before (idempotent)."""
        if self._finished:
            return False
        self._finished = True
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
            if self._sampler_error is None:
                try:
                    self.sample()
                except Exception as exc:
                    self._sampler_error = f"{type(exc).__name__}: {exc}"
        return True

    # ------------------------------------------------------------------ internals

    def _add_timed(self, what: str, fields: tuple, start: int, end: int) -> None:
        """An event-timed record, its events reached: into the records as if timed by the host."""
        if what == "transfer":
            name, role, src, dst, nbytes, reason, stream, host_start, stall = fields
            if "nvme" in (src, dst):  # the read/write before the copy belongs to the transfer
                start = min(host_start, end)
            self._add_transfer((name, role, src, dst, nbytes, reason, stream, start, end, stall))
        elif what == "compute":
            label, kind, thread, numel = fields
            self._computes.append((label, kind, thread, start, end, numel))
        else:
            name, thread = fields
            self._waits.append((name, thread, start, end))

    def _label(self, text: str):
        """An entered torch record_function for `text` while a torch profiler runs, else None."""
        if self._rf is None or not self._rf[0]():
            return None
        rf = self._rf[1](text)
        rf.__enter__()
        return rf


_DEVICE_KINDS = frozenset(("forward", "backward", "device-optimizer"))  # timed on the GPU when there is one


def _check(role: str, src: str, dst: str, reason: str) -> None:
    if reason not in _REASONS:
        raise ValueError(f"profiler: reason {reason!r} is not one of {', '.join(REASONS)}")
    if role not in _ROLES:
        raise ValueError(f"profiler: role {role!r} is not one of {', '.join(ROLES)}")
    if src not in _TIERS or dst not in _TIERS or src == dst:
        raise ValueError(f"profiler: a transfer goes between two different tiers of {', '.join(TIERS)};"
                         f" got {src!r} -> {dst!r}")


def _check_times(start_ns: int, end_ns: int) -> None:
    if end_ns < start_ns:
        raise ValueError(f"profiler: end_ns {end_ns} is before start_ns {start_ns} (both perf_counter_ns)")


def _torch_labels():
    """(is a torch profiler running?, record_function) or None when torch is unavailable."""
    try:
        import torch
        from torch.autograd.profiler import record_function
    except ImportError:
        return None
    enabled = getattr(torch.autograd, "_profiler_enabled", None) or (lambda: True)
    return enabled, record_function
