"""Each unit's forward and backward, measured on the device, one unit's parameters at a time.

[Note: measuring units]
The planner's compute figures ([Note: step-time prediction] in predict.py) are measured, not
guessed, and a model that exists only on the meta device never exists whole:

  1. capture: one forward of the whole model under no_grad, with the root unit's own tensors
     resident and each top-level wrapped module (a transformer block) given tensors by a
     forward pre-hook and stripped again by its post-hook. Each block's inputs are kept for
     the first block of each signature (class, parameter shapes, input shapes) and every
     block's output is kept (one micro-batch's activations, what training saves anyway);
  2. each distinct block: its tensors made resident, a forward on its captured inputs and
     a backward from a random gradient of its output, each timed (the median of at least
     `repeat` runs after a warm-up, and of more while the timed runs last under MIN_TIMED_S
     together: a block of a few milliseconds is timed over dozens of runs, whose median
     holds still where three runs' did not: [Note: timing small units]); blocks of the same
     signature share the figures;
  3. the root's own work (embeddings, head, loss): the model's forward and backward with
     every block replaced by a stand-in returning its captured output (tied to the block's
     input so the gradient flows back to the embeddings), the root's tensors resident. Of its
     backward, the part after the first block's input has its gradient is timed apart: the
     embeddings' backward, which the engine runs after every block's ([Note: the root's
     backward comes in two parts]).

The warm-up runs of steps 2 and 3 also count the bytes their forward saves for backward, summed
over every block and the root: one micro-batch's activations ([Note: activation memory] in
activations.py).

Resident tensors are fresh ones on the device in precision.param_dtype (floating buffers
too, as the engine casts them): normal(0, 0.02) for meta parameters, zeros for meta
buffers, a copy for real ones; the module gets its own tensors back afterwards. Values
do not change a dense model's time; data-dependent work (MoE routing) is measured for
these weights only. A wrapped module nested inside a block is timed inside the block (its
own unit gets no compute of its own). The loss is the output itself when a scalar, its
`.loss`, else the sum of its first tensor.

[Note: timing small units]
bench_planner --quick's blocks run a few milliseconds each. Three timed runs after one warm-up gave
the same GPT-2 shape a backward of 39-70 ms from one plan to the next on this VM (the first plan of
a process the slowest), against 45 ms for plain torch; the step prediction moved with it by 30%.
So the runs go on until they last MIN_TIMED_S together (at most MAX_RUNS): the large blocks of a
real model take `repeat` runs as before, small ones enough for a median that holds.

[Note: units timed under the engine's allocator]
On a CPU device, compute's temporaries come from glibc's malloc, and the engine pins its mmap
threshold at 4 MiB when it makes its host pool ([Note: heap bound] in tiers/host.py): from then
on every temporary of 4 MiB or more (the quick GPT-2's logits, their gradient, the embedding's
gradient: 60 MB a step) is a fresh mapping, page-faulted in on each use. Before the pin, glibc's
threshold rises to the largest chunk freed and such temporaries are reused from the heap. Plain
torch in an unpinned process measured 65 ms a step with 2 page faults; the engine's step of the
same model 91-94 ms with 15,300 (1.8 us each on this VM), and plain torch after the pin faulted
as often and ran as slowly. So `measure` pins the threshold first (`bound_heap`, as the engine
will), and the units' times include what the engine's step pays for its temporaries.

[Note: a block's inputs, fresh per run]
A block may change an object among its inputs: a Hugging Face decoder layer appends its keys and
values to the model's KV cache (`past_key_values`, on while `use_cache` is, the default), an
object pytree does not look into. So the capture keeps a deep copy taken when the block is
entered (later layers grow the cache too), and each timed run gets a deep copy of that: a
shared cache would make run 2 attend over run 1's keys and back through its freed graph.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from .activations import SavedBytes
from .predict import UnitCompute
from ..state import build_units, wrapped_modules
from ..tiers.host import bound_heap


MIN_TIMED_S = 0.25  # [Note: timing small units]: a block's timed runs last at least this long together
MAX_RUNS = 64


def _enough(fwd: list[float], bwd: list[float], repeat: int) -> bool:
    """[Note: timing small units] At least `repeat` timed runs, and MIN_TIMED_S of them (or MAX_RUNS)."""
    return len(fwd) >= repeat and (sum(fwd) + sum(bwd) >= MIN_TIMED_S or len(fwd) >= MAX_RUNS)


def measure(model: torch.nn.Module, inputs: tuple | Callable[[], tuple], device: torch.device,
            dtype: torch.dtype, wrap="auto", repeat: int = 3) -> UnitCompute:
    """[Note: measuring units] Forward and backward seconds of every unit for one micro-batch."""
    if device.type == "cpu":
        bound_heap()  # [Note: units timed under the engine's allocator]
    args = inputs() if callable(inputs) else inputs
    if not isinstance(args, tuple):
        args = (args,)
    args = pytree.tree_map(lambda t: _to(t, device, dtype) if isinstance(t, torch.Tensor) else t, args)
    units = build_units(model, wrap)
    wrapped = wrapped_modules(model, wrap)
    modules = dict(model.named_modules())
    blocks = [n for n in sorted(wrapped, key=list(modules).index) if n and _enclosing(n, wrapped) == ""]
    clock = _Clock(device)
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    with _Resident(model, _own_modules(model, "", wrapped), device, dtype):
        captured = _capture(model, blocks, modules, wrapped, args, device, dtype)
        timed: dict[tuple, tuple[float, float, int]] = {}
        activations = 0  # [Note: activation memory]: every block's saved tensors live until its backward
        for name in blocks:
            key = captured.signature[name]
            if key not in timed:
                with _Resident(model, _subtree(modules, name), device, dtype):
                    timed[key] = _time_block(modules[name], *captured.inputs[key], clock, repeat)
            fwd[name], bwd[name], saved = timed[key]
            activations += saved
        fwd[""], bwd[""], root_tail, saved = _time_root(model, blocks, modules, captured.outputs, args, clock, repeat)
        activations += saved
    by_unit = {}
    for unit in units:  # a module's trainable unit carries its compute (else its frozen one)
        by_unit.setdefault(unit.name, unit.index)
    forward_s, backward_s, tail_s = [0.0] * len(units), [0.0] * len(units), [0.0] * len(units)
    for name, index in by_unit.items():
        forward_s[index], backward_s[index] = fwd.get(name, 0.0), bwd.get(name, 0.0)
        tail_s[index] = root_tail if name == "" else 0.0
    return UnitCompute(tuple(forward_s), tuple(backward_s), tuple(u.name == "" for u in units), activations,
                       tuple(tail_s))


def _to(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return t.to(device, dtype if t.is_floating_point() else t.dtype)


def _enclosing(name: str, wrapped: set[str]) -> str:
    """The nearest wrapped module strictly enclosing `name`."""
    while name:
        name = name.rpartition(".")[0]
        if name in wrapped:
            return name
    return ""


def _own_modules(model: torch.nn.Module, root: str, wrapped: set[str]) -> list[torch.nn.Module]:
    """The modules whose tensors belong to wrapped module `root` itself (not to a wrapped one inside)."""
    out = []
    for name, module in model.named_modules():
        inner = name if name in wrapped else _enclosing(name, wrapped)
        if inner == root:
            out.append(module)
    return out


def _subtree(modules: dict[str, torch.nn.Module], name: str) -> list[torch.nn.Module]:
    return [m for n, m in modules.items() if n == name or n.startswith(name + ".")]


class _Resident:
    """The modules' parameters and buffers as fresh device tensors while inside; put back after."""

    def __init__(self, model, modules, device, dtype):
        self.modules, self.device, self.dtype = modules, device, dtype
        self.saved: list[tuple[dict, str, Any]] = []

    def __enter__(self):
        for module in self.modules:
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    self.saved.append((table, name, t))
                    new = self._fresh(t, table is module._parameters)
                    table[name] = torch.nn.Parameter(new, requires_grad=t.requires_grad) \
                        if table is module._parameters else new
        return self

    def _fresh(self, t: torch.Tensor, is_param: bool) -> torch.Tensor:
        dtype = self.dtype if t.is_floating_point() else t.dtype
        if not t.is_meta:
            return t.detach().to(self.device, dtype, copy=True)
        if is_param and t.is_floating_point():
            return torch.randn(t.shape, device=self.device, dtype=dtype) * 0.02
        return torch.zeros(t.shape, device=self.device, dtype=dtype)

    def __exit__(self, *exc):
        for table, name, t in reversed(self.saved):
            table[name] = t
        self.saved.clear()


