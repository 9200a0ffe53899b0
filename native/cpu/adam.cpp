// CPU Adam / AdamW over flat fp32 master weights and moments.
//
// One pass per element: read grad (fp32/bf16/fp16, optionally scaled by
// 1/loss_scale and clip coefficient), update master/exp_avg/exp_avg_sq in place,
// optionally write the new parameter as bf16/fp16 (round-to-nearest-even) into a
// separate buffer, and count non-finite gradients.
//
// Three kernels compute the same math: a scalar reference loop (the oracle the
// SIMD paths are tested against), AVX2+FMA+F16C and AVX-512 (F/BW/VL). They are
// compiled with per-function target attributes, so the library itself needs only
// baseline x86-64 and picks a kernel at run time (zt_cpu_simd_supported).
//
// The math follows torch.optim.AdamW / torch's fused CPU kernel:
//   adamw: p *= 1 - lr*wd              adam: g += wd*p
//   m = m + (1-b1)*(g-m)               v = b2*v + (1-b2)*g*g
//   p = p - (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)
#include <math.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "cpu/threadpool.h"
#include "zt_api.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ZT_X86 1
#endif

extern "C" int zt_cpu_simd_supported(void) noexcept;

// Must match ctypes.Structure ZtAdamArgs in zerotier/optim/_kernels.py.
struct ZtAdamArgs {
  float* param;        // fp32 master weights, updated in place
  float* exp_avg;      // fp32 first moment
  float* exp_avg_sq;   // fp32 second moment
  const void* grad;    // gradient, dtype grad_dtype
  void* param_out;     // optional copy of the new param in out_dtype (NULL = none)
  int64_t n;
  int32_t grad_dtype;  // ZtDtype
  int32_t out_dtype;   // ZtDtype (ZT_NONE when param_out is NULL)
  // Hyper-parameters arrive in double so derived coefficients (1-beta2, 1-lr*wd)
  // are rounded to fp32 once, exactly as torch rounds its Python-float scalars.
  double lr, beta1, beta2, eps, weight_decay;
  double grad_scale;   // multiplies every gradient (1/loss_scale * clip coefficient)
  int64_t step;        // the step count *after* this update (1 on the first step)
  int32_t decoupled;   // 1 = AdamW, 0 = Adam with L2 (wd*p added to the gradient)
  int32_t bias_correction;
  int32_t simd;        // ZtSimd; ZT_SIMD_AUTO picks the best supported
  int32_t threads;     // <= 0 means all hardware threads
};

