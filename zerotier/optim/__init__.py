"""CPU optimizers over zerotier's native kernels (see _kernels for the flat API)."""
from ._kernels import adam_step, adam_step_multi, adam_step_reference, grad_sumsq, native_available, simd_level, simd_levels_available
from .cpu_adam import CPUAdam, CPUAdamW

__all__ = ["CPUAdam", "CPUAdamW", "adam_step", "adam_step_multi", "adam_step_reference", "grad_sumsq", "native_available",
           "simd_level", "simd_levels_available"]