class _Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        """A point in the device's work now (from a hook inside a timed call), for `since`."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def since(self, mark) -> float:
        """Seconds from `mark` to the end of the device's work so far."""
        if not self.cuda:
            return time.perf_counter() - mark
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return mark.elapsed_time(end) / 1e3

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out


class _Captured:
    def __init__(self):
        self.signature: dict[str, tuple] = {}
        self.inputs: dict[tuple, tuple[tuple, dict]] = {}
        self.outputs: dict[str, Any] = {}


def _shapes(tree) -> tuple:
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                 for t in pytree.tree_leaves(tree))


def _capture(model, blocks, modules, wrapped, args, device, dtype) -> _Captured:
    """Step 1 of [Note: measuring units]: every block's output, each signature's inputs."""
    got = _Captured()
    resident: dict[str, _Resident] = {}
    handles = []
    for name in blocks:
        module = modules[name]

        def pre(mod, a, kw, name=name):
            resident[name] = _Resident(model, _subtree(modules, name), device, dtype).__enter__()
            params = tuple((tuple(p.shape), p.dtype) for p in mod.parameters())
            key = (type(mod).__name__, params, _shapes((a, kw)))
            got.signature[name] = key
            if key not in got.inputs:  # a copy: the model may change these objects later (a KV cache)
                got.inputs[key] = copy.deepcopy(pytree.tree_map(_detached, (a, kw)))

        def post(mod, a, kw, out, name=name):
            got.outputs[name] = pytree.tree_map(_detached, out)
            resident.pop(name).__exit__()

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in handles:
            h.remove()
        for r in resident.values():
            r.__exit__()
    return got


