"""Host tier: a budgeted pool of aligned (and, on CUDA machines, pinned) host memory.

[Note: host pool]
Blocks are `aligned_empty` tensors whose sizes are rounded up to `alignment`, so the
same block can serve O_DIRECT file I/O and async H2D/D2H copies. On a CUDA machine
each block is page-locked in place with cudaHostRegister: we pin exactly the bytes
we allocate, instead of torch's pinned caching allocator, which rounds every request
up to a power of two (a 1.1 GiB shard would cost 2 GiB of pinned RAM). Pinning is
slow (it touches every page), so freed blocks are cached by size and reused: a
training loop that allocates the same shard sizes every step stops growing after
the first one. The budget counts every byte the pool holds, cached blocks included;
when a new block would not fit, cached blocks are released first.

[Note: registrations end with the pool]
A registered block may be handed out (an optimizer's state, a parameter's host home)
and outlive the pool's own bookkeeping: its owner drops the tensor whenever it likes,
and the allocator then reuses the range while the driver still holds it registered.
The next cudaHostRegister on that range fails with 712 ("already registered"), the
error stays pending on the thread and is raised by an unrelated kernel launch later,
and a remapped page would be DMA'd from stale physical memory. So the pool keeps every
registered block in `_registered` and unregisters all of them when it closes, or when
it is collected without close() (a `weakref.finalize` that holds the set, not the
pool); the memory stays valid as pageable for whoever still holds it. A failed
register clears the pending CUDA error before falling back to pageable memory.
`_register`/`_unregister` are the only calls into the driver. On any host, a test
instrument can stand in for the driver's bookkeeping: `ledger` (tests/conftest.py sets
one for the whole CPU suite) sees every block registered and unregistered by the same
rules, pinned or not, and refuses an overlapping registration as the driver would (712),
so CI catches a leaked registration without a GPU.

[Note: a reused block's slack is the cache's]
Best fit hands out a cached block up to _BEST_FIT_SLACK times the rounded request (a block
another store freed: ZeRO-1/2's gathered full flat of an NVMe home, twice a shard, taken by the
optimizer's next staging block). Under ZEROTIER_CHECK_PLAN=1 the component is charged the
rounded request, what its store asked for and the plan counts per block; the rest of the block
is the cache's, charged to nobody, as the NVMe store's recycled files are ([Note: peaks per
component] in base.py). The budget still counts the whole block; unlike a cached block, that
slack is only given back when the buffer is freed. So the slack in use is held within
`slack_limit`, the budget's spare over the plan's host need (the engine sets it): the plan counts
every block at its rounded request, so blocks in use never pass the budget by more than what the
plan left spare, and the pool never refuses an allocation the plan said fits. At an exact budget
only exact sizes are reused. (Unbounded, a 28 KiB staging block served by a cached 52 KiB one
took the pool's live total 12 KiB past the plan's host need in three CHECK_PLAN tests.)

[Note: deferred free]
A block must not be reused while an async copy or a file write still reads it.
`free(buf, after=ticket)` parks the block until `ticket.done()`; only then does it
return to the free lists.

[Note: a full pool waits]
A block parked behind a ticket ([Note: deferred free]) comes back as soon as its write or
copy ends, so an alloc that does not fit while blocks are parked waits for the oldest
ticket and tries again; only when nothing is parked does the budget refuse it, with a
BudgetError saying what the budget would need. Materialization and NVMe staging in
initialize run ahead of their writes this way without leaving the budget
([Note: materialization in the host pool] in materialize.py). A failed ticket's owner
reports its error: here it only means the block is free again.

[Note: heap trimming]
Outside the pool, host memory comes from malloc, and glibc keeps freed heap memory for
reuse: chunks below its mmap threshold, which rises (up to 32 MiB) as large blocks are
freed. initialize() frees the user's tensors and makes unit-sized temporaries; on a
model of many units below 32 MiB that memory stays in the process's RSS though nothing
uses it (800 Linear(256, 256) units, 212 MB, everything on NVMe: RSS +390 MB over the
start after initialize, +18 MB after malloc_trim). So the engine calls `trim_heap()`
(malloc_trim(0), ~20 ms) after one-off work: initialize, save/load_checkpoint, close.
Never per step: trimming pages that the next step allocates again cost 10-35% of a CPU
training step (TinyGPT 768 x 6 layers, batch 4 x 128), which is what glibc's retention
saves. Without glibc (musl, macOS) it does nothing.

[Note: heap bound]
glibc serves a request at or above its mmap threshold with its own mapping, given back on
free; below it, from the heap, whose freed chunks stay in RSS. The threshold starts at
128 KiB and rises to the size of each mmapped chunk freed (up to 32 MiB), so after the
first unit-sized temporary (a 1024 x 4096 fp32 weight: 16 MiB) every unit-sized tensor
outside the pool — materialization, casts, autograd temporaries — comes from the heap and
stays there when freed: a 101M-parameter TinyGPT (dim 1024, units on NVMe) kept 203 MB of
free heap after two steps, RSS 464 MB over the base for a 206 MB pool. `bound_heap()`
(once, when a HostPool is made) pins the threshold at 4 MiB, which also stops the rise:
the same run (pinned at 1 MiB) keeps 11 MB of free heap, RSS 309 MB, initialize's peak
219 MB (330 before). Not lower: at 1 MiB the activations of a CPU step are mapped and
unmapped every op (TinyGPT 768 x 6 layers, batch 4 x 128, median step 8.0 s -> 10.8-16.4 s;
at 4 MiB 7.6-9.6 s: noise on this loaded machine). benchmarks/bench_rss_budget.py;
docs/tiers.md § RSS beyond the budgets. A threshold the user set (MALLOC_MMAP_THRESHOLD_) is kept.
The planner's unit timing pins it too, so its compute pays what the step's temporaries cost here
([Note: units timed under the engine's allocator] in planner/unit_timing.py).
"""
from __future__ import annotations