namespace {

struct Coef {
  float lr, b1, b2, one_minus_b1, one_minus_b2, eps, wd, decay, step_size, bc2_sqrt, scale;
  bool decoupled;
};

Coef make_coef(const ZtAdamArgs& a) {
  Coef c;
  c.lr = (float)a.lr;
  c.b1 = (float)a.beta1;
  c.b2 = (float)a.beta2;
  c.one_minus_b1 = (float)(1.0 - a.beta1);
  c.one_minus_b2 = (float)(1.0 - a.beta2);
  c.eps = (float)a.eps;
  c.wd = (float)a.weight_decay;
  c.decoupled = a.decoupled != 0;
  c.decay = c.decoupled ? (float)(1.0 - a.lr * a.weight_decay) : 1.0f;
  c.scale = (float)a.grad_scale;
  // Bias corrections in double then rounded, as torch computes them in Python floats.
  double bc1 = 1.0, bc2 = 1.0;
  if (a.bias_correction) {
    bc1 = 1.0 - pow((double)a.beta1, (double)a.step);
    bc2 = 1.0 - pow((double)a.beta2, (double)a.step);
  }
  c.step_size = (float)(a.lr / bc1);
  c.bc2_sqrt = (float)sqrt(bc2);
  return c;
}

// ---- scalar conversions (reference) -------------------------------------------

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400));
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {  // round to nearest even
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000;
  uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return (uint16_t)(sign | 0x7e00);  // NaN
  if (absu >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  // overflow -> inf (>= 65520)
  if (absu < 0x38800000u) {                                   // subnormal or zero in fp16
    // value = absu_float; fp16 subnormal unit = 2^-24
    float af;
    memcpy(&af, &absu, 4);
    float scaled = af * 16777216.0f;  // exact (power of two)
    // round half to even
    float r = nearbyintf(scaled);
    return (uint16_t)(sign | (uint16_t)r);
  }
  uint32_t exp = (absu >> 23) - 127 + 15;
  uint32_t man = absu & 0x7fffff;
  uint32_t h = (exp << 10) | (man >> 13);
  uint32_t rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;  // may carry into exponent: correct
  return (uint16_t)(sign | h);
}

inline float load_grad_scalar(const void* g, int dt, int64_t i) {
  switch (dt) {
    case ZT_BF16: return bf16_to_f32(((const uint16_t*)g)[i]);
    case ZT_F16: return f16_to_f32(((const uint16_t*)g)[i]);
    default: return ((const float*)g)[i];
  }
}

int64_t adam_scalar(const ZtAdamArgs& a, const Coef& c, int64_t begin, int64_t end) {
  int64_t nonfinite = 0;
  for (int64_t i = begin; i < end; ++i) {
    float g = load_grad_scalar(a.grad, a.grad_dtype, i) * c.scale;
    if (!isfinite(g)) ++nonfinite;
    float p = a.param[i];
    if (c.decoupled) p = p * c.decay;
    else if (c.wd != 0.0f) g = g + c.wd * p;
    float m = a.exp_avg[i];
    m = m + c.one_minus_b1 * (g - m);
    float v = a.exp_avg_sq[i] * c.b2 + c.one_minus_b2 * (g * g);
    float denom = sqrtf(v) / c.bc2_sqrt + c.eps;
    p = p - c.step_size * (m / denom);
    a.param[i] = p;
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    if (a.out_dtype == ZT_BF16) ((uint16_t*)a.param_out)[i] = f32_to_bf16(p);
    else if (a.out_dtype == ZT_F16) ((uint16_t*)a.param_out)[i] = f32_to_f16(p);
    else if (a.out_dtype == ZT_F32) ((float*)a.param_out)[i] = p;
  }
  return nonfinite;
}

#ifdef ZT_X86
// ---- AVX2 + FMA + F16C ---------------------------------------------------------
#define ZT_AVX2 __attribute__((target("avx2,fma,f16c")))

ZT_AVX2 inline __m256 avx2_load_grad(const void* g, int dt, int64_t i) {
  if (dt == ZT_BF16) {
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)g + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  if (dt == ZT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)g + i)));
  return _mm256_loadu_ps((const float*)g + i);
}

ZT_AVX2 inline __m128i avx2_to_bf16(__m256 p) {
  __m256i u = _mm256_castps_si256(p);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  // NaN lanes keep their top half with the quiet bit set.
  __m256 isnan = _mm256_cmp_ps(p, p, _CMP_UNORD_Q);
  __m256i nanv = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  r = _mm256_blendv_epi8(r, nanv, _mm256_castps_si256(isnan));
  r = _mm256_srli_epi32(r, 16);
  // pack 8 x u32 (values < 65536) into 8 x u16
  __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  return _mm_packus_epi32(lo, hi);
}

ZT_AVX2 int64_t adam_avx2(const ZtAdamArgs& a, const Coef& c, int64_t begin, int64_t end) {
  const __m256 vb2 = _mm256_set1_ps(c.b2), v1mb1 = _mm256_set1_ps(c.one_minus_b1),
               v1mb2 = _mm256_set1_ps(c.one_minus_b2), veps = _mm256_set1_ps(c.eps),
               vwd = _mm256_set1_ps(c.wd), vdecay = _mm256_set1_ps(c.decay),
               vstep = _mm256_set1_ps(c.step_size), vbc2 = _mm256_set1_ps(c.bc2_sqrt),
               vscale = _mm256_set1_ps(c.scale), vinf = _mm256_set1_ps(INFINITY),
               vabs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t nonfinite = 0;
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 g = _mm256_mul_ps(avx2_load_grad(a.grad, a.grad_dtype, i), vscale);
    // !(|g| < inf) is true for inf and NaN
    __m256 bad = _mm256_cmp_ps(_mm256_and_ps(g, vabs), vinf, _CMP_NLT_UQ);
    nonfinite += __builtin_popcount(_mm256_movemask_ps(bad));
    __m256 p = _mm256_loadu_ps(a.param + i);
    if (c.decoupled) p = _mm256_mul_ps(p, vdecay);
    else g = _mm256_fmadd_ps(vwd, p, g);
    __m256 m = _mm256_loadu_ps(a.exp_avg + i);
    m = _mm256_fmadd_ps(v1mb1, _mm256_sub_ps(g, m), m);
    __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(a.exp_avg_sq + i), vb2, _mm256_mul_ps(v1mb2, _mm256_mul_ps(g, g)));
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), vbc2), veps);
    p = _mm256_fnmadd_ps(vstep, _mm256_div_ps(m, denom), p);
    _mm256_storeu_ps(a.param + i, p);
    _mm256_storeu_ps(a.exp_avg + i, m);
    _mm256_storeu_ps(a.exp_avg_sq + i, v);
    if (a.out_dtype == ZT_BF16)
      _mm_storeu_si128((__m128i*)((uint16_t*)a.param_out + i), avx2_to_bf16(p));
    else if (a.out_dtype == ZT_F16)
      _mm_storeu_si128((__m128i*)((uint16_t*)a.param_out + i), _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
    else if (a.out_dtype == ZT_F32)
      _mm256_storeu_ps((float*)a.param_out + i, p);
  }
  return nonfinite + adam_scalar(a, c, i, end);
}

