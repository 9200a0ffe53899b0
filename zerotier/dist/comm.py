"""Collectives for ZeRO: reduce-scatter, all-gather, all-reduce as async handles; gradient and
parameter buckets; byte counters. gloo on CPU, NCCL on CUDA. See docs/dist.md.

    comm = Comm.from_config(cfg.zero)
    h = comm.reduce_scatter(grad_shard, grad_flat_padded)   # issue
    ...                                                     # compute goes on
    h.wait()                                                # grad_shard is now usable

[Note: where collectives run]
CPU (gloo): every collective is issued with `async_op=True`; gloo runs it on its own
threads while the caller computes. `Handle.wait()` joins it and then runs the
finishing step, if any (slice of an emulated reduce-scatter, division of an
emulated AVG).
CUDA (NCCL): every collective, and its finishing step, is queued on `Comm.stream`,
a dedicated stream, after that stream waits for everything already queued on the
caller's (compute) stream: the inputs are ready, and the collective overlaps the
compute queued after it. An event recorded on `Comm.stream` travels with the
handle; `Handle.wait()` makes the caller's stream wait on it (the host never
blocks). Tensors used on `Comm.stream` are kept alive by the handle until
`wait()`, after which the compute stream is ordered after their last use, so the
caching allocator may reuse them (no `record_stream`). Always wait every handle.
With `overlap=False` (zero.overlap_comm) collectives run on the caller's stream /
thread and are complete when issued.

[Note: which group runs a collective]
`Comm.route(device)` is the one place that answers it. The backend is read per device
from the group itself (`dist.get_backend_config`: what torch made for each device
type when the group was created), never parsed from the group's name: a group made
with no backend or by a plugin name is whatever torch resolved it to. A tensor on a
device the group has a backend for runs there. A CPU tensor on a group with no CPU
backend (an NCCL-only group made by the user or accelerate) runs on a gloo group of
the same ranks that the Comm makes once, at its first host collective (the initial
weight broadcast, for the engine), and destroys in `close()`. Only the world group
gets one: `dist.new_group` must be called by every rank of the world in the same
order, which holds because every rank issues the same collectives in the same order.

[Note: native or emulated]
NCCL implements every collective natively, with AVG: it is never probed. Device
tensors are never probed on any backend (a probe that failed on one rank only, e.g.
out of memory, would make that rank emulate while the others do not, and the job would
hang): a non-NCCL backend on a device (gloo on CUDA, a plugin) gets the emulations
below, which need only all_reduce(SUM) and the list all_gather. On the CPU (gloo or
another backend), whether it has `reduce_scatter_single`/`reduce_scatter_tensor`,
`all_gather_single`/`all_gather_into_tensor` and `ReduceOp.AVG` for a dtype is not
guessed from versions: the first call tries the native collective, and a
synchronous "unsupported" error (raised identically on every rank, before any
byte moves) is cached per (backend, device type, collective, dtype, op) and the
emulation used from then on. Emulations: AVG = SUM, then divide by the world size (no extra
bytes); reduce-scatter = all-reduce of the flat, then keep this rank's chunk (2x
the bytes of a ring reduce-scatter; the flat is all-reduced in place when the
caller marks it scratch, as the gradient buckets do, else a copy); all-gather =
list all-gather into views of the output (same bytes). `Comm(reduce_scatter=
"auto")` uses the all-reduce emulation wherever gloo runs the collective, even though
gloo has a native reduce-scatter: on one node it measured ~2x faster (docs/dist.md).

[Note: byte counters]
`Comm.stats()` counts bytes *sent per rank* by the ring-algorithm convention, for
what was actually issued: reduce-scatter and all-gather of a flat of B bytes send
(N-1)/N * B each, all-reduce 2(N-1)/N * B (broadcast, used once at start-up to
make every rank's initial weights rank 0's: (N-1)/N * B). An emulated reduce-scatter is counted
under "reduce_scatter" at its all-reduce cost. With Psi = the model's bytes of
gradients / parameters, one step sends: plain DP 2Psi(N-1)/N (all-reduce),
ZeRO-1/2 the same 2Psi(N-1)/N (reduce-scatter + all-gather), ZeRO-3
3Psi(N-1)/N (all-gather in forward and in backward, reduce-scatter).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..errors import ZerotierError

AVG = dist.ReduceOp.AVG
SUM = dist.ReduceOp.SUM
MAX = dist.ReduceOp.MAX
KINDS = ("reduce_scatter", "all_gather", "all_reduce", "broadcast")

# Errors by which a backend refuses a collective it does not implement (never a lost peer).
_UNSUPPORTED = (RuntimeError, NotImplementedError, ValueError, TypeError)
_REAL_FAILURES = tuple(getattr(dist, name) for name in ("DistError", "DistBackendError", "DistNetworkError")
                       if hasattr(dist, name))


class CollectiveError(ZerotierError, RuntimeError):
    """A collective failed or timed out; the message names this rank and the collective."""


def ring_bytes(kind: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends for `kind` over a flat of `nbytes` (the input of a reduce-scatter, the
    output of an all-gather, the tensor of an all-reduce or broadcast), by the ring-algorithm
    convention (a pipelined ring broadcast: (N-1)/N per rank on average)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")
    factor = 2 if kind == "all_reduce" else 1
    return factor * (world_size - 1) * nbytes // world_size


def _failure_message(rank: int, kind: str, timeout_s: float | None, exc: BaseException) -> str:
    cause = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
        after = f" after {timeout_s:g} s" if timeout_s is not None else ""
        what = f"timed out{after} (zero.timeout_s)"
    else:
        what = "failed"
    return (f"rank {rank}: collective {kind} {what} — another rank probably failed or stopped; "
            f"see its log. Cause: {cause}")


class Handle:
    """One issued collective. `wait()` makes its output usable by the caller; `done()` polls.

    See [Note: where collectives run]. wait() is idempotent and raises CollectiveError when the
    collective failed or timed out (typically because a peer rank died).
    """

    def __init__(self, kind: str, rank: int, timeout_s: float | None, works: Sequence[Any] = (),
                 event: "torch.cuda.Event | None" = None, finish: Callable[[], None] | None = None,
                 keep: tuple = ()):
        self.kind = kind
        self._rank, self._timeout_s = rank, timeout_s
        self._works, self._event, self._finish, self._keep = list(works), event, finish, keep
        self._waited = False

    def done(self) -> bool:
        """True once the collective finished (wait() will not block); never raises."""
        if self._waited:
            return True
        if self._event is not None and not self._event.query():
            return False
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        if self._waited:
            return
        with record_function(f"zerotier::{self.kind}.wait"):
            try:
                for work in self._works:
                    work.wait()
            except Exception as exc:  # gloo: RuntimeError / DistBackendError on a timeout or a lost peer
                raise CollectiveError(_failure_message(self._rank, self.kind, self._timeout_s, exc)) from exc
            if self._event is not None:
                torch.cuda.current_stream().wait_event(self._event)
            if self._finish is not None:
                self._finish()
        self._waited = True
        self._works, self._event, self._finish, self._keep = [], None, None, ()


@dataclass
class _Counter:
    bytes: int = 0
    calls: int = 0
    emulated: int = 0


class Comm:
    """Issues collectives on one process group (default: the world); owns the CUDA comm stream,
    the gloo group for host tensors where the group has no CPU backend, the native-or-emulated
    cache and the byte counters. `close()` when done (it destroys that gloo group).

    `reduce_scatter` picks the implementation ([Note: native or emulated]): "native" (the
    backend's, emulated only where it refuses), "all_reduce" (always the all-reduce
    emulation), or "auto": "all_reduce" where gloo runs it, its reduce-scatter having measured
    ~2x slower than an in-place all-reduce of a bucket (docs/dist.md), else "native".
    `all_gather`: "native" / "auto" (the backend's where it has one) or "list" (always the
    list all-gather emulation).
    """

    def __init__(self, group: Any = None, *, overlap: bool = True, timeout_s: float | None = None,
                 reduce_scatter: str = "auto", all_gather: str = "auto"):
        if reduce_scatter not in ("auto", "native", "all_reduce"):
            raise ValueError(f"reduce_scatter must be 'auto', 'native' or 'all_reduce', got {reduce_scatter!r}")
        if all_gather not in ("auto", "native", "list"):
            raise ValueError(f"all_gather must be 'auto', 'native' or 'list', got {all_gather!r}")
        self.group = group
        self.overlap = overlap
        self.timeout_s = timeout_s
        self.reduce_scatter_impl = reduce_scatter
        self.all_gather_impl = all_gather
        self._native: dict[Hashable, bool] = {}
        self._counters = {kind: _Counter() for kind in KINDS}
        self._lock = threading.Lock()
        # Collectives queue here so they overlap compute on the caller's stream; ordering both
        # ways is by events ([Note: where collectives run]). Created on first CUDA collective.
        self.stream: torch.cuda.Stream | None = None
        # [Note: which group runs a collective]: made by the first host collective on a world
        # group with no CPU backend, which any issuing thread (autograd's too) may reach first.
        self._host_group: Any = None
        self._host_lock = threading.Lock()

    @classmethod
    def from_config(cls, zero_cfg, group: Any = None) -> "Comm":
        return cls(group, overlap=zero_cfg.overlap_comm, timeout_s=zero_cfg.timeout_s)

    # ------------------------------------------------------------ topology

    def _group(self, group: Any) -> Any:
        return self.group if group is None else group

    @staticmethod
    def _active() -> bool:
        return dist.is_available() and dist.is_initialized()

    def rank(self, group: Any = None) -> int:
        return dist.get_rank(self._group(group)) if self._active() else 0

    def world_size(self, group: Any = None) -> int:
        return dist.get_world_size(self._group(group)) if self._active() else 1

    def route(self, device: torch.device, group: Any = None) -> tuple[Any, str]:
        """(process group, backend name) that runs a collective on tensors on `device`
        ([Note: which group runs a collective]); a clear error where none can."""
        group = self._group(group)
        backends = backends_by_device(group)
        if device.type in backends:
            return group, backends[device.type]
        world = group is None or group is dist.group.WORLD
        if device.type == "cpu" and world:
            return self._world_host_group(), "gloo"
        config = ",".join(f"{d}:{b}" for d, b in backends.items())
        fix = ("zerotier makes a gloo group for host tensors only on the world group: give this group a CPU "
               "backend (dist.new_group(ranks, backend='cpu:gloo,cuda:nccl'))" if device.type == "cpu"
               else "pass tensors on a device it has a backend for")
        raise ValueError(f"collective on a {device.type} tensor, but the process group ({config}) has no backend "
                         f"for that device; {fix}")

    def _world_host_group(self) -> Any:
        with self._host_lock:
            if self._host_group is None:
                timeout = None if self.timeout_s is None else timedelta(seconds=self.timeout_s)
                self._host_group = dist.new_group(backend="gloo", timeout=timeout)
            return self._host_group

    def close(self) -> None:
        """Destroy the gloo group this Comm made for host tensors, if any: a local call, no
        collective, so ranks that stopped on an error may skip it. Idempotent."""
        with self._host_lock:
            group, self._host_group = self._host_group, None
        if group is not None and self._active():  # else it went with the world
            dist.destroy_process_group(group)

    # ------------------------------------------------------------ counters

    def stats(self, detail: bool = False) -> dict:
        """{kind: bytes sent by this rank} ([Note: byte counters]); with detail, {kind: {bytes,
        calls, emulated}}."""
        with self._lock:
            if detail:
                return {k: {"bytes": c.bytes, "calls": c.calls, "emulated": c.emulated}
                        for k, c in self._counters.items()}
            return {k: c.bytes for k, c in self._counters.items()}

    def reset_stats(self) -> None:
        with self._lock:
            self._counters = {kind: _Counter() for kind in KINDS}

    def _count(self, kind: str, nbytes: int, emulated: bool) -> None:
        with self._lock:
            c = self._counters[kind]
            c.bytes += nbytes
            c.calls += 1
            c.emulated += int(emulated)

    # ------------------------------------------------------------ collectives

    def reduce_scatter(self, output_shard: torch.Tensor, input_flat: torch.Tensor, group: Any = None,
                       op=AVG, *, input_is_scratch: bool = False) -> Handle:
        """output_shard = chunk `rank` of op(input_flat over ranks); input_flat has world_size x
        output_shard.numel() elements. input_flat is left unchanged unless `input_is_scratch`
        (the caller is done with it): the emulation then all-reduces it in place, no copy."""
        group = self._group(group)
        rank, ws = self.rank(group), self.world_size(group)
        _check_pair("reduce_scatter", output_shard, input_flat, ws, "output_shard", "input_flat")
        nbytes = input_flat.numel() * input_flat.element_size()
        with record_function("zerotier::reduce_scatter"):
            if not self._active():
                output_shard.copy_(input_flat.view(-1))
                return Handle("reduce_scatter", rank, self.timeout_s)

            group, backend = self.route(input_flat.device, group)
            device_type = input_flat.device.type

            def body():
                fn = _first_attr(("reduce_scatter_single", "reduce_scatter_tensor"))
                impl = self.reduce_scatter_impl
                if impl == "auto":
                    impl = "all_reduce" if backend == "gloo" else "native"
                if impl == "native" and fn is not None:
                    work, divisor = self._reducing("reduce_scatter", backend, device_type, input_flat.dtype, op, ws,
                                                   lambda o: fn(output_shard, input_flat, op=o, group=group,
                                                                async_op=True))
                    if work is not None:
                        self._count("reduce_scatter", ring_bytes("reduce_scatter", nbytes, ws), False)
                        return [work], _divider(output_shard, divisor)
                # emulation: all-reduce a copy of the flat, keep this rank's chunk ([Note: native or emulated])
                tmp = input_flat.view(-1) if input_is_scratch else input_flat.view(-1).clone()
                work, divisor = self._all_reduce_work(tmp, group, backend, op, ws)
                self._count("reduce_scatter", ring_bytes("all_reduce", nbytes, ws), True)
                n = output_shard.numel()

                def finish():
                    chunk = tmp[rank * n:(rank + 1) * n]
                    output_shard.view(-1).copy_(chunk if divisor == 1 else chunk / divisor)
                return [work], finish
            return self._issue("reduce_scatter", rank, body, (output_shard, input_flat))

    def all_gather(self, output_flat: torch.Tensor, input_shard: torch.Tensor, group: Any = None) -> Handle:
        """output_flat = concatenation of every rank's input_shard, in rank order."""
        group = self._group(group)
        rank, ws = self.rank(group), self.world_size(group)
        _check_pair("all_gather", input_shard, output_flat, ws, "input_shard", "output_flat")
        nbytes = output_flat.numel() * output_flat.element_size()
        with record_function("zerotier::all_gather"):
            if not self._active():
                output_flat.view(-1).copy_(input_shard.view(-1))
                return Handle("all_gather", rank, self.timeout_s)

            group, backend = self.route(input_shard.device, group)

            def body():
                fn = _first_attr(("all_gather_single", "all_gather_into_tensor"))
                if self.all_gather_impl != "list" and fn is not None:
                    work = self._try_native((backend, input_shard.device.type, "all_gather", input_shard.dtype),
                                            lambda: fn(output_flat, input_shard, group=group, async_op=True))
                    if work is not None:
                        self._count("all_gather", ring_bytes("all_gather", nbytes, ws), False)
                        return [work], None
                # emulation: list all-gather straight into views of the output (same bytes)
                chunks = list(output_flat.view(-1).chunk(ws))
                work = dist.all_gather(chunks, input_shard.view(-1), group=group, async_op=True)
                self._count("all_gather", ring_bytes("all_gather", nbytes, ws), True)
                return [work], None
            return self._issue("all_gather", rank, body, (output_flat, input_shard))

    def all_reduce(self, tensor: torch.Tensor, op=SUM, group: Any = None) -> Handle:
        """In place: tensor = op(tensor over ranks)."""
        group = self._group(group)
        rank, ws = self.rank(group), self.world_size(group)
        if not tensor.is_contiguous():
            raise ValueError("all_reduce: tensor must be contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        with record_function("zerotier::all_reduce"):
            if not self._active():
                return Handle("all_reduce", rank, self.timeout_s)

            group, backend = self.route(tensor.device, group)

            def body():
                work, divisor = self._all_reduce_work(tensor, group, backend, op, ws)
                self._count("all_reduce", ring_bytes("all_reduce", nbytes, ws), divisor != 1)
                return [work], _divider(tensor, divisor)
            return self._issue("all_reduce", rank, body, (tensor,))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, group: Any = None) -> Handle:
        """In place: tensor = rank `src`'s tensor (src is a global rank), e.g. initial weights."""
        group = self._group(group)
        rank, ws = self.rank(group), self.world_size(group)
        if not tensor.is_contiguous():
            raise ValueError("broadcast: tensor must be contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        with record_function("zerotier::broadcast"):
            if not self._active():
                return Handle("broadcast", rank, self.timeout_s)

            group, _ = self.route(tensor.device, group)

            def body():
                work = dist.broadcast(tensor, src=src, group=group, async_op=True)
                self._count("broadcast", ring_bytes("broadcast", nbytes, ws), False)
                return [work], None
            return self._issue("broadcast", rank, body, (tensor,))

    def check_all_ranks(self, ok: bool, what: str, group: Any = None) -> None:
        """A sync point every rank reaches: raise CollectiveError on every rank if any is not `ok`.

        For failures one rank catches while the others are still in step (a bad batch, a
        non-finite check, a failed checkpoint write): all ranks stop with an error naming the
        failed ranks instead of the healthy ones waiting in the next collective.
        """
        group = self._group(group)
        rank, ws = self.rank(group), self.world_size(group)
        flags = torch.zeros(ws, dtype=torch.int32)  # host: a group without a CPU backend routes it to gloo
        flags[rank] = 0 if ok else 1
        self.all_reduce(flags, SUM, group).wait()
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        if failed:
            names = ", ".join(map(str, failed))
            raise CollectiveError(f"rank {rank}: {what}: rank(s) {names} failed; see their log")

    # ------------------------------------------------------------ internals

    def _issue(self, kind: str, rank: int, body: Callable[[], tuple[list, Callable | None]],
               keep: tuple) -> Handle:
        """Run `body` (which issues async works and returns them with a finishing step) per
        [Note: where collectives run]."""
        on_cuda = keep[0].is_cuda
        if on_cuda and self.overlap:
            if self.stream is None:
                self.stream = torch.cuda.Stream(keep[0].device)
            self.stream.wait_stream(torch.cuda.current_stream(keep[0].device))  # inputs queued on compute are ready
            with torch.cuda.stream(self.stream):
                works, finish = body()
                for work in works:  # NCCL: makes self.stream wait for the collective; host does not block
                    work.wait()
                if finish is not None:
                    finish()
                done = torch.cuda.Event()
                done.record(self.stream)
            return Handle(kind, rank, self.timeout_s, event=done, keep=keep)
        works, finish = body()
        handle = Handle(kind, rank, self.timeout_s, works=works, finish=finish, keep=keep)
        if not self.overlap:
            handle.wait()
        return handle

    def _try_native(self, key: Hashable, call: Callable[[], Any]) -> Any:
        """The work of `call()`, or None when the backend refused it or is not probed ([Note: native
        or emulated]). key[:2] is (the backend that runs it, the tensors' device type)."""
        backend, device_type = key[0], key[1]
        if backend == "nccl":
            return call()
        if device_type != "cpu":
            return None
        if self._native.get(key) is False:
            return None
        try:
            work = call()
        except _UNSUPPORTED as exc:
            if isinstance(exc, _REAL_FAILURES) or self._native.get(key):
                raise
            self._native[key] = False
            return None
        self._native[key] = True
        return work

    def _reducing(self, kind: str, backend: str, device_type: str, dtype: torch.dtype, op, ws: int,
                  call: Callable[[Any], Any]) -> tuple[Any, int]:
        """Issue call(op) natively; where AVG is refused, call(SUM) and return the divisor."""
        work = self._try_native((backend, device_type, kind, dtype, op), lambda: call(op))
        if work is not None:
            return work, 1
        if op == AVG:
            work = self._try_native((backend, device_type, kind, dtype, SUM), lambda: call(SUM))
            if work is not None:
                return work, ws
        return None, 1

    def _all_reduce_work(self, tensor: torch.Tensor, group: Any, backend: str, op, ws: int) -> tuple[Any, int]:
        work, divisor = self._reducing("all_reduce", backend, tensor.device.type, tensor.dtype, op, ws,
                                       lambda o: dist.all_reduce(tensor, op=o, group=group, async_op=True))
        if work is None:
            # Not probed (a device tensor): the plain call, AVG as SUM. On the CPU, SUM was refused
            # too: this call raises the backend's own reason.
            divisor = ws if op == AVG else 1
            work = dist.all_reduce(tensor, op=SUM if op == AVG else op, group=group, async_op=True)
        return work, divisor


def backends_by_device(group: Any = None) -> dict[str, str]:
    """{device type: backend name} of a process group, as torch made it ([Note: which group runs
    a collective]): "cpu:gloo,cuda:nccl" -> {"cpu": "gloo", "cuda": "nccl"}; "nccl" ->
    {"cuda": "nccl"}; a group made without a backend or by a plugin name -> the devices torch
    made a backend for, never a guess from the name."""
    config = str(dist.get_backend_config(group))
    pairs = (pair.split(":", 1) for pair in config.split(",") if pair.strip())
    return {device.strip(): backend.strip() for device, backend in pairs}


def _first_attr(names: Sequence[str]) -> Callable | None:
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    return None


def _divider(tensor: torch.Tensor, divisor: int) -> Callable[[], None] | None:
    if divisor == 1:
        return None
    return lambda: tensor.div_(divisor)


def _check_pair(kind: str, shard: torch.Tensor, flat: torch.Tensor, ws: int, shard_name: str,
                flat_name: str) -> None:
    if flat.numel() != ws * shard.numel():
        raise ValueError(f"{kind}: {flat_name} has {flat.numel()} elements, expected world_size ({ws}) x "
                         f"{shard_name} ({shard.numel()}) = {ws * shard.numel()}; pad the flat with "
                         "zerotier.dist.padded_numel")
    if shard.dtype != flat.dtype or shard.device != flat.device:
        raise ValueError(f"{kind}: {shard_name} ({shard.dtype}, {shard.device}) and {flat_name} "
                         f"({flat.dtype}, {flat.device}) must have the same dtype and device")
    if not (shard.is_contiguous() and flat.is_contiguous()):
        raise ValueError(f"{kind}: {shard_name} and {flat_name} must be contiguous")