import bisect
import ctypes
import logging
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from ..units import format_size
from ..errors import ZerotierError
from ..io import aligned_empty
from ..io.memory import round_up
from ..io.ticket import TicketLike
from .base import BudgetedTier, charging

log = logging.getLogger(__name__)
_malloc_trim = None  # glibc's malloc_trim once looked up; False where there is none


def trim_heap() -> None:
    """Give freed malloc heap memory back to the OS ([Note: heap trimming]); a no-op without glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        _malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", False)
    if _malloc_trim:
        _malloc_trim(0)


_HEAP_MMAP_THRESHOLD = 4 << 20  # [Note: heap bound]
# What a run adds to RSS beyond the host pool and device tier, fixed in model size: torch's
# runtime (~75 MiB, its meta kernels) and compute temporaries (~40 MiB at dim 1024, batch 4 x 16),
# measured 135-154 MiB from 25M to 265M parameters (docs/tiers.md § RSS beyond the budgets); `zerotier
# plan` prints it. Materialization is not in it: the plan counts that in tiers.host ([Note: materialization
# in the host pool] in materialize.py)
RSS_OUTSIDE_BUDGETS = 160 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def bound_heap() -> bool:
    """Pin glibc's mmap threshold ([Note: heap bound]); False where there is no glibc or the user set it."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return bool(mallopt and mallopt(_M_MMAP_THRESHOLD, _HEAP_MMAP_THRESHOLD))


# Reuse a cached block for a smaller request only if it is at most this many times the
# rounded request: close enough to cost little, far enough to avoid new pins.
_BEST_FIT_SLACK = 2


ledger = None  # test instrument: register(ptr, nbytes) / unregister(ptr) for every block ([Note: registrations ...])