// ---- AVX-512 (F, BW, VL) -------------------------------------------------------
#define ZT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

template <bool FULL>
ZT_AVX512 inline __m512 avx512_load_grad(const void* g, int dt, int64_t i, __mmask16 k) {
  if (dt == ZT_F32) return FULL ? _mm512_loadu_ps((const float*)g + i) : _mm512_maskz_loadu_ps(k, (const float*)g + i);
  const uint16_t* src = (const uint16_t*)g + i;
  __m256i h = FULL ? _mm256_loadu_si256((const __m256i*)src) : _mm256_maskz_loadu_epi16(k, src);
  if (dt == ZT_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16
}

ZT_AVX512 inline __m256i avx512_to_bf16(__m512 p) {
  __m512i u = _mm512_castps_si512(p);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 isnan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, isnan, u, _mm512_set1_epi32(0x400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// One vector of 16 lanes. FULL=true uses plain loads/stores; the tail uses masks
// (masked stores are slow on some CPUs, e.g. AMD Zen 4, so only the tail pays).
template <bool FULL>
ZT_AVX512 inline int adam_avx512_vec(const ZtAdamArgs& a, const Coef& c, int64_t i, __mmask16 k) {
  const __m512 vscale = _mm512_set1_ps(c.scale);
  __m512 g = _mm512_mul_ps(avx512_load_grad<FULL>(a.grad, a.grad_dtype, i, k), vscale);
  int bad = __builtin_popcount(_mm512_mask_cmp_ps_mask(k, _mm512_abs_ps(g), _mm512_set1_ps(INFINITY), _CMP_NLT_UQ));
  __m512 p = FULL ? _mm512_loadu_ps(a.param + i) : _mm512_maskz_loadu_ps(k, a.param + i);
  __m512 m = FULL ? _mm512_loadu_ps(a.exp_avg + i) : _mm512_maskz_loadu_ps(k, a.exp_avg + i);
  __m512 v = FULL ? _mm512_loadu_ps(a.exp_avg_sq + i) : _mm512_maskz_loadu_ps(k, a.exp_avg_sq + i);
  if (c.decoupled) p = _mm512_mul_ps(p, _mm512_set1_ps(c.decay));
  else g = _mm512_fmadd_ps(_mm512_set1_ps(c.wd), p, g);
  m = _mm512_fmadd_ps(_mm512_set1_ps(c.one_minus_b1), _mm512_sub_ps(g, m), m);
  v = _mm512_fmadd_ps(v, _mm512_set1_ps(c.b2), _mm512_mul_ps(_mm512_set1_ps(c.one_minus_b2), _mm512_mul_ps(g, g)));
  __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c.bc2_sqrt)), _mm512_set1_ps(c.eps));
  p = _mm512_fnmadd_ps(_mm512_set1_ps(c.step_size), _mm512_div_ps(m, denom), p);
  if (FULL) {
    _mm512_storeu_ps(a.param + i, p);
    _mm512_storeu_ps(a.exp_avg + i, m);
    _mm512_storeu_ps(a.exp_avg_sq + i, v);
  } else {
    _mm512_mask_storeu_ps(a.param + i, k, p);
    _mm512_mask_storeu_ps(a.exp_avg + i, k, m);
    _mm512_mask_storeu_ps(a.exp_avg_sq + i, k, v);
  }
  if (a.out_dtype == ZT_F32) {
    if (FULL) _mm512_storeu_ps((float*)a.param_out + i, p);
    else _mm512_mask_storeu_ps((float*)a.param_out + i, k, p);
  } else if (a.out_dtype != ZT_NONE) {
    __m256i h = a.out_dtype == ZT_BF16 ? avx512_to_bf16(p) : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
    if (FULL) _mm256_storeu_si256((__m256i*)((uint16_t*)a.param_out + i), h);
    else _mm256_mask_storeu_epi16((uint16_t*)a.param_out + i, k, h);
  }
  return bad;
}

