// Run-time CPU feature detection: one binary serves CPUs with and without AVX-512.
#include "zt_api.h"
#include "cpu/threadpool.h"

// Highest SIMD level this CPU can run with the kernels compiled here.
ZT_API int zt_cpu_simd_supported(void) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return ZT_SIMD_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return ZT_SIMD_AVX2;
  return ZT_SIMD_SCALAR;
}

ZT_API int zt_cpu_hardware_threads(void) { return zt::hardware_threads(); }

ZT_API int zt_abi_version(void) { return 1; }
