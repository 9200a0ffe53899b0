// zerotier native C ABI. Loaded from Python with ctypes; no Python or torch headers.
// Every exported function is extern "C" and marked ZT_API.
#pragma once
#include <stdint.h>

#define ZT_API extern "C" __attribute__((visibility("default")))

// dtype codes shared with zerotier/optim/_kernels.py
enum ZtDtype { ZT_F32 = 0, ZT_BF16 = 1, ZT_F16 = 2, ZT_NONE = -1 };

// SIMD levels, ordered: a higher level implies the lower ones are usable too.
enum ZtSimd { ZT_SIMD_AUTO = -1, ZT_SIMD_SCALAR = 0, ZT_SIMD_AVX2 = 1, ZT_SIMD_AVX512 = 2 };
