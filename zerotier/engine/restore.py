"""The trained weights as the user's model shows them: `model.state_dict()`, and the parameters
given back at `close()`. Reads the stores, writes only the user's parameters (at close).

[Note: the user's model stays the truth]
zerotier swaps every managed parameter's `.data` for a view of its own flat (released
between uses), so the user's tensors are gone after initialize. The model still tells
the truth: `model.state_dict()` returns the trained weights (the fp32 masters, in each
parameter's original dtype), and `close()` puts them back into the parameters, where
the parameters were, so the model trains or saves like any PyTorch model afterwards.
A model already managed by a live engine is refused by initialize().
"""
from __future__ import annotations

import warnings
import weakref

import torch

from ..state import ParamState


class UserWeights:
    """The engine's view of the user's weights: `user_form` is what each managed parameter was
    before initialize took it (dtype, device), by id; `buffer_dtypes` the (module, name, dtype) of
    the buffers cast to param_dtype ([Note: buffers and inputs in low precision] in placement.py).
    `rt`: the engine's parts ([Note: the runtime record] in runtime.py); `synchronize`: the engine's
    (updates and write-backs in flight land)."""

    def __init__(self, rt, user_form: dict[int, tuple[torch.dtype, torch.device]], synchronize):
        self.rt = rt
        self.user_form = user_form
        self.buffer_dtypes: list[tuple] = []
        self._synchronize = synchronize

    def install_state_dict_hook(self, model: torch.nn.Module):
        """model.state_dict() holds the trained weights; the hook keeps no engine alive."""
        owner = weakref.ref(self)

        def trained_state_dict(module, state_dict, prefix, local_metadata):
            weights = owner()
            if weights is not None:
                weights.trained_state_dict(module, state_dict, prefix)
        return model.register_state_dict_post_hook(trained_state_dict)

    def raw_state_dict(self) -> dict:
        """`module.state_dict(keep_vars=True)`: the live tensors, managed parameters included as the
        Parameter objects (the trained-weights hook leaves them), for code that wants the frozen
        parameters and buffers (checkpoint, export)."""
        return self.rt.module.state_dict(keep_vars=True)

    def trained_units(self):
        """(unit, [(parameter, fp32 view of its full master)]) one unit at a time, so a caller that
        converts as it goes holds one unit in fp32 at most. Collective with several ranks."""
        rt = self.rt
        rt.sharding.sync_point(rt.steps.global_steps, rt.steps.micro_steps,
                               "gathering the trained weights")  # [Note: ranks out of step]
        self._synchronize()  # updates and NVMe writes in flight land first
        for unit in rt.units:
            master = rt.sharding.gather_full(unit, rt.unit_optimizer.state.read_state(unit, ("master",))["master"].cpu())
            yield unit, list(unit.views(master))

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """engine.parameters_fp32(): full-precision weights by parameter name (copies). Collective with
        several ranks."""
        trained = {id(p): view.clone() for unit, views in self.trained_units() for p, view in views}
        return {n: trained[id(p)] for n, p in self.rt.module.named_parameters() if id(p) in trained}

    def frozen_value(self, unit) -> torch.Tensor:
        """[Note: frozen units] A frozen unit's full flat as its home holds it (param dtype, on the CPU,
        a copy): fetched and released again unless resident. A collective when it is gathered."""
        params = self.rt.params
        resident = params.state[unit.index] is ParamState.RESIDENT
        if not resident:
            params.demand(unit)
        try:
            return params.device_flat[unit.index][: unit.numel].to("cpu", copy=True)
        finally:
            if not resident:
                params.release(unit)

    def trained_state_dict(self, module, state_dict, prefix) -> None:
        """[Note: the user's model stays the truth] model.state_dict() holds the trained weights
        (from the fp32 masters, in each parameter's original dtype), never the released buffers
        zerotier swaps under the parameters. With several ranks model.state_dict() is then a
        collective, like FSDP's full state dict: call it on every rank.
        With keep_vars=True the entries are the Parameter objects themselves, as in torch (their
        values read through [Note: the parameter surface]): those are left as they are."""
        names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if prefix + name in state_dict and state_dict[prefix + name] is not p:
                names.setdefault(id(p), []).append(prefix + name)
        if not names:  # keep_vars=True: no weights to gather
            return
        for unit, views in self.trained_units():
            for p, view in views:
                value = view.to(self.user_form[id(p)][0], copy=True)
                for key in names.get(id(p), ()):
                    state_dict[key] = value
        for unit in self.rt.frozen_units:  # [Note: frozen units]: their home's values (safetensors: raw memory)
            for p, view in unit.views(self.frozen_value(unit)):
                value = view.to(self.user_form[id(p)][0], copy=True)
                for key in names.get(id(p), ()):
                    state_dict[key] = value

    def give_back(self, restore_weights: bool, broken: "str | None") -> None:
        """close()'s part: the trained weights back into the parameters (unless `restore_weights` is
        False, or the engine is `broken`: a warning says so); whatever is not put back is left empty."""
        if restore_weights and broken is not None:
            warnings.warn(f"zerotier close(): the trained weights are not put back into the model: {broken}. "
                          "Load the last checkpoint to recover a consistent state", RuntimeWarning, stacklevel=3)
        elif restore_weights:
            try:
                self._restore()
            except Exception as exc:  # noqa: BLE001 - still free everything below; say what is lost
                warnings.warn(f"zerotier close(): the trained weights could not be put back into the model "
                              f"({type(exc).__name__}: {exc}); its parameters are left empty. Load the last "
                              "checkpoint to recover them", RuntimeWarning, stacklevel=3)
        self._leave_no_released_storage()

    def _restore(self) -> None:
        """[Note: the user's model stays the truth]"""
        left = 0
        for unit, views in self.trained_units():
            left += self._put_back(views)
        for unit in self.rt.frozen_units:  # [Note: frozen units]: their home holds them
            left += self._put_back(unit.views(self.frozen_value(unit)))
        for module, name, dtype in self.buffer_dtypes:  # [Note: buffers and inputs in low precision]
            if module._buffers.get(name) is not None:
                module._buffers[name] = module._buffers[name].to(dtype)
        if left:  # [Note: meta-device models]: such a model may not fit where it would go back to
            warnings.warn(f"zerotier close(): {left} parameters of a model built on the meta device are not put "
                          "back into it (it may not fit in RAM); save a checkpoint or `zerotier export` before "
                          "close() to keep the trained weights", RuntimeWarning, stacklevel=4)

    def _put_back(self, views) -> int:
        """Each (parameter, value) into the parameter, in its user's dtype and device; returns how many
        were left out (built on the meta device)."""
        left = 0
        for p, view in views:
            dtype, device = self.user_form[id(p)]
            if device.type != "meta":
                p.data = view.to(device=device, dtype=dtype, copy=True)
            else:
                left += 1
        return left

    def _leave_no_released_storage(self) -> None:
        """Parameters not put back (restore_weights=False, a broken engine, a meta-built model)
        are left empty (0 elements, their dtype and device), never views of freed memory."""
        for unit in self.rt.param_units:
            for p in unit.params:
                if p.numel() and p.untyped_storage().nbytes() < p.numel() * p.element_size():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
