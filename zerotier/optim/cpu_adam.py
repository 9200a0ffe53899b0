"""CPUAdamW / CPUAdam: torch.optim.Optimizer front ends of the native CPU kernel.

State layout per parameter is exactly torch.optim.AdamW's (`step` as a float32
scalar tensor, `exp_avg`, `exp_avg_sq`), so state dicts move between the two.
A bf16/fp16 parameter additionally keeps an fp32 `master_param` in its state:
the kernel updates the master and writes the rounded value into the parameter
in the same pass.
"""
from __future__ import annotations

import torch

from ..errors import ZerotierError
from . import _kernels

_UNSUPPORTED = {
    "amsgrad": "amsgrad is not implemented by the CPU kernel; use torch.optim.AdamW(amsgrad=True)",
    "maximize": "maximize=True is not implemented; negate the loss instead",
    "capturable": "capturable is a CUDA-graph option; CPUAdamW runs on the CPU",
    "differentiable": "differentiable optimizers are not supported by the CPU kernel",
}


class CPUAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) on CPU tensors, SIMD and multithreaded.

    Args beyond torch.optim.AdamW's: `threads` (default: the cores this process
    may use), `simd` ("auto", "avx512vbmi", "avx512", "avx2", "scalar"), `bias_correction`.
    Unsupported torch options (amsgrad, maximize, ...) raise instead of being ignored.
    """

    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, bias_correction: bool = True,
                 threads: int | None = None, simd: str = "auto", **unsupported):
        for key, value in unsupported.items():
            if key in ("foreach", "fused"):
                if value:
                    raise ZerotierError(f"{key}=True does not apply: CPUAdamW is always one fused native pass")
            elif key in _UNSUPPORTED:
                if value:
                    raise ZerotierError(f"{type(self).__name__}: {_UNSUPPORTED[key]}")
            else:
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {key!r}")
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps > 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Invalid betas: {betas} (two values in [0, 1))")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.simd = _kernels.simd_level(simd) if simd != "auto" else "auto"
        self.threads = threads or _kernels.default_threads()
        self.last_nonfinite = 0  # non-finite scaled gradients seen by the last step()
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction)
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if p.dtype != torch.float32 and "master_param" not in state:
            state["master_param"] = p.detach().float().contiguous()
        return state

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0):
        """Update every parameter with a gradient. `grad_scale` multiplies the gradients first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        nonfinite = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            buffers, steps = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ZerotierError("CPUAdamW does not support sparse gradients")
                if p.device.type != "cpu":
                    raise ZerotierError(f"CPUAdamW needs CPU parameters; got one on {p.device}")
                if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise ZerotierError(f"CPUAdamW supports fp32/bf16/fp16 parameters, got {p.dtype}")
                state = self._init_state(p)
                state["step"] += 1
                steps.append(int(state["step"].item()))
                master = state.get("master_param", p)
                flat = (lambda t: t.view(-1) if t.is_contiguous() else t)  # non-contiguous: rejected below
                buffers.append((flat(master), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                                flat(p.grad), flat(p) if master is not p else None))
            if buffers:
                nonfinite += _kernels.adam_step_multi(
                    buffers, step=steps, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], decoupled=self.decoupled,
                    bias_correction=group["bias_correction"], grad_scale=grad_scale, simd=self.simd,
                    threads=self.threads)
        self.last_nonfinite = nonfinite
        return loss

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # a torch.optim.AdamW state dict lacks our keys
            group.setdefault("bias_correction", True)
            for key in ("amsgrad", "maximize"):
                if group.get(key):
                    raise ZerotierError(f"loaded param group has {key}=True: {_UNSUPPORTED[key]}")
        # torch may hand us the caller's own tensors (no copy when dtype/device match);
        # the kernel updates in place through raw pointers, so take private fp32 copies.
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq", "master_param"):
                if key in state:
                    state[key] = state[key].to(torch.float32, copy=True).contiguous()
            if "step" in state:
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)


class CPUAdam(CPUAdamW):
    """Adam with L2 weight decay (wd * param added to the gradient), like torch.optim.Adam."""

    decoupled = False

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, **kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