ZT_AVX512 int64_t adam_avx512(const ZtAdamArgs& a, const Coef& c, int64_t begin, int64_t end) {
  int64_t nonfinite = 0;
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) nonfinite += adam_avx512_vec<true>(a, c, i, (__mmask16)0xffff);
  if (i < end) nonfinite += adam_avx512_vec<false>(a, c, i, (__mmask16)((1u << (end - i)) - 1));
  return nonfinite;
}
#endif  // ZT_X86

using Kernel = int64_t (*)(const ZtAdamArgs&, const Coef&, int64_t, int64_t);

Kernel pick_kernel(int simd) {
#ifdef ZT_X86
  if (simd >= ZT_SIMD_AVX512) return adam_avx512;
  if (simd >= ZT_SIMD_AVX2) return adam_avx2;
#endif
  return adam_scalar;
}

// Elements per thread below which waking workers costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 16;

}  // namespace

namespace {

// 0, or ZT_ERR_ARGS / ZT_ERR_SIMD with the reason recorded for zt_cpu_last_error().
int64_t check_args(const ZtAdamArgs& a, int64_t t, int supported) {
  const char* fn = "zt_adam_step_multi";
  if (a.n < 0) return zt::set_error(fn, "args[%lld].n = %lld < 0", (long long)t, (long long)a.n), ZT_ERR_ARGS;
  if (a.n > 0 && (!a.param || !a.exp_avg || !a.exp_avg_sq || !a.grad))
    return zt::set_error(fn, "args[%lld] has a NULL buffer", (long long)t), ZT_ERR_ARGS;
  if (a.grad_dtype < ZT_F32 || a.grad_dtype > ZT_F16)
    return zt::set_error(fn, "args[%lld].grad_dtype = %d is not a ZtDtype", (long long)t, a.grad_dtype), ZT_ERR_ARGS;
  if (a.out_dtype != ZT_NONE && (a.out_dtype < ZT_F32 || a.out_dtype > ZT_F16 || !a.param_out))
    return zt::set_error(fn, "args[%lld]: out_dtype = %d without a matching param_out", (long long)t, a.out_dtype),
           ZT_ERR_ARGS;
  int simd = a.simd == ZT_SIMD_AUTO ? supported : a.simd;
  if (simd > supported)
    return zt::set_error(fn, "SIMD level %d is not supported by this CPU (best: %d)", simd, supported), ZT_ERR_SIMD;
  return 0;
}

int64_t adam_step_multi(const ZtAdamArgs* args, int64_t count) {
  if (count < 0) return zt::set_error("zt_adam_step_multi", "count = %lld < 0", (long long)count), ZT_ERR_ARGS;
  if (count == 0) return 0;
  const int supported = zt_cpu_simd_supported();
  int64_t total = 0;
  for (int64_t t = 0; t < count; ++t) {
    int64_t rc = check_args(args[t], t, supported);
    if (rc < 0) return rc;
    total += args[t].n;
  }
  std::vector<Coef> coefs;
  std::vector<Kernel> kernels;
  std::vector<int64_t> starts;  // starts[t] = first global index of buffer t
  coefs.reserve(count);
  kernels.reserve(count);
  starts.reserve(count + 1);
  int64_t acc = 0;
  for (int64_t t = 0; t < count; ++t) {
    coefs.push_back(make_coef(args[t]));
    kernels.push_back(pick_kernel(args[t].simd == ZT_SIMD_AUTO ? supported : args[t].simd));
    starts.push_back(acc);
    acc += args[t].n;
  }
  starts.push_back(acc);

  int threads = args[0].threads > 0 ? args[0].threads : zt::hardware_threads();
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, total / kMinPerThread));
  std::atomic<int64_t> nonfinite{0};
  zt::ThreadPool::instance().run(threads, [&](int tid, int nt) {
    // Contiguous slices of the concatenated range. Where a slice boundary falls
    // inside a buffer it is rounded up to a multiple of 16 elements of that buffer
    // (both neighbours round the same boundary the same way), so every element is
    // computed by the same vector code whatever the thread count (bitwise-stable
    // results) and threads never share a 64-byte line of fp32 state.
    int64_t per = (total + nt - 1) / nt;
    int64_t begin = std::min<int64_t>(total, per * tid), end = std::min<int64_t>(total, begin + per);
    auto local_bound = [&](int64_t global, int64_t t) {
      int64_t x = std::min(std::max(global, starts[t]), starts[t + 1]) - starts[t];
      return std::min<int64_t>(args[t].n, (x + 15) & ~(int64_t)15);
    };
    int64_t local = 0;
    auto first = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (int64_t t = std::max<int64_t>(0, first); t < count && starts[t] <= end; ++t) {
      int64_t lo = local_bound(begin, t), hi = local_bound(end, t);
      if (lo < hi) local += kernels[t](args[t], coefs[t], lo, hi);
    }
    nonfinite += local;
  });
  return nonfinite.load();
}

}  // namespace