def _register(ptr: int, nbytes: int) -> None:
    """cudaHostRegister ([Note: registrations end with the pool]); raises on failure."""
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _unregister(ptr: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's pending error after a failed register (torch's cudart binding has no
    cudaGetLastError): otherwise the next kernel launch on this thread raises it, misattributed."""
    for lib in (None, "libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            getattr(ctypes.CDLL(lib), "cudaGetLastError")()
            return
        except (OSError, AttributeError):
            continue


def _unregister_block(block) -> None:
    if block.pinned:
        block.pinned = False
        _unregister(block.data.data_ptr())
    if block.ledger is not None:
        ledger_, block.ledger = block.ledger, None
        ledger_.unregister(block.data.data_ptr())


def _unregister_all(registered: set) -> None:
    """The pool's finalizer and close(): every block still registered becomes pageable memory."""
    for block in list(registered):
        registered.discard(block)
        if block.data is not None:
            try:
                _unregister_block(block)
            except Exception:  # noqa: BLE001 - at exit the CUDA context may already be gone
                pass


@dataclass(eq=False)
class _Block:
    """One aligned allocation (uint8 tensor of `size` bytes), pinned or not."""

    data: torch.Tensor
    size: int
    pinned: bool
    ledger: object = None  # the test ledger that saw it registered, if any


