"""Models built on the meta device, materialized one unit at a time.

[Note: meta-device models]
A model built under `torch.device("meta")` has shapes but no bytes, so a model larger than
RAM can be described before it is trained. `initialize` gives it bytes unit by unit, each
straight before that unit goes to its tier (engine/placement.py), so at most two units'
full-precision tensors exist in RAM at a time (the one being placed and the next one,
[Note: materializing ahead]):
  1. every module holding one of the unit's parameters gets new CPU Parameters (and
     buffers) in place of its meta ones — new objects, because a meta tensor's data cannot
     be replaced — in every module that shares them (tied weights);
  2. the module initializes them: `init_fn(module)` when the user gives one (for a
     transformers PreTrainedModel, its own `_init_weights(module)` when none is given: what
     transformers runs on a model it builds, Conv1D and RMSNorm included), else the
     module's own `reset_parameters()` (nn.Linear, nn.Embedding, norms ...). A module with
     neither, or with buffers that reset_parameters() does not set (only torch's norm
     layers reset theirs), is a ConfigError naming it: never uninitialized memory.
     Floating tensors start as NaN, so what init_fn did not set in full is seen: those
     tensors get the module's reset_parameters() (the tensors init_fn did set are kept),
     as a model built on the CPU has them before the user's init runs; a module with no
     reset_parameters() is a ConfigError naming the tensors left unset. Other dtypes
     start as zeros;
  3. the random stream is the user's seed forked per unit (`torch.initial_seed() + unit
     index`), so the weights do not depend on placement, ZeRO stage or world size.
The Unit is rebuilt with the new Parameter objects; everything after works as for a model
built normally.

[Note: materialization in the host pool]
A unit's new tensors are bytes the budgets must see: a 4096 x 16384 Linear is 268 MB in
fp32, and on the heap its tensors, their concatenation and the low-precision cast were
2.5x that beyond tiers.host (202M parameters at dim 4096: initialize's RSS peak 646 MiB
over the pool's; 6 MiB now: docs/tiers.md § RSS beyond the budgets). So with a host pool,
a unit whose parameters are all meta and of one dtype gets one pool block, laid out as the
unit's flat (Unit.offsets): its parameters are views of it, `flat(unit)` hands the block to
placement without a concatenation, `cast(unit, t, dtype)` makes the low-precision copy in
the pool too, and `release(unit)` gives both up once the stores have copied what they keep
(each store copies into blocks of its own) and the caller has dropped its views. They are
kept as spares (flats and casts, at most 1 + AHEAD of each: the units that may hold bytes at
once, so a slow worker that finds two released before it takes one keeps both) for the next unit: a model's layers are units of one
size, so the next one reuses them with their pages mapped (and, on CUDA, registered), where a
fresh block per unit faulted in every page (and cudaHostRegister'ed it) again: on this
machine the NaN fill ran at the 0.7-0.8 GB/s of first touch. A spare of another size goes
back to the system (not to the pool's cache: no other request has its size) before a new
block is allocated, so no more blocks are held than the plan counts in tiers.host
(`pool_bytes`); finish() gives the last ones back. A pool at its budget first waits for its blocks parked behind
NVMe writes ([Note: a full pool waits] in tiers/host.py), then raises BudgetError naming
what the budget would need. Buffers and units of mixed dtypes stay on the heap (small, or
rare).
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Callable

import torch

from .errors import ConfigError
from .setup_times import SetupTimes
from .state import Unit
from .tiers.host import HostBuffer, HostPool

AHEAD = 1  # [Note: materializing ahead]: units materialized while an earlier one is placed

_RESETS_BUFFERS = (torch.nn.modules.batchnorm._NormBase,)  # reset_parameters() resets running stats


def _unset_like(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor shaped like meta `t` whose unset elements can be seen: NaN, or 0 for non-floats."""
    if t.is_floating_point() or t.is_complex():
        return torch.full_like(t, float("nan"), device="cpu")
    return torch.zeros_like(t, device="cpu")