// Steps `count` independent buffers (e.g. all parameters of a param group) in ONE
// parallel region: the threads split the concatenated element range, so 200
// tensors of 1M cost one pool wake-up, not 200. Hyper-parameters, threads and simd
// come from each entry (threads/simd of args[0] govern the region).
// Returns the number of non-finite (inf/NaN) scaled gradients seen, or ZT_ERR_ARGS,
// ZT_ERR_SIMD or ZT_ERR_EXCEPTION (message in zt_cpu_last_error()).
ZT_API int64_t zt_adam_step_multi(const ZtAdamArgs* args, int64_t count) {
  return zt::guard<int64_t>("zt_adam_step_multi", ZT_ERR_EXCEPTION, [&] { return adam_step_multi(args, count); });
}

// Sum of squares of load(i) * scale over [begin, end): 8 independent float accumulators per
// block of 4096, folded into double — fast, and accurate enough for a norm (relative error ~1e-7).
template <class Load>
double sumsq_range(Load load, int64_t begin, int64_t end, float scale) {
  double acc = 0.0;
  for (int64_t b = begin; b < end; b += 4096) {
    int64_t e = std::min<int64_t>(end, b + 4096);
    float lanes[8] = {0};
    int64_t i = b;
    for (; i + 8 <= e; i += 8)
      for (int l = 0; l < 8; ++l) {
        float g = load(i + l) * scale;
        lanes[l] += g * g;
      }
    for (; i < e; ++i) {
      float g = load(i) * scale;
      lanes[0] += g * g;
    }
    for (int l = 0; l < 8; ++l) acc += lanes[l];
  }
  return acc;
}

// Sum of squares of (grad * scale) in double, for global grad-norm clipping of
// host-resident gradients, stored in *out. Non-finite values propagate (the sum becomes
// inf/NaN). Returns 0, ZT_ERR_ARGS or ZT_ERR_EXCEPTION (message in zt_cpu_last_error()).
ZT_API int32_t zt_grad_sumsq(const void* grad, int32_t dtype, int64_t n, float scale, int32_t threads,
                             double* out) {
  return zt::guard<int32_t>("zt_grad_sumsq", ZT_ERR_EXCEPTION, [&]() -> int32_t {
    if (!out || (n > 0 && !grad) || dtype < ZT_F32 || dtype > ZT_F16)
      return zt::set_error("zt_grad_sumsq", "NULL buffer or dtype %d is not a ZtDtype", dtype), ZT_ERR_ARGS;
    *out = 0.0;
    if (n <= 0) return 0;
    threads = threads > 0 ? threads : zt::hardware_threads();
    threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, n / kMinPerThread));
    double partial[256] = {0};
    threads = std::min(threads, 256);
    zt::ThreadPool::instance().run(threads, [&](int tid, int nt) {
      int64_t per = (n + nt - 1) / nt;
      int64_t begin = std::min<int64_t>(n, per * tid), end = std::min<int64_t>(n, begin + per);
      double acc = 0.0;
      switch (dtype) {  // one loop per dtype: the load inlines and the lanes vectorize
        case ZT_BF16: acc = sumsq_range([&](int64_t i) { return bf16_to_f32(((const uint16_t*)grad)[i]); },
                                        begin, end, scale); break;
        case ZT_F16: acc = sumsq_range([&](int64_t i) { return f16_to_f32(((const uint16_t*)grad)[i]); },
                                       begin, end, scale); break;
        default: acc = sumsq_range([&](int64_t i) { return ((const float*)grad)[i]; }, begin, end, scale);
      }
      partial[tid] = acc;
    });
    double total = 0.0;
    for (int t = 0; t < threads; ++t) total += partial[t];
    *out = total;
    return 0;
  });
}

// sizeof(ZtAdamArgs) as this library was compiled; zerotier/optim/_kernels.py refuses a
// library whose struct does not match its ctypes mirror.
ZT_API int64_t zt_adam_args_size(void) noexcept { return (int64_t)sizeof(ZtAdamArgs); }

// The calling thread's message for the last failure of an export of this library.
ZT_API const char* zt_cpu_last_error(void) noexcept { return zt::g_last_error; }