@dataclass(eq=False)
class HostBuffer:
    """A typed view of a pool block. `tensor` is 1-D with nbytes // itemsize elements.

    The block may be larger than nbytes (rounded to the alignment): `block` exposes the
    whole aligned region so file I/O can read/write full aligned lengths without a
    staging copy. After `HostPool.free(buf)` the memory belongs to the pool again:
    drop every view taken from it.
    """

    tensor: torch.Tensor
    nbytes: int
    what: str
    _block: _Block = field(repr=False)
    _freed: bool = field(default=False, repr=False)
    component: str | None = field(default=None, repr=False)  # [Note: peaks per component] in base.py

    @property
    def block(self) -> torch.Tensor:
        """The whole aligned uint8 block (capacity >= nbytes)."""
        return self._block.data

    @property
    def capacity(self) -> int:
        return self._block.size

    @property
    def pinned(self) -> bool:
        return self._block.pinned

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def view(self, shape=None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The first nbytes as `dtype` (default: the alloc dtype) reshaped to `shape`."""
        t = self.tensor if dtype is None or dtype == self.tensor.dtype else \
            self.block[: self.nbytes].view(dtype)
        return t if shape is None else t.view(shape)


class HostPool(BudgetedTier):
    """Budgeted, size-class-cached pool of aligned host memory (see [Note: host pool]).

    `pin=True` page-locks blocks when CUDA is available; on CPU-only machines it
    degrades to ordinary aligned memory (the copies it feeds are synchronous there).
    """

    def __init__(self, budget: int, alignment: int = 4096, pin: bool = True, slack_limit: int | None = None) -> None:
        super().__init__("host", budget, hint="Raise tiers.host, or move optimizer state to nvme "
                                              "(offload.optimizer = \"nvme\").")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"host pool alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        self.pin = bool(pin) and torch.cuda.is_available()
        if pin and not self.pin:
            log.info("host pool: CUDA unavailable, using pageable (unpinned) aligned memory")
        self._lock = threading.Lock()
        self._free: dict[int, list[_Block]] = {}     # size -> cached blocks of that size
        self._free_sizes: list[int] = []             # sorted keys of _free with non-empty lists
        self._cached_bytes = 0
        self._parked: list[tuple[_Block, TicketLike]] = []  # [Note: deferred free]
        self._parked_bytes = 0
        self._in_use = 0
        self._slack = 0  # in-use blocks' bytes past their requests ([Note: a reused block's slack is the cache's])
        self.slack_limit = budget if slack_limit is None else max(0, slack_limit)
        self._live = 0
        self._alloc_calls = 0
        self._reuses = 0
        self._pin_failures = 0
        self._pin_ns = self._pinned = 0  # time in cudaHostRegister, bytes it pinned (bench_setup.py)
        self._closed = False
        # [Note: registrations end with the pool]
        self._registered: set[_Block] = set()
        self._finalizer = weakref.finalize(self, _unregister_all, self._registered)
        bound_heap()  # the memory outside the pool is given back when freed ([Note: heap bound])

    # ------------------------------------------------------------------ public API

    def alloc(self, nbytes: int, dtype: torch.dtype = torch.uint8, what: str = "") -> HostBuffer:
        """A buffer of nbytes viewed as `dtype`; BudgetError when the pool cannot hold it."""
        itemsize = dtype.itemsize
        if nbytes < 0 or nbytes % itemsize:
            raise ValueError(f"host pool: {nbytes} B is not a whole number of {dtype} elements")
        if self._closed:
            raise ZerotierError("host pool is closed")
        size = self._block_size(nbytes)
        with self._lock:
            self._alloc_calls += 1
        while True:
            self._reap()
            with self._lock:
                block = self._take_cached_locked(size)
                if block is not None:
                    self._reuses += 1
                else:
                    block = self._new_block_locked(size, what or f"{format_size(nbytes)} host buffer",
                                                   refuse=not self._parked)
                if block is not None:
                    self._in_use += block.size
                    self._slack += block.size - size
                    self._live += 1
                    break
                ticket = self._parked[0][1]
            try:  # [Note: a full pool waits]: not under the lock (see _reap())
                ticket.wait()
            except Exception:  # noqa: BLE001 - the owner of the ticket reports it
                pass
        tensor = block.data[:nbytes].view(dtype)
        component = charging()
        self.charge(component, size)  # not block.size: [Note: a reused block's slack is the cache's]
        return HostBuffer(tensor=tensor, nbytes=nbytes, what=what, _block=block, component=component)

    def free(self, buf: HostBuffer, after: TicketLike | None = None, cache: bool = True) -> None:
        """Return buf's block to the pool, once `after` (if given) has completed. `cache=False` gives a
        block of a one-off size back to the system instead (nothing later asks for that size: cached,
        it would be taken by best fit for up to half its size, or hold RSS until trimmed)."""
        wait_for = after is not None and not after.done()  # outside the lock: see _reap()
        with self._lock:
            if buf._freed:
                raise ZerotierError(f"host pool: double free of buffer {buf.what or ''} ({buf.nbytes} B)")
            buf._freed = True
            block = buf._block
            size = self._block_size(buf.nbytes)
            self.charge(buf.component, -size)
            self._in_use -= block.size
            self._slack -= block.size - size
            self._live -= 1
            if self._closed or not (cache or wait_for):
                self._drop_block(block)
            elif wait_for:
                self._parked.append((block, after))
                self._parked_bytes += block.size
            else:
                self._cache_locked(block)

    def trim(self) -> int:
        """Release every cached (free) block to the system; returns bytes released."""
        self._reap()
        with self._lock:
            return self._trim_locked(self._cached_bytes)

    def stats(self) -> dict[str, int]:
        """Base figures (current = bytes held: in use + cached + parked) plus pool details."""
        self._reap()
        with self._lock:
            out = super().stats()
            out.update(in_use=self._in_use, cached=self._cached_bytes, parked=self._parked_bytes,
                       live_buffers=self._live, alloc_calls=self._alloc_calls, reuses=self._reuses,
                       pinned=int(self.pin), pin_failures=self._pin_failures, pin_ns=self._pin_ns,
                       pinned_bytes=self._pinned)
            return out

    def close(self) -> None:
        """Release cached blocks and unregister every block ([Note: registrations end with the
        pool]); blocks still in use stay valid (pageable) and are released when freed."""
        with self._lock:
            self._closed = True
            parked = list(self._parked)
        for _block, ticket in parked:  # not under the lock: see _reap()
            try:
                ticket.wait()
            except Exception:  # noqa: BLE001 - the owner of the ticket reports it
                pass
        self._reap()
        with self._lock:
            self._trim_locked(self._cached_bytes)
            _unregister_all(self._registered)

    # ----------------------------------------------------------------- internals

    def _block_size(self, nbytes: int) -> int:
        """A request's block size: rounded up to the alignment (what its component is charged)."""
        return max(round_up(nbytes, self.alignment), self.alignment)

    def _take_cached_locked(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self._free_sizes, size)
        if i == len(self._free_sizes) or self._free_sizes[i] > size * _BEST_FIT_SLACK:
            return None
        best = self._free_sizes[i]
        if best != size and self._slack + best - size > self.slack_limit:
            return None  # [Note: a reused block's slack is the cache's]: a block of its own size instead
        blocks = self._free[best]
        block = blocks.pop()
        if not blocks:
            del self._free[best]
            self._free_sizes.pop(i)
        self._cached_bytes -= block.size
        return block

    def _cache_locked(self, block: _Block) -> None:
        blocks = self._free.get(block.size)
        if blocks is None:
            blocks = self._free[block.size] = []
            bisect.insort(self._free_sizes, block.size)
        blocks.append(block)
        self._cached_bytes += block.size

    def _reap(self) -> None:
        """Return parked blocks whose ticket has completed to the free lists.

        done() may run the ticket's completion bookkeeping, which may free other pool
        buffers: it must be called without holding the pool lock.
        """
        with self._lock:
            parked = list(self._parked)
        finished = [(block, ticket) for block, ticket in parked if ticket.done()]
        if not finished:
            return
        with self._lock:
            for item in finished:
                if item not in self._parked:  # another thread reaped it
                    continue
                self._parked.remove(item)
                self._parked_bytes -= item[0].size
                self._cache_locked(item[0])

    def _trim_locked(self, want: int) -> int:
        """Drop cached blocks, largest first, until `want` bytes are released (or none left)."""
        released = 0
        while released < want and self._free_sizes:
            size = self._free_sizes[-1]
            blocks = self._free[size]
            block = blocks.pop()
            if not blocks:
                del self._free[size]
                self._free_sizes.pop()
            self._cached_bytes -= block.size
            self._drop_block(block)
            released += block.size
        return released

    def _new_block_locked(self, size: int, what: str, refuse: bool = True) -> _Block | None:
        """A new block of `size`; None where it does not fit and `refuse` is False, else BudgetError."""
        if not self.try_reserve(size):
            # Give cached blocks back first; only what is in use (or parked) can refuse us.
            self._trim_locked(self.used + size - self.budget)
            if not self.try_reserve(size):
                if not refuse:
                    return None
                self.reserve(size, what)  # raises BudgetError with the standard message
        try:
            data = aligned_empty(size, self.alignment)
        except RuntimeError as exc:  # the OS refused: report it like a budget problem
            self.release(size)
            raise MemoryError(f"host tier: allocating {format_size(size)} for {what} failed: {exc}. "
                              f"Lower tiers.host or free host memory.") from exc
        block = _Block(data=data, size=size, pinned=self._pin(data) if self.pin else False)
        if ledger is not None:
            try:
                ledger.register(data.data_ptr(), size)
            except BaseException:
                _unregister_block(block)
                self.release(size)
                raise
            block.ledger = ledger
        if block.pinned or block.ledger is not None:
            self._registered.add(block)
        return block

    def _pin(self, data: torch.Tensor) -> bool:
        t0 = time.perf_counter_ns()
        try:
            _register(data.data_ptr(), data.numel())
            self._pin_ns += time.perf_counter_ns() - t0
            self._pinned += data.numel()
            return True
        except Exception as exc:  # noqa: BLE001 - degrade, but say so once
            _clear_cuda_error()
            self._pin_failures += 1
            if self._pin_failures == 1:
                why = ("the range is registered already, by another library or a pool that was never closed"
                       if "already" in str(exc) or "712" in str(exc) else "check `ulimit -l` or lower tiers.host")
                warnings.warn(f"host tier: cudaHostRegister of {format_size(data.numel())} failed ({exc}): {why}; "
                              "using pageable memory for this block (its copies are synchronous)",
                              RuntimeWarning, stacklevel=4)
            return False

    def _drop_block(self, block: _Block) -> None:
        self._registered.discard(block)
        _unregister_block(block)
        self.release(block.size)
        block.data = None  # type: ignore[assignment]  # memory returns when views are dropped