def _tensors(module: torch.nn.Module, names) -> dict[str, torch.Tensor]:
    found = {n: module._parameters.get(n) for n in names}
    found.update({n: module._buffers.get(n) for n in names if found[n] is None})
    return {n: t for n, t in found.items() if t is not None}


def _has_nan(t: torch.Tensor) -> bool:
    """Whether `t` holds a NaN. A NaN makes the sum NaN, so a finite sum (one read, no temporary)
    settles it; only a sum that is not finite (a NaN, or an overflow) is searched element-wise."""
    return not bool(torch.isfinite(t.sum())) and bool(torch.isnan(t).any())


def _unset(module: torch.nn.Module, names) -> list[str]:
    """The materialized tensors of `module` still holding a NaN (never set, or set in part)."""
    return [n for n, t in _tensors(module, names).items()
            if (t.is_floating_point() or t.is_complex()) and _has_nan(t)]


def is_meta(unit: Unit) -> bool:
    return any(p.is_meta for p in unit.params)


def pool_bytes(units: list[Unit], lp_dtype: torch.dtype, alignment: int) -> int:
    """Host-pool bytes that initialize's materialization of `units` holds at once: the largest meta
    unit's flat and its low-precision cast ([Note: materialization in the host pool]), and the flats
    of the AHEAD next largest, materialized meanwhile ([Note: materializing ahead]); the planner
    counts them in tiers.host."""
    pooled = sorted((u.numel * u.params[0].dtype.itemsize, u.numel * lp_dtype.itemsize) for u in units
                    if is_meta(u) and len({p.dtype for p in u.params}) == 1)
    if not pooled:
        return 0
    flat, cast = pooled.pop()
    ahead = pooled[-AHEAD:] if AHEAD else []
    return flat + cast + 2 * alignment + sum(f + alignment for f, _ in ahead)


def default_init_fn(model: torch.nn.Module) -> Callable[[torch.nn.Module], None] | None:
    """A transformers PreTrainedModel's own init ([Note: meta-device models]), else None. By class
    name along the MRO, so that transformers is not imported for other models."""
    if any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
           for c in type(model).__mro__) and hasattr(model, "_init_weights"):
        return _TransformersInit(model)
    return None