def _detached(x):
    return x.detach() if isinstance(x, torch.Tensor) else x


def _grad_leaves(out) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def _time_block(module, args, kwargs, clock: _Clock, repeat: int) -> tuple[float, float, int]:
    """Step 2: a block's forward and backward on its captured inputs (median after a warm-up), and
    the bytes its forward saves for backward."""
    def leaf(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().requires_grad_(True)
        return x

    fwd, bwd = [], []
    saved = SavedBytes(_own_tensors(module))  # [Note: activation memory], in the warm-up run
    i = 0
    while not _enough(fwd, bwd, repeat):  # [Note: a block's inputs, fresh per run]
        a, kw = pytree.tree_map(leaf, copy.deepcopy((args, kwargs)))
        with saved if i == 0 else contextlib.nullcontext():
            tf, out = clock(lambda: module(*a, **kw))
        outs = _grad_leaves(out)
        grads = [torch.randn_like(t) for t in outs]
        tb, _ = clock(lambda: torch.autograd.backward(outs, grads))
        if i:  # the first run warms caches and kernels up
            fwd.append(tf)
            bwd.append(tb)
        i += 1
    return statistics.median(fwd), statistics.median(bwd), saved.bytes


def _own_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Its resident parameters and buffers: state, not activations."""
    return [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]


def _time_root(model, blocks, modules, outputs, args, clock: _Clock,
               repeat: int) -> tuple[float, float, float, int]:
    """Step 3: the model with every block standing in by its captured output: its forward, its
    backward and the backward's tail (after the first block's input has its gradient); and the
    bytes the root's own forward saves for backward."""
    reached: list = []  # this run's mark: the first block's input has its gradient

    def stand_in(name):
        def forward(*a, **kw):
            x = next((t for t in pytree.tree_leaves((a, kw)) if isinstance(t, torch.Tensor) and t.requires_grad),
                     None)
            tie = [x is not None]
            if x is not None and name == blocks[0]:
                x.register_hook(lambda grad: reached.append(clock.mark()))

            def attach(t):
                if tie[0] and isinstance(t, torch.Tensor) and t.is_floating_point():
                    tie[0] = False
                    return t + x.reshape(-1)[0] * 0  # the gradient reaches the block's input
                return t
            return pytree.tree_map(attach, outputs[name])
        return forward

    fwd, bwd, tail = [], [], []
    saved = SavedBytes(_own_tensors(model))
    try:
        for name in blocks:
            modules[name].forward = stand_in(name)
        i = 0
        while not _enough(fwd, bwd, repeat):  # [Note: timing small units]
            with saved if i == 0 else contextlib.nullcontext():
                tf, out = clock(lambda: _loss(model(*args)))
            reached.clear()

            def backward() -> float:  # the seconds since the first block's input had its gradient
                out.backward()
                return clock.since(reached[0]) if reached else 0.0
            tb, tt = clock(backward)
            if i:
                fwd.append(tf)
                bwd.append(tb)
                tail.append(min(tt, tb))
            i += 1
    finally:
        for name in blocks:
            modules[name].__dict__.pop("forward", None)  # the class's forward again
        model.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(bwd), statistics.median(tail), saved.bytes


def _loss(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out.float().reshape(())
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
    return first.float().sum()
