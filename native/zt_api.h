// zerotier native C ABI. Loaded from Python with ctypes; no Python or torch headers.
// Every exported function is extern "C" and marked ZT_API.
//
// [Note: native error contract] No C++ exception crosses the C ABI. An export that can
// throw (it allocates, starts threads, or calls code that does) runs its body inside
// zt::guard, which catches everything, records "<function>: <reason>" in a thread-local
// buffer that the library's zt_*_last_error() returns, and hands back the export's failure
// value (ZT_ERR_EXCEPTION for integer results). Exports that cannot throw (constants,
// sysconf, cpuid) are declared noexcept instead, so the compiler holds them to it. Threads
// the libraries start catch everything too (see ThreadPool::run and the I/O engine's
// threads). Python (zerotier/_native.py) turns a failure value plus the message into a
// zerotier.errors.NativeError naming the function.
#pragma once
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include <exception>
#include <new>

#define ZT_API extern "C" __attribute__((visibility("default")))

// dtype codes shared with zerotier/optim/_kernels.py. ZT_Q8: uint8 codes of blockwise 8-bit
// quantization, one fp32 absmax per ZT_QUANT_BLOCK elements (optimizer moments only).
enum ZtDtype { ZT_F32 = 0, ZT_BF16 = 1, ZT_F16 = 2, ZT_Q8 = 3, ZT_NONE = -1 };
#define ZT_QUANT_BLOCK 256  // QUANT_BLOCK in zerotier/optim/_kernels.py

// SIMD levels, ordered: a higher level implies the lower ones are usable too. AVX512_VBMI:
// AVX-512 with byte permutes (Ice Lake, AMD Zen 4 and later), for 8-bit moments.
enum ZtSimd { ZT_SIMD_AUTO = -1, ZT_SIMD_SCALAR = 0, ZT_SIMD_AVX2 = 1, ZT_SIMD_AVX512 = 2, ZT_SIMD_AVX512_VBMI = 3 };

// Failure values of integer-returning exports, mirrored in zerotier/_native.py. The two
// generic ones lie outside -errno's range (-4095..-1), which the I/O library returns as
// the result of a failed request. The message is in zt_*_last_error().
enum ZtStatus {
  ZT_ERR_ARGS = -1,            // invalid arguments (the message says which)
  ZT_ERR_SIMD = -2,            // requested SIMD level not supported by this CPU
  ZT_ERR_EXCEPTION = -10000,   // a C++ exception was caught (bad_alloc, thread creation, ...)
  ZT_ERR_FORKED = -10001,      // the handle belongs to the process this one was forked from
  ZT_ERR_HANDLE = -10002,      // NULL handle
};

namespace zt {

// The calling thread's last error message ("" when the last guarded call succeeded).
inline thread_local char g_last_error[512];

// Records "<fn>: <printf-formatted reason>"; never allocates, so it works after bad_alloc.
__attribute__((format(printf, 2, 3))) inline void set_error(const char* fn, const char* fmt, ...) noexcept {
  int used = snprintf(g_last_error, sizeof g_last_error, "%s: ", fn);
  if (used < 0 || used >= (int)sizeof g_last_error) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_last_error + used, sizeof g_last_error - used, fmt, ap);
  va_end(ap);
}

// Runs body() (which returns T); any exception becomes set_error(fn, ...) and `on_error`.
template <class T, class Body>
T guard(const char* fn, T on_error, Body&& body) noexcept {
  g_last_error[0] = '\0';
  try {
    return body();
  } catch (const std::bad_alloc&) {
    set_error(fn, "out of memory (std::bad_alloc)");
  } catch (const std::exception& ex) {
    set_error(fn, "%s", ex.what());
  } catch (...) {
    set_error(fn, "unknown C++ exception");
  }
  return on_error;
}

}  // namespace zt