class _TransformersInit:
    """model._init_weights on a module, then on its ancestors, innermost first, as transformers'
    model.apply (children before parents) runs it: GPT-2's attention block rescales its c_proj. The
    tensors of other modules are flagged _is_hf_initialized meanwhile, which transformers' init
    functions skip: they are meta, or placed with an earlier unit."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.ancestors: dict[int, list[torch.nn.Module]] = {}
        names = {id(m): n for n, m in model.named_modules()}
        by_name = dict(model.named_modules())
        for m_id, name in names.items():
            parts = name.split(".") if name else []
            self.ancestors[m_id] = [by_name[".".join(parts[:i])] for i in range(len(parts) - 1, -1, -1)]

    def __call__(self, module: torch.nn.Module) -> None:
        self.model._init_weights(module)
        own = {id(t) for t in (*module._parameters.values(), *module._buffers.values()) if t is not None}
        for ancestor in self.ancestors.get(id(module), ()):
            others = [t for t in (*ancestor.parameters(), *ancestor.buffers())
                      if id(t) not in own and not hasattr(t, "_is_hf_initialized")]
            for t in others:
                t._is_hf_initialized = True
            try:
                self.model._init_weights(ancestor)
            finally:
                for t in others:
                    del t._is_hf_initialized


class Materializer:
    def __init__(self, model: torch.nn.Module, init_fn: Callable[[torch.nn.Module], None] | None = None,
                 host_pool: HostPool | None = None, times: SetupTimes | None = None):
        init_fn = init_fn if init_fn is not None else default_init_fn(model)
        self.model, self.init_fn, self.host_pool = model, init_fn, host_pool
        self.times = times if times is not None else SetupTimes()  # [Note: initialize's phases]
        self.seed = torch.initial_seed()
        # every (module, name) slot holding each parameter: tied ones are replaced everywhere
        self._slots: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        self._owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
        for mod_name, module in model.named_modules():
            for name, p in module._parameters.items():
                if p is not None:
                    self._slots.setdefault(id(p), []).append((module, name))
                    self._owners.setdefault(id(p), []).append((mod_name, module))
        self.replaced: dict[int, torch.nn.Parameter] = {}  # id(meta parameter) -> its materialized one
        self._meta: list[tuple[dict, str, torch.Tensor]] = []  # (module dict, name, meta tensor) replaced
        # (frozen, unit index) -> the pool blocks of its materialized flat and its cast ([Note: materialization in the host pool])
        self._blocks: dict[tuple[bool, int], list[HostBuffer]] = {}
        self._spares: dict[str, list[HostBuffer]] = {"flat": [], "cast": []}  # released, for the next units
        self._spares_lock = threading.Lock()  # the worker takes flats, the caller releases them ([Note: materializing ahead])

    def undo(self) -> None:
        """Every parameter and buffer this materializer replaced goes back to its meta tensor: after a
        failed initialize (an init_fn raising) the model is as the user built it."""
        for slots, name, meta in reversed(self._meta):
            slots[name] = meta
        self._meta.clear()
        self.replaced.clear()
        for key in list(self._blocks):
            self._free(key)
        self.finish()

    def unit(self, unit: Unit) -> Unit:
        """[Note: meta-device models] The unit with real CPU parameters, initialized."""
        modules = {}
        for p in unit.params:
            for name, module in self._owners.get(id(p), ()):
                modules.setdefault(id(module), (name, module))
        with self.times.phase("fill", unit.numel):
            into = self._pool_views(unit)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + unit.index)
            for name, module in modules.values():
                self._module(name, module, into)
        return dataclasses.replace(unit, params=tuple(self.replaced.get(id(p), p) for p in unit.params))

    def _pool_views(self, unit: Unit) -> dict[int, torch.Tensor]:
        """id(meta parameter) -> its view of the unit's pool block, NaN-filled (or zeros); {} where
        the unit's tensors stay on the heap ([Note: materialization in the host pool])."""
        dtypes = {p.dtype for p in unit.params}
        if self.host_pool is None or len(dtypes) != 1 or any(id(p) in self.replaced for p in unit.params):
            return {}
        (dtype,) = dtypes
        block = self._alloc("flat", unit.numel * dtype.itemsize, dtype,
                            f"materializing unit '{unit.name or '<root>'}' ({unit.numel:,} {dtype})")
        self._blocks[(unit.frozen, unit.index)] = [block]
        flat = block.tensor
        flat.fill_(float("nan")) if flat.is_floating_point() or flat.is_complex() else flat.zero_()
        return {id(p): view for p, view in unit.views(flat)}

    def flat(self, unit: Unit) -> torch.Tensor | None:
        """The unit's materialized flat in its pool block (Unit.offsets layout), or None."""
        blocks = self._blocks.get((unit.frozen, unit.index))
        return blocks[0].tensor if blocks else None

    def cast(self, unit: Unit, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`t` in `dtype`: a copy in the pool while the unit holds a block (freed by release), else t.to()."""
        blocks = self._blocks.get((unit.frozen, unit.index))
        if not blocks or t.dtype == dtype:
            return t.to(dtype)
        out = self._alloc("cast", t.numel() * dtype.itemsize, dtype, f"unit '{unit.name or '<root>'}' as {dtype}")
        blocks.append(out)
        return out.tensor.copy_(t.reshape(-1)).view(t.shape)

    def release(self, unit: Unit) -> None:
        """Free the unit's pool blocks: the stores have copied what they keep, and the parameters
        view the engine's flats by now."""
        self._free((unit.frozen, unit.index))

    def finish(self) -> None:
        """Give the spare blocks back to the system: every unit is placed."""
        with self._spares_lock:
            spares = [b for kind in self._spares.values() for b in kind]
            self._spares = {kind: [] for kind in self._spares}
        for block in spares:
            self.host_pool.free(block, cache=False)

    def _alloc(self, kind: str, nbytes: int, dtype: torch.dtype, what: str) -> HostBuffer:
        """A block for a unit's flat or cast: a spare one when its size and dtype fit, else a new one,
        the spares of other sizes given back first ([Note: materialization in the host pool])."""
        with self._spares_lock:
            spares = self._spares[kind]
            fit = next((b for b in spares if b.nbytes == nbytes and b.dtype == dtype), None)
            if fit is not None:
                spares.remove(fit)
                return fit
            others, self._spares[kind] = spares, []
        for block in others:
            self.host_pool.free(block, cache=False)  # one-off sizes: back to the system
        return self.host_pool.alloc(nbytes, dtype, what)

    def _keep(self, kind: str, block: HostBuffer) -> None:
        with self._spares_lock:
            spares = self._spares[kind]
            spares.append(block)
            old = spares.pop(0) if len(spares) > 1 + AHEAD else None
        if old is not None:
            self.host_pool.free(old, cache=False)

    def _free(self, key: tuple[bool, int]) -> None:
        blocks = self._blocks.pop(key, ())
        for i, block in enumerate(blocks):  # the flat, then its cast
            self._keep("flat" if i == 0 else "cast", block)

    def _module(self, name: str, module: torch.nn.Module, into: dict[int, torch.Tensor] | None = None) -> None:
        meta_params = [(n, p) for n, p in module._parameters.items() if p is not None and p.is_meta]
        meta_buffers = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta_params and not meta_buffers:
            return  # done with an earlier unit (a tied parameter's other owner)
        label = f"module '{name or '<root>'}' ({type(module).__name__})"
        if self.init_fn is None and not hasattr(module, "reset_parameters"):
            raise ConfigError(f"{label} was built on the meta device and has no reset_parameters(): pass "
                              "zerotier.initialize(model, config, init_fn=fn), where fn(module) initializes a "
                              "module's parameters in place")
        if meta_buffers and self.init_fn is None and not isinstance(module, _RESETS_BUFFERS):
            raise ConfigError(f"{label} has buffers on the meta device ({', '.join(meta_buffers)}) that "
                              "reset_parameters() does not set: pass init_fn=fn to zerotier.initialize so that "
                              "fn(module) fills them")
        for n, p in meta_params:
            data = into[id(p)] if into and id(p) in into else _unset_like(p)
            new = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            for holder, slot in self._slots[id(p)]:
                self._meta.append((holder._parameters, slot, holder._parameters[slot]))
                holder._parameters[slot] = new
            self.replaced[id(p)] = new
        for n in meta_buffers:
            self._meta.append((module._buffers, n, module._buffers[n]))
            module._buffers[n] = _unset_like(module._buffers[n])
        names = [n for n, _ in meta_params] + meta_buffers
        numel = sum(t.numel() for t in _tensors(module, names).values())
        with torch.no_grad():
            if self.init_fn is not None:
                with self.times.phase("init", numel):
                    self.init_fn(module)
                with self.times.phase("check", numel):
                    unset = _unset(module, names)
                if unset and hasattr(module, "reset_parameters"):
                    kept = {n: t.clone() for n, t in _tensors(module, names).items() if n not in unset}
                    module.reset_parameters()
                    for n, t in _tensors(module, kept).items():
                        t.copy_(kept[n])
                    unset = _unset(module, names)
            else:
                with self.times.phase("init", numel):
                    module.reset_parameters()
                with self.times.phase("check", numel):
                    unset = _unset(module, names)
        if unset:
            by = "init_fn" if self.init_fn is not None else "reset_parameters()"
            fix = (f"and {type(module).__name__} has no reset_parameters(): set them in init_fn"
                   if not hasattr(module, "reset_parameters") else
                   "even after its reset_parameters(): set them in init_fn")
            raise ConfigError(f"{label}: {by} left {', '.join(unset)} unset (or not set in full) {fix} "
                              "([Note: meta-device models])")

    def rest(self) -> None:
        """Modules no unit covers (frozen parameters, buffers only) that are still on meta."""
        for name, module in self.model.named_modules():
            if any(t is not None and t.is_meta for t in (*module._parameters.values(), *module._buffers.values())):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.seed - 1)
                    self._module(name, module)


