"""`engine.optimizer`: the engine's update rule (AdamW, Adam, Lion: optim/rules/) as a
torch.optim.Optimizer.

The engine builds it at initialize over every parameter it trains; the update itself is
UnitOptimizer's (offload.py), over state on the device, host or NVMe tier. What the user's
code sees is torch's AdamW (or lion-pytorch's Lion): param_groups with their keys, lr
schedulers, add_param_group, state_dict / load_state_dict in their layout, step(closure).

[Note: param groups]
The groups are the truth, as in torch: every step reads lr, betas, eps, weight_decay
(and decoupled_weight_decay; Lion: lr, betas, weight_decay) of each parameter's group
(`hyper_table()`, through the rule's `hyper`, once per step), so any lr
scheduler works, OneCycleLR's momentum cycling (it writes betas) included. UnitOptimizer
updates a unit in one pass when its parameters share their hyper-parameters and step
counts, and slice by slice otherwise.

The groups zerotier builds at initialize hold every parameter it trains, in
`model.parameters()` order: one group, or with optimizer.no_weight_decay two: the
decayed parameters, then the exempt ones with weight_decay 0 (the layout of HF Trainer's
own AdamW). So `torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)`
built the same way has the same indices, and its state_dict loads here and ours there.

Since zerotier, not the user, built the optimizer over every trainable parameter,
`add_param_group({"params": ps, "lr": ...})` *moves* `ps` out of the groups zerotier
built into the new group: the result is what torch gives for
`AdamW([{"params": rest}, {"params": ps, "lr": ...}])`, and a parameter's Adam state
goes with it (torch keys state by parameter, not by group). A parameter already in a
group added this way is refused as torch refuses it (one group per parameter), and a
parameter zerotier does not train (frozen at initialize: no master, no state) with a
ZerotierError naming the fix. Changing a group's "params" list by hand is not followed.

[Note: optimizer state_dict]
`state_dict()` returns the real state in torch's layout, `state[i] = {"step", *the rule's
moments}` (AdamW: exp_avg, exp_avg_sq; Lion: exp_avg; fp32 CPU tensors shaped like the parameter; no entry for a
parameter never stepped, as in torch), read one unit at a time (NVMe state streamed;
several ranks gather each unit: a collective, call it on every rank). It holds the whole
state in memory, as torch's does. The fp32 masters are not in it: they are the model's
weights (`model.state_dict()`; a bf16 master comes back exactly through fp32). Compact
moments are there decoded to fp32; int8 ones also as stored ([Note: int8 moments in the
optimizer state_dict] in state_dict_int8.py). `load_state_dict()` writes the moments and
step counts back (each rank its shard), in the engine's dtypes, warning when that loses
precision; values no Adam run holds are refused first ([Note: loaded state is checked]);
a parameter without an entry starts afresh, as in torch. A model state_dict and an
optimizer state_dict saved together and loaded into a fresh engine of the same dtypes
continue the run bit for bit. The engine's own checkpoints (and ZerotierTrainer's
optimizer.pt) store only the param groups (`groups_only()`): the state is in the
checkpoint's files.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import itertools
import math
import warnings
import weakref
from typing import Any, Callable

import torch

from ..errors import ConfigError, ZerotierError
from . import state_dict_int8
from .rules.base import HyperTable
from .state_layout import StateLayout, first_bad_value

# state_dict() under groups_only(): this key says the state is elsewhere (load keeps ours)
GROUPS_ONLY = "zerotier_groups_only"


def exempt_from_decay(model: torch.nn.Module, units: list, patterns) -> set[tuple[int, int]]:
    """(unit index, position) of the parameters optimizer.no_weight_decay exempts (name globs
    on `model`'s parameter names; a tied parameter if any of its names matches); a pattern
    matching no trainable parameter is a ConfigError."""
    if not patterns:
        return set()
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    exempt, used = set(), set()
    for unit in units:
        for k, p in enumerate(unit.params):
            for pattern in patterns:
                if any(fnmatch.fnmatchcase(n, pattern) for n in names.get(id(p), ())):
                    exempt.add((unit.index, k))
                    used.add(pattern)
    unused = [p for p in patterns if p not in used]
    if unused:
        raise ConfigError(f"optimizer.no_weight_decay: {unused} match no trainable parameter name (names look "
                          f"like {', '.join(n for n, _ in list(model.named_parameters())[:3])})")
    return exempt


@dataclasses.dataclass(frozen=True)
class Loop:
    """What engine.optimizer asks of the engine's training loop (the engine builds it from weak
    references: the optimizer keeps no engine alive; once the engine is gone, `closed()` is True
    and the calls do nothing)."""
    step: Callable[[], None]             # the plain loop's update ([Note: the plain PyTorch loop] in window.py)
    zero_grad: Callable[[bool], None]    # drop the window's gradients (set_to_none)
    synchronize: Callable[[], None]      # updates and write-backs in flight land
    closed: Callable[[], bool]


class EngineOptimizer(torch.optim.Optimizer):
    """`engine.optimizer` ([Note: param groups], [Note: optimizer state_dict]). `step()` is the
    engine's update of the gradients accumulated by loss.backward() ([Note: the plain PyTorch
    loop] in window.py); `zero_grad()` drops them. `rt`: the engine's parts ([Note: the runtime
    record] in engine/runtime.py); `on_first_train(module, param_groups)`: what the first train()
    checks (the Hugging Face Trainer's exemptions, engine/trainer_guard.py); `given`: whether the
    config's source set a key (`Config.given`), for the update rule's defaults."""

    def __init__(self, rt, cfg, loop: Loop, no_decay: "set[tuple[int, int]]" = frozenset(),
                 on_first_train: "Callable[[torch.nn.Module, list], None] | None" = None,
                 given: Callable[[str], bool] = lambda path: False):
        self._rt = weakref.ref(rt)         # the optimizer keeps none of the engine's parts alive
        self._loop = loop
        self._on_first_train = on_first_train
        self._counting = False             # inside count_step(): step() only counts
        self._built: list[dict] | None = None  # the groups zerotier built (add_param_group moves out of them)
        self._layout_key = None           # what _layout was built from
        self._layout: tuple[tuple[int, ...], ...] = ()  # unit index -> group of each of its parameters
        self._groups_only = False
        self._trainer_checked = False  # train(): the plain Trainer's exemptions checked
        where = {id(p): (u.index, k) for u in rt.units for k, p in enumerate(u.params)}
        trained = list({id(p): p for p in rt.module.parameters() if id(p) in where}.values())
        seen = {id(p) for p in trained}
        trained += [p for u in rt.units for p in u.params if id(p) not in seen]  # not in the module tree
        decayed = [p for p in trained if where[id(p)] not in no_decay]
        groups = [{"params": decayed}] if decayed else []
        if len(decayed) < len(trained):
            groups.append({"params": [p for p in trained if where[id(p)] in no_decay], "weight_decay": 0.0})
        self._rule = rt.unit_optimizer.rule
        super().__init__(groups, self._rule.group_defaults(cfg, given))
        self._built = list(self.param_groups)

    # ------------------------------------------------------------ the engine's side

    def hyper_table(self) -> HyperTable:
        """The groups' hyper-parameters now and each unit's parameters' groups ([Note: param groups]):
        the data UnitOptimizer.step reads. Checked here, so a bad group fails before any update."""
        layout = self._unit_layout()
        return HyperTable(tuple(self._rule.hyper(g, i) for i, g in enumerate(self.param_groups)), layout)

    def _unit_layout(self) -> tuple[tuple[int, ...], ...]:
        key = tuple((id(g["params"]), len(g["params"])) for g in self.param_groups)
        if key == self._layout_key:
            return self._layout
        rt = self._live("step()")
        group_of: dict[int, int] = {}
        for i, g in enumerate(self.param_groups):
            for p in g["params"]:
                group_of.setdefault(id(p), i)
        layout, missing = [], []
        for unit in rt.units:
            row = []
            for p in unit.params:
                if id(p) not in group_of:
                    missing.append(p)
                row.append(group_of.get(id(p), -1))
            layout.append(tuple(row))
        if missing:
            raise ZerotierError(f"engine.optimizer: {len(missing)} trained parameters ({self._name(missing[0])} ...) "
                                "are in no param group (a group's 'params' list was edited by hand): zerotier "
                                "updates every parameter it trains. Freeze a parameter with requires_grad_(False) "
                                "before zerotier.initialize, or give it its own group with add_param_group")
        self._layout, self._layout_key = tuple(layout), key
        return self._layout

    # ------------------------------------------------------------ torch.optim.Optimizer

    def step(self, closure=None):
        """torch's step(closure): the closure (forward and loss.backward()) runs first, then the
        update of the gradients accumulated since the last step."""
        if self._counting:  # the window's own update (count_step): counted, nothing more
            return None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._loop.step()
        return loss

    def count_step(self) -> None:
        """The window's update calls this: step() runs (as patched: an lr scheduler counts it, step
        hooks run) and updates nothing; the window applies the update itself."""
        self._counting = True
        try:
            self.step()
        finally:
            self._counting = False

    def train(self) -> None:
        """transformers' Trainer calls this before each training step (its hook for schedule-free
        optimizers): the first call runs `on_first_train`, which checks that Trainer's weight-decay
        exemptions hold ([Note: TrainingArguments and the zerotier config] in integrations/transformers.py)."""
        if not self._trainer_checked and self._on_first_train is not None:
            rt = self._live("train()")
            self._on_first_train(rt.module, self.param_groups)
        self._trainer_checked = True

    def zero_grad(self, set_to_none: bool = True):
        """engine.zero_grad(set_to_none): the window's gradients are dropped (set_to_none=False:
        zero gradients that Adam still steps, as torch)."""
        self._loop.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group for parameters zerotier trains: they move out of the groups
        zerotier built into the new one ([Note: param groups])."""
        if self._built is None:  # torch's __init__ adding zerotier's own groups
            super().add_param_group(param_group)
            return
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set) and params is not None:  # a set: torch's TypeError below
            params = list(params)
        if isinstance(params, list):
            param_group["params"] = params
            tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]
            moving = {id(p) for p in tensors if isinstance(p, torch.Tensor)}
            rt = self._live("add_param_group()")
            trained = {id(p) for u in rt.units for p in u.params}
            for p in tensors:
                if isinstance(p, torch.Tensor) and id(p) not in trained:
                    raise ZerotierError(
                        f"engine.optimizer.add_param_group: parameter {self._name(p)} is not one zerotier trains: it "
                        "was frozen (requires_grad=False) or not in the model when zerotier.initialize ran, so it "
                        "has no fp32 master and no Adam state. Make it trainable before zerotier.initialize (freeze "
                        "it afterwards with requires_grad_(False) until it should train); every parameter zerotier "
                        "trains is in engine.optimizer's groups already, and add_param_group moves it to the new one")
            added = [g for g in self.param_groups if all(g is not b for b in self._built)]
            in_added = any(id(p) in moving for g in added for p in g["params"])
            if not in_added:  # else torch's own check refuses it (one group per parameter), nothing moved
                before = [(g, g["params"], g.get("param_names")) for g in self._built]
                for g in self._built:
                    keep = [i for i, p in enumerate(g["params"]) if id(p) not in moving]
                    if len(keep) != len(g["params"]):
                        if "param_names" in g:
                            g["param_names"] = [g["param_names"][i] for i in keep]
                        g["params"] = [g["params"][i] for i in keep]
                try:
                    super().add_param_group(param_group)
                except BaseException:
                    for g, ps, names in before:
                        g["params"] = ps
                        if names is not None:
                            g["param_names"] = names
                    raise
                return
        super().add_param_group(param_group)

    @contextlib.contextmanager
    def groups_only(self):
        """Inside, state_dict() holds the param groups only (marked GROUPS_ONLY), and loading such
        a dict sets the groups and keeps the Adam state: for checkpoints that store the state in
        their own files (engine.save_checkpoint, ZerotierTrainer's optimizer.pt)."""
        self._groups_only = True
        try:
            yield self
        finally:
            self._groups_only = False

    def groups_state_dict(self) -> dict[str, Any]:
        """state_dict() under groups_only(): the param groups, no Adam state."""
        with self.groups_only():
            return self.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """[Note: optimizer state_dict] torch's layout, the real Adam state."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        index: dict[int, int] = {}
        groups = []
        start = 0
        for g in self.param_groups:  # indices exactly as torch.optim.Optimizer.state_dict numbers them
            packed = {k: v for k, v in g.items() if k != "params"}
            index.update({id(p): i for i, p in enumerate(g["params"], start) if id(p) not in index})
            packed["params"] = [index[id(p)] for p in g["params"]]
            start += len(packed["params"])
            groups.append(packed)
        if self._groups_only:
            state_dict = {"state": {}, "param_groups": groups, GROUPS_ONLY: True}
        else:
            state_dict = {"state": self._read_state(index), "param_groups": groups}
            moments = self._live("state_dict()").unit_optimizer.layout.moments
            if moments != "fp32":  # [Note: int8 moments in the optimizer state_dict]
                state_dict[state_dict_int8.MOMENT_DTYPE] = moments
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _read_state(self, index: dict[int, int]) -> dict[int, dict[str, torch.Tensor]]:
        rt = self._live("state_dict()")
        rt.sharding.sync_point(rt.steps.global_steps, rt.steps.micro_steps,
                               "gathering the optimizer state")  # [Note: ranks out of step] in dist/sharding.py
        self._loop.synchronize()  # updates and write-backs in flight land first
        opt, sharding = rt.unit_optimizer, rt.sharding
        moments = self._rule.moment_keys
        state: dict[int, dict[str, torch.Tensor]] = {}
        for unit in rt.units:
            steps = opt.state.steps[unit.index]
            if not any(steps) and not sharding.active:  # never stepped: no state to read (torch keeps none)
                continue
            layout, codes = opt.state.slots[unit.index].layout, [None] * len(steps)
            if layout.moments == "int8" and unit.part.replicated:  # [Note: int8 moments in the optimizer state_dict]
                raw = opt.state.read_state(unit, moments, encoded=True)
                shard = {k: layout.decode(k, t, unit.shard_numel) for k, t in raw.items()}
                codes = state_dict_int8.entries(layout, raw, unit)
            else:
                shard = opt.state.read_state(unit, moments)  # one unit at a time
            full = {k: sharding.gather_full(unit, t.cpu()) for k, t in shard.items()}  # collective with ranks
            views = {k: list(unit.views(full[k])) for k in moments}
            for k, p in enumerate(unit.params):
                if steps[k] and id(p) in index:
                    state[index[id(p)]] = {"step": torch.tensor(float(steps[k]), dtype=_step_dtype()),
                                           **{m: views[m][k][1].clone() for m in moments}}
                    if codes[k] is not None:
                        state[index[id(p)]][state_dict_int8.INT8] = codes[k]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """[Note: optimizer state_dict] torch's checks and layout; the moments and step counts go
        to each unit's tier, the groups' hyper-parameters into param_groups."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        state_dict, saved, new_groups = self.checked(state_dict)
        moments = None
        if not state_dict.get(GROUPS_ONLY, False):
            groups = self.param_groups
            ids = {old: p for old, p in zip(itertools.chain.from_iterable(s["params"] for s in saved),
                                            itertools.chain.from_iterable(g["params"] for g in groups))}
            moments = {}
            for key, value in state_dict["state"].items():
                if key in ids:
                    moments[id(ids[key])] = _moments(key, value, ids[key], self._name, self._rule)
            self._write_state(moments, state_dict_int8.saved_moment_dtype(state_dict))
        self.param_groups = new_groups
        self._built = new_groups[: len(self._built)]
        self._layout_key = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def checked(self, state_dict: dict[str, Any]) -> tuple[dict, list[dict], list[dict]]:
        """(state_dict, its param groups, our new groups) for load_state_dict; torch's ValueError
        when the groups do not match ours, a ZerotierError for hyper-parameters zerotier cannot
        run. Changes nothing."""
        groups, saved = self.param_groups, list(state_dict["param_groups"])
        if len(saved) == 1 and "betas" not in saved[0] and not state_dict["state"]:
            # an engine checkpoint written before param groups were real: one placeholder group, its lr
            saved = [{**g, **{k: v for k, v in saved[0].items() if k != "params"},
                      "params": list(range(len(g["params"])))} for g in groups]
            state_dict = {**state_dict, GROUPS_ONLY: True}
        if len(groups) != len(saved):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        new_groups = []
        for i, (g, s) in enumerate(zip(groups, saved)):
            new = {k: v for k, v in s.items() if k != "params"}
            new["params"] = g["params"]
            if "param_names" in g and "param_names" not in new:
                new["param_names"] = g["param_names"]
            for k, v in self.defaults.items():
                new.setdefault(k, v)
            self._rule.hyper(new, i)  # refuse what zerotier cannot run before anything changes
            new_groups.append(new)
        return state_dict, saved, new_groups

    def _write_state(self, moments: dict[int, tuple], saved_dtype: str) -> None:
        """Every unit's moments and step counts from `moments` (id(param) -> (step, {moment key:
        fp32 values}, int8 entry or None)), saved with `saved_dtype` moments; a parameter without an
        entry starts afresh (zero moments, step 0). int8 moments are the entries' codes where they
        fit ([Note: int8 moments in the optimizer state_dict]); a lossy conversion warns."""
        rt = self._live("load_state_dict()")
        self._loop.synchronize()
        opt, sharding = rt.unit_optimizer, rt.sharding
        requantized = False
        for unit in rt.units:
            if not any(opt.state.steps[unit.index]) and not any(id(p) in moments for p in unit.params):
                continue  # fresh before and after
            full = {k: torch.zeros(unit.numel) for k in self._rule.moment_keys}
            steps, codes = [], []
            for p, shape, offset in zip(unit.params, unit.shapes, unit.offsets):
                step, values, entry = moments.get(id(p), (0, None, None))
                steps.append(step)
                codes.append(entry if step else None)
                for k in full if step else ():
                    full[k][offset: offset + shape.numel()] = values[k].reshape(-1)
            layout = opt.state.slots[unit.index].layout
            if layout.moments == "int8" and any(layout.run_of(unit.shard_numel, o, o + s.numel())
                                                for s, o, step in zip(unit.shapes, unit.offsets, steps) if step):
                raw = state_dict_int8.unit_buffers(layout, unit, full, codes) if unit.part.replicated else None
                if raw is not None:
                    opt.state.write_state(unit, raw, steps, encoded=True)
                    continue
                requantized = True
            opt.state.write_state(unit, {k: sharding.shard_of(unit, t) for k, t in full.items()}, steps)
        new = opt.layout
        old = StateLayout(moments=saved_dtype)
        lossy = [f"{k} {old.dtype(k)} -> {new.dtype(k)}" for k in new.moment_keys if new.lossy_from(old, k)]
        if requantized and saved_dtype == "int8":
            lossy.append("int8 moments re-quantized in this engine's blocks (the state dict's codes do not fit "
                         "them: saved with other units or ZeRO shards, or its moments changed since)")
        if lossy:  # the wording of [Note: converting state dtypes on load] (checkpoint_load.py)
            warnings.warn(f"engine.optimizer.load_state_dict(): the optimizer state loses precision: "
                          f"{', '.join(lossy)} (precision.moment_dtype = {new.moments!r}; the state dict was "
                          f"saved with {saved_dtype!r})", stacklevel=3)

    # ------------------------------------------------------------ helpers

    def _live(self, what: str):
        """The engine's parts, or a ZerotierError once it is closed (or gone)."""
        rt = self._rt()
        if rt is None or self._loop.closed():
            raise ZerotierError(f"engine.optimizer.{what} after engine.close(): the optimizer state was freed with "
                                "the engine. Call it before close() (or save engine.save_checkpoint(root))")
        return rt

    def _name(self, p: torch.Tensor) -> str:
        rt = self._rt()
        if rt is not None:
            for name, q in rt.module.named_parameters(remove_duplicate=False):
                if q is p:
                    return f"'{name}'"
        return f"of shape {list(p.shape)}"


