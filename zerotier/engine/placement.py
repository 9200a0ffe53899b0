"""Placement at initialize: every unit of the model into the engine's stores, and back out when
that fails ([Note: a failed initialize]). Every rank starts from rank 0's weights; each store
takes its part of every unit; the user's tensors are dropped (the parameters become views of
the engine's flats).
"""
from __future__ import annotations

import torch

from ..errors import ZerotierError
from ..materialize import Ahead, Materializer, is_meta
from ..setup_times import SetupTimes


class Placement:
    """`rt`: the engine's parts ([Note: the runtime record] in runtime.py); `weights`: the user's
    weights (restore.py: what each parameter was, the buffers cast to param_dtype); `init_fn`:
    initialize's, for a model built on the meta device ([Note: meta-device models])."""

    def __init__(self, rt, weights, init_fn):
        self.rt, self.weights, self.init_fn = rt, weights, init_fn
        self.materializer: Materializer | None = None
        self.ahead: Ahead | None = None
        self.times = SetupTimes()  # [Note: initialize's phases]
        self.swapped = 0  # the user's tensors of units[:swapped] may be dropped ([Note: a failed initialize])

    def run(self) -> None:
        """Every rank starts from rank 0's weights; each store takes its part of every unit.
        The user's tensors are dropped (the parameters become views of the engine's flats)."""
        rt, times = self.rt, self.times
        # [Note: meta-device models]; [Note: materialization in the host pool]; [Note: materializing ahead]
        materializer = self.materializer = Materializer(rt.module, self.init_fn, rt.host_pool, times)
        ahead = self.ahead = Ahead(materializer, [u for u in rt.param_units if is_meta(u)])
        for i, unit in enumerate(rt.param_units):
            meta = is_meta(unit)
            if meta:  # the stores hold these lists: they see the rebuilt unit
                unit = rt.param_units[i] = ahead.take(unit)
                (rt.frozen_units if unit.frozen else rt.units)[i - len(rt.units) * unit.frozen] = unit
                self.weights.user_form.update({id(p): (p.dtype, torch.device("meta")) for p in unit.params})
            self._place(i, unit)
            if meta:
                ahead.done()
        ahead.close()
        materializer.finish()  # the spare blocks ([Note: materialization in the host pool])
        with times.phase("nvme drain"):
            rt.unit_optimizer.state.finish_place()
            rt.params.finish_place()
        with times.phase("rest"):
            materializer.rest()
            self._move_unmanaged_to_device()

    def _place(self, i: int, unit) -> None:
        """Unit `i` (materialized) into the stores: its fp32 master, its low-precision parameters,
        its gradient buffers ([Note: initialize's phases] names the timed parts)."""
        rt, times, materializer, sharding = self.rt, self.times, self.materializer, self.rt.sharding
        pooled = materializer.flat(unit)  # the materialized unit's flat in the host pool, or None
        if unit.frozen:  # [Note: frozen units]: its low-precision bytes only
            with times.phase("cast", unit.numel):
                full = materializer.cast(unit, pooled, rt.lp_dtype) if pooled is not None else \
                    torch.cat([p.detach().reshape(-1).to(rt.lp_dtype).cpu() for p in unit.params])
            sharding.broadcast(full)
            self.swapped = i + 1
            with times.phase("params", unit.numel):
                rt.params.place(unit, full if not sharding.gathered(unit) else sharding.shard_of(unit, full))
            del pooled, full  # the last views of the unit's pool blocks: they go back to the system now
            materializer.release(unit)
            return
        with times.phase("cast"):  # the fp32 flat: no copy (the pool block) but for heap units
            if pooled is not None:
                full = pooled.float()  # the pool block itself when fp32
            elif len(unit.params) > 1:
                full = torch.cat([p.detach().reshape(-1).float().cpu() for p in unit.params])
            else:  # the parameter itself (no copy) unless the broadcast below writes into it
                full = unit.params[0].detach().reshape(-1).float().cpu()
                full = full.clone() if sharding.active else full
        sharding.broadcast(full)
        master = sharding.shard_of(unit, full)  # fp32 master of this rank's shard (all of it on one rank)
        with times.phase("optimizer", unit.shard_numel):
            rt.unit_optimizer.state.place(unit, master)
        self.swapped = i + 1  # the user's tensors of units[:i + 1] may be dropped ([Note: a failed initialize])
        with times.phase("cast", master.numel()):
            lp = materializer.cast(unit, master if sharding.gathered(unit) else full, rt.lp_dtype)
        with times.phase("params", lp.numel()):
            rt.params.place(unit, lp)
        with times.phase("grads", unit.numel):
            rt.grads.place(unit)
        del pooled, full, master, lp  # the last views of the unit's pool blocks: they go back to the system now
        materializer.release(unit)

    def undo(self) -> None:
        """[Note: a failed initialize]
        A failing run() (an init_fn raising, a tier refusing a write, Ctrl-C) leaves the model
        as the user built it, so initialize can be called again: modules materialized from the meta
        device get their meta tensors back; units whose parameters were already swapped to the
        engine's flats get their weights back from the fp32 masters (one rank; with several the
        masters are shards). Where a unit cannot be given back, the model is marked and the next
        initialize refuses it with a ConfigError naming what happened, instead of reading freed
        memory; its parameters become meta tensors (a read raises, never crashes)."""
        rt, materializer = self.rt, self.materializer
        if self.ahead is not None:  # [Note: materializing ahead]: the worker first
            self.ahead.close()
        materialized = {id(p) for p in materializer.replaced.values()} if materializer is not None else set()
        lost = []
        for unit in rt.param_units[:self.swapped]:
            if all(id(p) in materialized for p in unit.params):
                continue
            try:
                if rt.sharding.active:
                    raise ZerotierError("the fp32 masters are sharded over ranks")
                master = self.weights.frozen_value(unit) if unit.frozen else \
                    rt.unit_optimizer.state.read_state(unit, ("master",))["master"].cpu()
                for p, view in unit.views(master):
                    dtype, device = self.weights.user_form[id(p)]
                    p.data = view.to(device=device, dtype=dtype, copy=True)
            except Exception:  # noqa: BLE001 - the original error is what the user sees
                lost.append(unit)
        if materializer is not None:
            materializer.undo()
        gone = {id(p) for unit in lost for p in unit.params}
        for module in rt.module.modules():  # new meta Parameters: a CPU one's data cannot become meta
            for name, p in module._parameters.items():
                if p is not None and id(p) in gone:
                    module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                                  requires_grad=p.requires_grad)
        lost = [unit.name or "<root>" for unit in lost]
        if lost:
            rt.module._zerotier_lost = (
                f"an earlier zerotier.initialize on this model failed part-way and could not give the weights of "
                f"{len(lost)} unit(s) back ({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}): build or load "
                "the model again")
        if rt.store is not None:  # its run directory goes with it
            try:
                rt.store.close()
            except Exception:  # noqa: BLE001
                pass

    def _move_unmanaged_to_device(self) -> None:
        """Parameters no unit holds (non-floating frozen ones) and buffers go to the compute device.

        [Note: buffers and inputs in low precision]
        Under a bf16/fp16 precision.param_dtype, compute sees the model as `model.to(dtype)` would
        make it, as FSDP2's MixedPrecisionPolicy does: the floating buffers of a module that owns
        managed parameters (BatchNorm's running stats) take param_dtype (back to their dtype at
        close), and floating tensors passed to the root's forward are cast to it
        (cast_forward_inputs); integer inputs (token ids, labels) are left alone. Buffers of
        modules without parameters (rotary inv_freq) keep their dtype: their module casts."""
        rt = self.rt
        managed = {id(p) for u in rt.param_units for p in u.params}
        low = rt.lp_dtype if rt.lp_dtype != torch.float32 else None
        for module in rt.module.modules():
            owns = any(p is not None and id(p) in managed for p in module._parameters.values())
            for name, p in module._parameters.items():
                if p is not None and id(p) not in managed:
                    p.data = p.data.to(rt.device)
            for name, b in module._buffers.items():
                if b is not None:
                    cast = low is not None and owns and b.is_floating_point() and b.dtype != low
                    if cast:
                        self.weights.buffer_dtypes.append((module, name, b.dtype))  # their dtype again at close
                    module._buffers[name] = b.to(rt.device, low if cast else b.dtype)
