// Run-time CPU feature detection: one binary serves CPUs with and without AVX-512.
#include "zt_api.h"

// Highest SIMD level this CPU can run with the kernels compiled here.
ZT_API int zt_cpu_simd_supported(void) noexcept {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return __builtin_cpu_supports("avx512vbmi") ? ZT_SIMD_AVX512_VBMI : ZT_SIMD_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return ZT_SIMD_AVX2;
  return ZT_SIMD_SCALAR;
}

// Bumped with every change of the exported functions or of struct ZtAdamArgs;
// zerotier/optim/_kernels.py checks it at load.
// 2: zt_grad_sumsq returns a status and writes *out; zt_adam_step and zt_cpu_hardware_threads
//    removed; zt_cpu_last_error and zt_adam_args_size added.
// 3: ZtAdamArgs: `param` is `master` (fp32 or bf16); state dtypes, block scales, the
//    quantization maps and the stochastic-rounding seed appended.
// (ZtSimd level 3, ZT_SIMD_AVX512_VBMI, needed no bump: bindings that know 3 levels read a
// library's 3 as "avx512" and those that know 4 read an older library's 2 as before.)
// 5: zt_grad_sumsq takes a ZtSimd level (before `out`) and has AVX2 / AVX-512 kernels.
ZT_API int zt_abi_version(void) noexcept { return 5; }