def _step_dtype() -> torch.dtype:
    """torch's dtype for a CPU Adam `step` (torch.optim.optimizer._get_scalar_dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _moments(key, value, p: torch.Tensor, name, rule) -> tuple[int, dict[str, torch.Tensor], dict | None]:
    """(step, {moment key: fp32 values}, int8 entry or None) of one parameter's saved state,
    checked against the parameter and for values no run of the rule holds ([Note: loaded state
    is checked])."""
    moments = rule.moment_keys
    if not isinstance(value, dict) or not {"step", *moments} <= value.keys():
        words = ["step", *moments]
        raise ValueError(f"loaded optimizer state {key} (parameter {name(p)}) is not {rule.state_title}'s: it needs "
                         f"{', '.join(words[:-1])} and {words[-1]}, it has "
                         f"{sorted(value) if isinstance(value, dict) else value!r}")
    step = float(value["step"])
    for what in moments:
        t = value[what]
        if not isinstance(t, torch.Tensor) or t.numel() != p.numel():
            raise ValueError(f"loaded optimizer state {key}: its {what} has "
                             f"{t.numel() if isinstance(t, torch.Tensor) else type(t).__name__} elements, parameter "
                             f"{name(p)} has {p.numel()} (shape {list(p.shape)}): not this model's optimizer")
    if not math.isfinite(step) or step != int(step) or step < 0:
        raise ValueError(f"loaded optimizer state {key}: step {step} is not a count")
    where = f"engine.optimizer.load_state_dict: loaded optimizer state {key} (parameter {name(p)})"
    values = {what: value[what].detach().to("cpu", torch.float32) for what in moments}
    for what, t in values.items():  # [Note: loaded state is checked]
        i = first_bad_value(t, nonnegative=what in rule.nonnegative)
        if i is not None:
            bounds = "".join(f" and {k} is >= 0" for k in moments if k in rule.nonnegative)
            raise ZerotierError(f"{where}: its {what} holds {float(t.reshape(-1)[i])} at element {i}: "
                                f"{rule.state_title}'s moments are finite{bounds}, so this state dict was damaged or "
                                f"edited. Nothing was loaded; load a state dict saved by the run")
    return int(step), values, state_dict_int8.checked_entry(value, p.numel(), where, moments)