class Ahead:
    """[Note: materializing ahead]
    Drawing a unit's weights is serial work when it uses torch's CPU generator (one thread draws
    each tensor), while placing a unit (casts, the optimizer's copies, NVMe writes issued) is
    memory- and drive-bound work of the caller's thread. So one worker thread materializes the
    meta units in their order while the caller places the ones before: at most 1 + AHEAD units
    hold materialized bytes at once (the one being placed, with its cast, and AHEAD flats; the
    plan counts them: pool_bytes), so memory stays bounded by units, never a whole model.
    Threads: the worker's ops run on one thread and the caller keeps all T of torch's
    (torch.get_num_threads()): the worker's longest phase, the draw, is serial anyway, while the
    caller's phases (casts, the optimizer's copies) are memory-bound and lost ~half their speed
    on a share (T // 4 to the worker cost 14% at T = 2: docs/benchmarks.md). So T + 1 threads
    run, one of them mostly on serial draws. torch.set_num_threads is per thread here (OpenMP's
    nthreads ICV: a team per thread), except that it also sets the count a thread started later
    begins with, so the caller sets T again once the worker has set its 1. With T = 1 it is the
    serial path.
    The weights are those of the serial path, bit for bit: each unit reseeds torch's generator
    from its own index ([Note: meta-device models]), the worker is the only thread drawing from
    it meanwhile (placement draws nothing), and it materializes the units in the serial order
    (a tied parameter goes to the same unit first). The worker takes the caller's CUDA device and
    default device, which are per thread. An error in the worker (an init_fn raising) is raised
    by `take` in the caller, for that unit; `close` stops the worker after its current unit,
    before a failed initialize gives the model back ([Note: a failed initialize]).
    AHEAD = 0 is the serial path: `take` materializes in the caller's thread."""

    def __init__(self, materializer: Materializer, units: list[Unit]):
        self.materializer = materializer
        self._results: queue.Queue = queue.Queue()
        self._room = threading.Semaphore(1 + AHEAD)  # units holding bytes at once
        self._stop = False
        self._thread = None
        threads = torch.get_num_threads()
        if AHEAD and units and threads > 1:
            cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None
            one_thread = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(units, one_thread, cuda, torch.get_default_device()),
                                            name="zerotier-materialize", daemon=True)
            self._thread.start()
            one_thread.wait()
            torch.set_num_threads(threads)  # threads started from now on begin with T, not the worker's 1

    def _run(self, units: list[Unit], one_thread: threading.Event, cuda: int | None,
             default_device: torch.device) -> None:
        try:
            torch.set_num_threads(1)
        finally:
            one_thread.set()
        if cuda is not None:
            torch.cuda.set_device(cuda)
        if default_device.type != "cpu":
            torch.set_default_device(default_device)
        for unit in units:
            self._room.acquire()
            if self._stop:
                return
            try:
                self._results.put((unit, self.materializer.unit(unit)))
            except BaseException as exc:  # noqa: BLE001 - raised by take() in the caller
                self._results.put((unit, exc))
                return

    def take(self, unit: Unit) -> Unit:
        """`unit` materialized ([Note: meta-device models]); call done() once its bytes are released."""
        if self._thread is None:
            return self.materializer.unit(unit)
        with self.materializer.times.phase("wait"):
            got, out = self._results.get()
        assert got is unit, (got.name, unit.name)  # the same order as the caller's
        if isinstance(out, BaseException):
            raise out
        return out

    def done(self) -> None:
        """The unit last taken has released its materialized bytes: the worker may start the next."""
        self._room.release()

    def close(self) -> None:
        """Stop the worker (after the unit it is materializing) and wait for it."""
        if self._thread is not None:
            self._stop = True
            self._room.release()
            self._thread.join()
            self._thread = None
