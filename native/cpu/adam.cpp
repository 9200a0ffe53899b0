// CPU Adam / AdamW (and Lion: cpu/lion.inc) over flat master weights and moments, in place.
//
// One pass per element: read grad (fp32/bf16/fp16, optionally scaled by
// 1/loss_scale and clip coefficient), update master/exp_avg/exp_avg_sq, optionally
// write the new parameter as fp32/bf16/fp16 into a separate buffer, and count
// non-finite gradients. State dtypes ([Note: compact optimizer state] and [Note: 8-bit
// moments] in zerotier/optim/kernel_math.py): master fp32 or bf16 (stochastic rounding),
// moments fp32, bf16 (round to nearest even) or uint8 codes with one fp32 absmax per
// QUANT_BLOCK elements.
//
// Four kernels compute the same math bit for bit: a scalar reference loop (the oracle
// the SIMD paths are tested against, itself equal to adam_step_reference in Python),
// AVX2+FMA+F16C, AVX-512 (F/BW/VL, cpu/avx512_lanes.inc) and AVX-512 with VBMI (the same
// lanes, 8-bit moments by byte permutes: cpu/vbmi_tables.inc). The SIMD kernel is written
// once (cpu/adam_simd.inc) over each ISA's vector helpers and compiled per ISA with a
// target pragma, so the library itself needs only baseline x86-64 and picks a kernel at
// run time (zt_cpu_simd_supported).
//
// [Note: one rounding per operation] Every fp32 operation rounds once, in every kernel
// and in the Python reference: no fused multiply-add (setup.py compiles with
// -ffp-contract=off, so the compiler does not contract a*b+c either). That is what makes
// the kernels bitwise equal to each other and to the reference, which 8-bit moments
// need: a one-ulp difference can move a value across a code boundary.
//
// [Note: one division per element] sqrt(v)/sqrt(bc2) is computed as sqrt(v) * (1/sqrt(bc2)),
// the reciprocal rounded to fp32 once per call, leaving one division (m / denom) and one
// square root per element: on CPUs with slow 256-bit dividers (AMD Zen 1: one vdivps ymm
// per ~5 cycles) they, not memory, bound a core's rate. A relative difference of an ulp
// from torch's formula, inside test_cpu_adam's tolerance.
//
// The math follows torch.optim.AdamW / torch's fused CPU kernel:
//   adamw: p *= 1 - lr*wd              adam: g += wd*p
//   m = m + (1-b1)*(g-m)               v = b2*v + (1-b2)*g*g
//   p = p - (lr/bc1) * (m / (sqrt(v) * (1/sqrt(bc2)) + eps))
#include <math.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
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
  void* master;        // master weights (master_dtype), updated in place
  void* exp_avg;       // first moment (exp_avg_dtype)
  void* exp_avg_sq;    // second moment (exp_avg_sq_dtype)
  const void* grad;    // gradient, dtype grad_dtype
  void* param_out;     // optional copy of the new master in out_dtype (NULL = none)
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
  int32_t master_dtype;      // ZT_F32 or ZT_BF16 (stochastic rounding with sr_seed)
  int32_t exp_avg_dtype;     // ZT_F32, ZT_BF16 or ZT_Q8 (signed map)
  int32_t exp_avg_sq_dtype;  // ZT_F32, ZT_BF16 or ZT_Q8 (unsigned map)
  float* exp_avg_absmax;     // ZT_Q8: ceil(n / ZT_QUANT_BLOCK) block scales, updated
  float* exp_avg_sq_absmax;
  const float* qmaps;        // [4][256]: signed map, its midpoints, unsigned map, its midpoints
  uint64_t sr_seed;          // element i of a bf16 master rounds with sr_bits(sr_seed + i)
};

namespace {

constexpr int64_t QB = ZT_QUANT_BLOCK;

struct QIndex;  // [Note: 8-bit code search]

struct Coef {
  float lr, b1, b2, one_minus_b1, one_minus_b2, eps, wd, decay, step_size, inv_bc2_sqrt, scale;
  bool decoupled;
  bool plain;  // fp32 master and moments: the kernels skip the dtype dispatch
  const float *map_m, *mid_m, *map_v, *mid_v;  // exp_avg: signed, exp_avg_sq: unsigned
  const QIndex *qi_m = nullptr, *qi_v = nullptr;  // the midpoints' indexes (8-bit moments only)
};

// A kernel steps elements [begin, end) of one buffer; begin is a block start.
using Kernel = int64_t (*)(const ZtAdamArgs&, const Coef&, int64_t, int64_t);
// zt_grad_sumsq's per-thread part: the sum of squares of grad[i] * scale over [begin, end).
using SumsqKernel = double (*)(const void* grad, int64_t begin, int64_t end, float scale);
constexpr int64_t kSumsqBlock = 4096;  // elements per float partial sum (a multiple of every 4 * W)

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
  c.inv_bc2_sqrt = (float)(1.0 / sqrt(bc2));  // [Note: one division per element]
  c.plain = a.master_dtype == ZT_F32 && a.exp_avg_dtype == ZT_F32 && a.exp_avg_sq_dtype == ZT_F32;
  c.map_m = a.qmaps;
  c.mid_m = a.qmaps ? a.qmaps + 256 : nullptr;
  c.map_v = a.qmaps ? a.qmaps + 512 : nullptr;
  c.mid_v = a.qmaps ? a.qmaps + 768 : nullptr;
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

inline uint32_t fmix32(uint32_t x) {  // murmur3's finalizer
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  return x ^ (x >> 16);
}

// The hash of the high word, shared by 2^32 consecutive counters (hoisted by the SIMD kernels).
inline uint32_t sr_key(uint64_t counter) { return fmix32((uint32_t)(counter >> 32) ^ 0x9E3779B9u); }

// Stochastic rounding of f to bf16 with the 16 random bits of `counter` ([Note: compact
// optimizer state]): add them below the kept bits, truncate. NaN as in f32_to_bf16.
inline uint16_t f32_to_bf16_sr(float f, uint64_t counter) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  uint32_t r = fmix32((uint32_t)counter ^ sr_key(counter)) >> 16;
  return (uint16_t)((u + r) >> 16);
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

// A moment's value: fp32, widened bf16, or map[code] * the block's absmax.
inline float load_moment(const void* buf, int dt, int64_t i, const float* map, float absmax) {
  switch (dt) {
    case ZT_BF16: return bf16_to_f32(((const uint16_t*)buf)[i]);
    case ZT_Q8: return map[((const uint8_t*)buf)[i]] * absmax;
    default: return ((const float*)buf)[i];
  }
}

// fp32/bf16 moments are stored at once; 8-bit ones wait in `block` (their block's new
// values, index j) until the whole block is known.
inline void store_moment(void* buf, int dt, int64_t i, float x, float* block, int64_t j) {
  switch (dt) {
    case ZT_BF16: ((uint16_t*)buf)[i] = f32_to_bf16(x); break;
    case ZT_Q8: block[j] = x; break;
    default: ((float*)buf)[i] = x;
  }
}

inline void store_out(const ZtAdamArgs& a, int64_t i, float p) {
  if (a.out_dtype == ZT_BF16) ((uint16_t*)a.param_out)[i] = f32_to_bf16(p);
  else if (a.out_dtype == ZT_F16) ((uint16_t*)a.param_out)[i] = f32_to_f16(p);
  else if (a.out_dtype == ZT_F32) ((float*)a.param_out)[i] = p;
}

// One element: the oracle of every kernel (llm.c's gpt2_update, with the state dtypes).
// Returns 1 when the scaled gradient is not finite.
inline int adam_element(const ZtAdamArgs& a, const Coef& c, int64_t i, float m_absmax, float v_absmax,
                        float* m_block, float* v_block, int64_t j) {
  float g = load_grad_scalar(a.grad, a.grad_dtype, i) * c.scale;
  int bad = !isfinite(g);
  float p = a.master_dtype == ZT_BF16 ? bf16_to_f32(((const uint16_t*)a.master)[i]) : ((const float*)a.master)[i];
  if (c.decoupled) p = p * c.decay;
  else if (c.wd != 0.0f) g = g + c.wd * p;
  float m = load_moment(a.exp_avg, a.exp_avg_dtype, i, c.map_m, m_absmax);
  float v = load_moment(a.exp_avg_sq, a.exp_avg_sq_dtype, i, c.map_v, v_absmax);
  m = m + c.one_minus_b1 * (g - m);
  v = v * c.b2 + c.one_minus_b2 * (g * g);
  float denom = sqrtf(v) * c.inv_bc2_sqrt + c.eps;
  p = p - c.step_size * (m / denom);
  if (a.master_dtype == ZT_BF16) {
    uint16_t h = f32_to_bf16_sr(p, a.sr_seed + (uint64_t)i);
    ((uint16_t*)a.master)[i] = h;
    p = bf16_to_f32(h);  // param_out receives the stored master
  } else {
    ((float*)a.master)[i] = p;
  }
  store_moment(a.exp_avg, a.exp_avg_dtype, i, m, m_block, j);
  store_moment(a.exp_avg_sq, a.exp_avg_sq_dtype, i, v, v_block, j);
  store_out(a, i, p);
  return bad;
}

// The 8-bit code of x / scale: #{k : mid[k] < x / scale} by an 8-step binary search over
// the 255 midpoints (a NaN compares false everywhere: code 0).
inline uint8_t quantize_scalar(float x, float scale, const float* mid) {
  float xn = x / scale;
  uint32_t pos = 0;
  for (uint32_t s = 128; s >= 1; s >>= 1)
    if (mid[pos + s - 1] < xn) pos += s;
  return (uint8_t)pos;
}

// max |x| over a block, NaN if any element is NaN (torch.amax's rule).
inline float absmax_scalar(const float* x, int64_t len) {
  float mx = 0.0f;
  bool nan = false;
  for (int64_t j = 0; j < len; ++j) {
    float ax = fabsf(x[j]);
    if (ax != ax) nan = true;
    else if (ax > mx) mx = ax;
  }
  return nan ? NAN : mx;
}

// The block scale a block is divided by: its absmax, or 1 for an all-zero (or NaN) block.
inline float block_scale(float absmax) { return absmax > 0.0f ? absmax : 1.0f; }

// [Note: 8-bit code search] The SIMD kernels find quantize_scalar's code without the
// binary search's eight dependent table reads (gathers, microcoded on AMD Zen: ~35 cycles
// per 8 lanes each). An fp32 x orders like its bits: for x >= 0 the magnitude bits
// a = bits(x) & 0x7fffffff grow with x, for x < 0 they grow as x falls. A QIndex cuts the
// magnitudes [lo, hi) into buckets of 2^shift consecutive bit patterns, per sign, with at
// most one midpoint (a "threshold") in each, so one table read per lane gives the code:
//   code = count + (key > threshold)
// count: the midpoints below every x of the bucket other than its threshold; key: a's
// offset in the bucket (inverted for x < 0, where a larger magnitude is a smaller x).
// Magnitudes below lo (no midpoint there) share bucket 0, those >= hi (above every
// midpoint: +-1, inf) the last one; a NaN is code 0. The lookup is exact for every float.
// The division x / scale that the code is taken of is replaced by x * (1/scale) where
// that cannot change the code: with 1/scale a normal float, the product is within 3 units
// in the last place (ulps) of the quotient, i.e. within kQMargin - 1 bit patterns (both
// are rounded once from x/scale and 1/scale, each relatively off by at most 2^-24), so
// the two codes differ only when a threshold lies within kQMargin patterns of the
// product. The index is laid out so that no threshold is that close to a bucket edge
// (`recip`), so only the bucket's own threshold can be: a vector with such a lane is
// redone with the division (about 1 in 4000 vectors on random data).
constexpr int32_t kQMargin = 8;
constexpr int32_t kQMaxBuckets = 1 << 14;  // per sign

// One 8-bit moment's tables: the bucket index of its midpoints and, for the kernels with
// byte permutes, [Note: byte-permute tables] (cpu/vbmi_tables.inc).
struct QIndex {
  float map[256], mid[255];  // the map and midpoints it indexes (the cache's key)
  int32_t lo = 0, hi = 0, shift = 0, mask = 0, nb = 0;  // nb: buckets per sign, the last one for >= hi
  bool recip = false;  // laid out for x * (1/scale): no threshold within kQMargin of an edge
  std::vector<int32_t> entries;  // [sign][bucket]: count << 24 | has threshold << 23 | threshold key
  bool keys16 = false;  // the midpoints' 16-bit keys rise strictly: `levels` can be searched
  int16_t levels[8][128];  // level L: the 16-bit keys of mid[j * 2^(8-L) + 2^(7-L) - 1], j < 2^L
  uint8_t map_planes[4][256], mid_planes[4][256];  // byte k of map[i] / of mid[i] (mid[255] = inf)
};

inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// The code of xn by the index (what the SIMD kernels compute per lane).
inline uint32_t qindex_code(const QIndex& q, float xn) {
  if (xn != xn) return 0;
  uint32_t u = f32_bits(xn), neg = u >> 31;
  int32_t r = std::min(std::max((int32_t)(u & 0x7fffffffu), q.lo), q.hi) - q.lo;
  uint32_t e = (uint32_t)q.entries[(r >> q.shift) + (neg ? q.nb : 0)];
  int32_t key = (r & q.mask) ^ (neg ? q.mask : 0);
  return (e >> 24) + (key > (int32_t)(e & (uint32_t)q.mask));
}

// Lays out q for buckets of 2^shift patterns from magnitude `lo`; false if a bucket would
// hold two thresholds of one sign, the table would be too large, or (with `margin`) a
// threshold lies within kQMargin of a bucket edge.
bool qindex_layout(QIndex& q, const int32_t* mag, const bool* neg, int shift, int32_t lo, bool margin) {
  const int32_t size = 1 << shift, mask = size - 1;
  int32_t tmax = 0;
  for (int k = 0; k < 255; ++k) tmax = std::max(tmax, mag[k]);
  // hi: the first edge above every threshold (by more than the margin)
  int64_t span = (int64_t)tmax + kQMargin + 1 - lo;
  int64_t hi = lo + (span + mask) / size * size;
  if (hi > 0x7f800000 || (hi - lo) / size + 1 > kQMaxBuckets) return false;
  for (int k = 0; k < 255; ++k) {
    int32_t low = (mag[k] - lo) & mask;
    if (margin && (low < kQMargin || low > size - kQMargin)) return false;
    // thresholds of one sign are sorted by magnitude (ascending for x > 0, descending for x < 0)
    if (k > 0 && neg[k] == neg[k - 1] && (mag[k] - lo) >> shift == (mag[k - 1] - lo) >> shift) return false;
  }
  q.lo = lo;
  q.hi = (int32_t)hi;
  q.shift = shift;
  q.mask = mask;
  q.nb = (int32_t)((hi - lo) >> shift) + 1;
  q.recip = margin;
  q.entries.assign(2 * (size_t)q.nb, 0);
  auto below = [&](float x) {  // #{k : mid[k] < x}
    return (int32_t)(std::lower_bound(q.mid, q.mid + 255, x) - q.mid);
  };
  for (int s = 0; s < 2; ++s) {
    for (int32_t b = 0; b < q.nb; ++b) {
      int64_t first = (int64_t)lo + (int64_t)b * size;  // the bucket's smallest magnitude pattern
      int64_t last = b + 1 < q.nb ? first + mask : 0x7f800000;  // its largest (the last: up to inf)
      // count: the midpoints below the bucket's smallest x, x0 (its threshold, if any, is not:
      // it lies at or above x0)
      float x0 = s ? -bits_f32((uint32_t)last) : bits_f32((uint32_t)first);
      int32_t count = below(x0), entry = mask;  // no threshold: key > mask never holds
      for (int k = 0; k < 255; ++k) {
        if (neg[k] != (s == 1) || mag[k] < first || mag[k] > last) continue;
        int32_t low = (int32_t)(mag[k] - first);
        entry = (1 << 23) | (s ? low ^ mask : low);
      }
      q.entries[(size_t)s * q.nb + b] = (int32_t)((uint32_t)count << 24) | entry;
    }
  }
  return true;
}

// x's 16-bit key: the top half of its bits made to order like x (a signed int16 compare),
// the magnitude bits flipped for x < 0.
inline int16_t key16(float x) {
  int32_t u = (int32_t)f32_bits(x);
  return (int16_t)((u ^ ((u >> 31) & 0x7fffffff)) >> 16);
}

// byte k of table[i] into planes[k][i]: what a byte permute reads a 256-entry fp32 table from.
void byte_planes(const float* table, uint8_t (*planes)[256]) {
  for (int i = 0; i < 256; ++i)
    for (int k = 0; k < 4; ++k) planes[k][i] = (uint8_t)(f32_bits(table[i]) >> (8 * k));
}

// The midpoints' tables of [Note: byte-permute tables]: their byte planes and, when their
// 16-bit keys rise strictly (at most one midpoint per key), the levels of the binary search
// over them. Midpoints already checked sorted, finite and nonzero.
void qindex_search_tables(QIndex& q) {
  float mid[256];
  memcpy(mid, q.mid, sizeof q.mid);
  mid[255] = INFINITY;  // above every x the codes are taken of (finite)
  byte_planes(mid, q.mid_planes);
  q.keys16 = true;
  for (int k = 1; k < 255; ++k) q.keys16 = q.keys16 && key16(mid[k - 1]) < key16(mid[k]);
  memset(q.levels, 0, sizeof q.levels);
  for (int L = 0; L < 8; ++L)
    for (int j = 0; j < (1 << L); ++j) q.levels[L][j] = key16(mid[j * (1 << (8 - L)) + (1 << (7 - L)) - 1]);
}

// Builds the index of 255 sorted midpoints; q.entries stays empty (the kernels then run the
// binary search) for tables it cannot index: unsorted, NaN, a zero or infinite midpoint.
void qindex_build(QIndex& q, const float* map, const float* mid) {
  memcpy(q.map, map, sizeof q.map);
  memcpy(q.mid, mid, sizeof q.mid);
  byte_planes(q.map, q.map_planes);
  int32_t mag[255];
  bool neg[255];
  int32_t tmin = 0x7f800000;
  for (int k = 0; k < 255; ++k) {
    if (!(mid[k] == mid[k]) || mid[k] == 0.0f || std::isinf(mid[k]) || (k > 0 && !(mid[k - 1] < mid[k]))) return;
    uint32_t u = f32_bits(mid[k]);
    mag[k] = (int32_t)(u & 0x7fffffffu);
    neg[k] = u >> 31;
    tmin = std::min(tmin, mag[k]);
  }
  qindex_search_tables(q);
  // Largest buckets first; for each size, bucket 0 starts up to one bucket below the
  // smallest threshold (in sixteenths), until no threshold is near an edge.
  bool found = false;
  for (int shift = 22; shift >= 0 && !found; --shift)
    for (int j = 0; j < 16 && !found; ++j) {
      int64_t lo = (int64_t)tmin - kQMargin - 1 - (int64_t)j * ((1 << shift) / 16);
      found = lo >= 0 && qindex_layout(q, mag, neg, shift, (int32_t)lo, true);
    }
  for (int shift = 22; shift >= 0 && !found; --shift) found = qindex_layout(q, mag, neg, shift, tmin - 1, false);
  if (!found) return;
  // Self-check against the binary search at every threshold, one pattern either side, and
  // the edges of the indexed range (cheap; an index that fails is not used).
  auto check = [&](float x) { return qindex_code(q, x) == quantize_scalar(x, 1.0f, mid); };
  const float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY, bits_f32((uint32_t)q.lo),
                            -bits_f32((uint32_t)q.lo), bits_f32((uint32_t)q.hi), -bits_f32((uint32_t)q.hi)};
  bool ok = true;
  for (float x : specials) ok = ok && check(x);
  for (int k = 0; k < 255 && ok; ++k)
    for (int d = -1; d <= 1; ++d) ok = ok && check(bits_f32(f32_bits(mid[k]) + d));
  if (!ok) q.entries.clear();
}

// The tables of `map` (256 values) and its `mid` (255 midpoints), built once per thread and
// pair: the kernels read them; nullptr-free, but with empty entries (and no keys16) where the
// midpoints cannot be indexed.
std::shared_ptr<const QIndex> qindex_for(const float* map, const float* mid) {
  thread_local std::vector<std::shared_ptr<const QIndex>> cache;  // no lock: one per calling thread
  for (const auto& q : cache)
    if (memcmp(q->mid, mid, sizeof q->mid) == 0 && memcmp(q->map, map, sizeof q->map) == 0) return q;
  auto q = std::make_shared<QIndex>();
  qindex_build(*q, map, mid);
  if (cache.size() >= 8) cache.erase(cache.begin());
  cache.push_back(q);
  return q;
}

// Re-quantizes block `blk` of an 8-bit moment from its new fp32 values x[0, len).
void quantize_block_scalar(const float* x, int64_t len, uint8_t* codes, float* absmax, const float* mid) {
  float mx = absmax_scalar(x, len);
  *absmax = mx;
  float scale = block_scale(mx);
  for (int64_t j = 0; j < len; ++j) codes[j] = quantize_scalar(x[j], scale, mid);
}

// Elements [begin, end) of one buffer; begin is a multiple of QB (a block start).
int64_t adam_scalar(const ZtAdamArgs& a, const Coef& c, int64_t begin, int64_t end) {
  alignas(64) float m_block[QB], v_block[QB];
  int64_t nonfinite = 0;
  for (int64_t b0 = begin; b0 < end; b0 += QB) {
    int64_t len = std::min(QB, end - b0), blk = b0 / QB;
    float m_absmax = a.exp_avg_dtype == ZT_Q8 ? a.exp_avg_absmax[blk] : 0.0f;
    float v_absmax = a.exp_avg_sq_dtype == ZT_Q8 ? a.exp_avg_sq_absmax[blk] : 0.0f;
    for (int64_t j = 0; j < len; ++j) nonfinite += adam_element(a, c, b0 + j, m_absmax, v_absmax, m_block, v_block, j);
    if (a.exp_avg_dtype == ZT_Q8)
      quantize_block_scalar(m_block, len, (uint8_t*)a.exp_avg + b0, a.exp_avg_absmax + blk, c.mid_m);
    if (a.exp_avg_sq_dtype == ZT_Q8)
      quantize_block_scalar(v_block, len, (uint8_t*)a.exp_avg_sq + b0, a.exp_avg_sq_absmax + blk, c.mid_v);
  }
  return nonfinite;
}

}  // namespace

#include "cpu/lion.inc"

#ifdef ZT_X86
// The lane shims whose AVX2 and AVX-512 bodies differ only in the intrinsics' prefix (P: _mm256, _mm512).
#define ZT_LANE_ARITHMETIC(P)                                                                                 \
  inline F vload(const float* p) { return P##_loadu_ps(p); }                                                  \
  inline void vstore(float* p, F x) { P##_storeu_ps(p, x); }                                                  \
  inline F vset(float x) { return P##_set1_ps(x); }                                                           \
  inline F vadd(F a, F b) { return P##_add_ps(a, b); }                                                        \
  inline F vsub(F a, F b) { return P##_sub_ps(a, b); }                                                        \
  inline F vmul(F a, F b) { return P##_mul_ps(a, b); }                                                        \
  inline F vdiv(F a, F b) { return P##_div_ps(a, b); }                                                        \
  inline F vsqrt(F a) { return P##_sqrt_ps(a); }                                                              \
  /* fused, one rounding for a*b+c: for the sum of squares only (sumsq_simd.inc), never in Adam/Lion */       \
  inline F vfmadd(F a, F b, F c) { return P##_fmadd_ps(a, b, c); }
// A QIndex's constants, broadcast to integer vectors I.
#define ZT_QLOOKUP(I, P)                                                                                      \
  struct QLookup {                                                                                            \
    I lo, hi, nb, mask, margin;                                                                               \
    __m128i shift;                                                                                            \
    const int32_t* entries;                                                                                   \
    explicit QLookup(const QIndex& q)                                                                         \
        : lo(P##_set1_epi32(q.lo)), hi(P##_set1_epi32(q.hi)), nb(P##_set1_epi32(q.nb)),                       \
          mask(P##_set1_epi32(q.mask)), margin(P##_set1_epi32(kQMargin)), shift(_mm_cvtsi32_si128(q.shift)),  \
          entries(q.entries.data()) {}                                                                        \
  };
// fmix32 (MurmurHash3's finalizer) per 32-bit lane of I; S: the lane-agnostic suffix (si256, si512).
#define ZT_FMIX32(I, P, S)                                                                                    \
  inline I vfmix32(I x) {                                                                                     \
    x = P##_xor_##S(x, P##_srli_epi32(x, 16));                                                                \
    x = P##_mullo_epi32(x, P##_set1_epi32((int)0x85ebca6bu));                                                 \
    x = P##_xor_##S(x, P##_srli_epi32(x, 13));                                                                \
    x = P##_mullo_epi32(x, P##_set1_epi32((int)0xc2b2ae35u));                                                 \
    return P##_xor_##S(x, P##_srli_epi32(x, 16));                                                             \
  }

// The ISAs without byte permutes read an 8-bit moment per vector (vdequant) and find its codes
// by the bucket index alone ([Note: 8-bit code search]); cpu/vbmi_tables.inc defines these for real.
#define ZT_NO_BYTE_TABLES                                                                                     \
  constexpr bool kByteTables = false;                                                                         \
  inline void vdequant_block(const uint8_t*, int64_t, const QIndex&, F, float*) {}                            \
  inline int64_t vcodes_exact(const float*, int64_t, uint8_t*, float, const QIndex&) { return 0; }

// ---- AVX2 + FMA + F16C: 8 lanes ------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
namespace {
constexpr int W = 8;
using F = __m256;
ZT_LANE_ARITHMETIC(_mm256)
inline F vwiden_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline F vload_bf16(const uint16_t* p) { return vwiden_bf16(_mm_loadu_si128((const __m128i*)p)); }
inline F vload_grad(const void* g, int dt, int64_t i) {
  if (dt == ZT_BF16) return vload_bf16((const uint16_t*)g + i);
  if (dt == ZT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)g + i)));
  return _mm256_loadu_ps((const float*)g + i);
}
// Non-finite gradients, counted per lane in a vector (!(|g| < inf) is true for inf and NaN:
// an all-ones lane is -1) and summed once per block.
using Count = __m256i;
inline Count vcount_zero() { return _mm256_setzero_si256(); }
inline Count vcount_nonfinite(Count acc, F g) {
  F absg = _mm256_and_ps(g, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  return _mm256_sub_epi32(acc, _mm256_castps_si256(_mm256_cmp_ps(absg, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ)));
}
inline int64_t vcount_sum(Count acc) {
  alignas(32) int32_t lanes[W];
  _mm256_store_si256((__m256i*)lanes, acc);
  int64_t sum = 0;
  for (int32_t l : lanes) sum += l;
  return sum;
}
// 8 x u32 (each < 65536) to 8 x u16
inline __m128i vpack16(__m256i r) {
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline __m256i vnan_bf16(__m256i u) {  // NaN lanes keep their top half with the quiet bit set
  return _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
}
inline void vstore_bf16(uint16_t* dst, F p) {  // round to nearest even
  __m256i u = _mm256_castps_si256(p);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, vnan_bf16(u), _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q)));
  _mm_storeu_si128((__m128i*)dst, vpack16(r));
}
ZT_FMIX32(__m256i, _mm256, si256)
// Stochastic rounding of lane l with counter + l; the lanes share the high word's key
// (the caller falls back to scalar where the low word wraps inside the vector).
inline void vstore_bf16_sr(uint16_t* dst, F p, uint64_t counter) {
  __m256i lo = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)counter), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i r = _mm256_srli_epi32(vfmix32(_mm256_xor_si256(lo, _mm256_set1_epi32((int)sr_key(counter)))), 16);
  __m256i u = _mm256_castps_si256(p);
  __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, r), 16);
  h = _mm256_blendv_epi8(h, vnan_bf16(u), _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q)));
  _mm_storeu_si128((__m128i*)dst, vpack16(h));
}
inline void vstore_f16(uint16_t* dst, F p) {
  _mm_storeu_si128((__m128i*)dst, _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
}
// Table reads by scalar loads: vgatherdps is microcoded on AMD Zen 1/2 (about 35 cycles
// per 8 lanes, measured), 8 loads and inserts take about 10.
inline F vdequant(const uint8_t* codes, const float* map, F absmax) {
  F x = _mm256_setr_ps(map[codes[0]], map[codes[1]], map[codes[2]], map[codes[3]], map[codes[4]], map[codes[5]],
                       map[codes[6]], map[codes[7]]);
  return _mm256_mul_ps(x, absmax);
}
ZT_QLOOKUP(__m256i, _mm256)
// Stores the codes of xn (qindex_code per lane, [Note: 8-bit code search]). CHECK: stores
// nothing and returns false if a lane lies within kQMargin patterns of its threshold.
template <bool CHECK>
inline bool vcodes(uint8_t* codes, F xn, const QLookup& t) {
  __m256i u = _mm256_castps_si256(xn);
  __m256i neg = _mm256_srai_epi32(u, 31);
  __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  __m256i r = _mm256_sub_epi32(_mm256_min_epi32(_mm256_max_epi32(a, t.lo), t.hi), t.lo);
  __m256i idx = _mm256_add_epi32(_mm256_srl_epi32(r, t.shift), _mm256_and_si256(neg, t.nb));
  alignas(32) int32_t ix[W];
  _mm256_store_si256((__m256i*)ix, idx);
  asm("" : "+m"(ix));  // read the indices back from memory: cheaper on Zen than 8 extracts
  const int32_t* E = t.entries;
  __m256i e = _mm256_setr_epi32(E[ix[0]], E[ix[1]], E[ix[2]], E[ix[3]], E[ix[4]], E[ix[5]], E[ix[6]], E[ix[7]]);
  __m256i key = _mm256_xor_si256(_mm256_and_si256(r, t.mask), _mm256_and_si256(neg, t.mask));
  __m256i thr = _mm256_and_si256(e, t.mask);
  if (CHECK) {
    __m256i near = _mm256_cmpgt_epi32(t.margin, _mm256_abs_epi32(_mm256_sub_epi32(key, thr)));
    __m256i has = _mm256_srai_epi32(_mm256_slli_epi32(e, 8), 31);  // bit 23
    if (!_mm256_testz_si256(near, has)) return false;
  }
  __m256i code = _mm256_sub_epi32(_mm256_srli_epi32(e, 24), _mm256_cmpgt_epi32(key, thr));
  code = _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(xn, xn, _CMP_UNORD_Q)), code);
  __m128i w = vpack16(code);
  _mm_storel_epi64((__m128i*)codes, _mm_packus_epi16(w, w));
  return true;
}
inline float vabsmax(const float* x, int64_t len) {  // absmax_scalar's result
  F mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  const F abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t j = 0;
  for (; j + W <= len; j += W) {
    F ax = _mm256_and_ps(_mm256_loadu_ps(x + j), abs);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(ax, ax, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, ax);  // a NaN lane is flagged above; max only of the others matters
  }
  float lanes[W];
  _mm256_storeu_ps(lanes, mx);
  float tail = absmax_scalar(x + j, len - j);
  if (_mm256_movemask_ps(nan) || tail != tail) return NAN;
  for (float l : lanes) tail = std::max(tail, l);
  return tail;
}
// lion_sign() per lane: +1, -1, or 0 (for +-0 and NaN).
inline F vsign(F x) {
  const F zero = _mm256_setzero_ps();
  return _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f)),
                      _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.0f)));
}
ZT_NO_BYTE_TABLES
#include "cpu/adam_simd.inc"
#include "cpu/lion_simd.inc"
#include "cpu/sumsq_simd.inc"
}  // namespace
}  // namespace avx2
#pragma GCC pop_options

// ---- AVX-512 (F, BW, VL): 16 lanes ---------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace avx512 {
namespace {
#include "cpu/avx512_lanes.inc"
ZT_NO_BYTE_TABLES
#include "cpu/adam_simd.inc"
#include "cpu/lion_simd.inc"
#include "cpu/sumsq_simd.inc"
}  // namespace
}  // namespace avx512
#pragma GCC pop_options

// ---- AVX-512 + VBMI: the same 16 lanes, 8-bit moments by byte permutes -----------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")
namespace avx512vbmi {
namespace {
#include "cpu/avx512_lanes.inc"
#include "cpu/vbmi_tables.inc"
#include "cpu/adam_simd.inc"
#include "cpu/lion_simd.inc"
}  // namespace
}  // namespace avx512vbmi
#pragma GCC pop_options
#undef ZT_LANE_ARITHMETIC
#undef ZT_QLOOKUP
#undef ZT_FMIX32
#undef ZT_NO_BYTE_TABLES
#endif  // ZT_X86

namespace {

Kernel pick_kernel(const ZtAdamArgs& a, int simd) {
#ifdef ZT_X86
  if (simd >= ZT_SIMD_AVX512_VBMI) return avx512vbmi::pick(a);
  if (simd >= ZT_SIMD_AVX512) return avx512::pick(a);
  if (simd >= ZT_SIMD_AVX2) return avx2::pick(a);
#endif
  return adam_scalar;
}

LionKernel pick_lion_kernel(const ZtLionArgs& a, int simd) {
#ifdef ZT_X86
  if (simd >= ZT_SIMD_AVX512_VBMI) return avx512vbmi::pick_lion(a);
  if (simd >= ZT_SIMD_AVX512) return avx512::pick_lion(a);
  if (simd >= ZT_SIMD_AVX2) return avx2::pick_lion(a);
#endif
  return lion_scalar;
}

// The scalar sum of squares: the same blocks as sumsq_simd.inc, 8 float lanes per block.
template <int DT>
double sumsq_scalar(const void* grad, int64_t begin, int64_t end, float scale) {
  double acc = 0.0;
  for (int64_t b = begin; b < end; b += kSumsqBlock) {
    int64_t e = std::min<int64_t>(end, b + kSumsqBlock);
    float lanes[8] = {0};
    int64_t i = b;
    for (; i + 8 <= e; i += 8)
      for (int l = 0; l < 8; ++l) {
        float g = load_grad_scalar(grad, DT, i + l) * scale;
        lanes[l] += g * g;
      }
    for (; i < e; ++i) {
      float g = load_grad_scalar(grad, DT, i) * scale;
      lanes[0] += g * g;
    }
    for (int l = 0; l < 8; ++l) acc += lanes[l];
  }
  return acc;
}

SumsqKernel pick_sumsq_kernel(int dtype, int simd) {
#ifdef ZT_X86
  if (simd >= ZT_SIMD_AVX512) return avx512::pick_sumsq(dtype);  // VBMI adds nothing to a sum
  if (simd >= ZT_SIMD_AVX2) return avx2::pick_sumsq(dtype);
#endif
  if (dtype == ZT_BF16) return sumsq_scalar<ZT_BF16>;
  if (dtype == ZT_F16) return sumsq_scalar<ZT_F16>;
  return sumsq_scalar<ZT_F32>;
}

// Elements per thread below which waking workers costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 16;
constexpr int64_t kChunk = 1 << 16;  // elements per work chunk, a multiple of QB

}  // namespace

namespace {

// What every step's args share: the gradient and output dtypes and the SIMD level. 0, or
// ZT_ERR_ARGS / ZT_ERR_SIMD with the reason recorded for zt_cpu_last_error().
template <class Args>
int64_t check_io(const char* fn, const Args& a, int64_t t, int supported) {
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

// 0, or ZT_ERR_ARGS / ZT_ERR_SIMD with the reason recorded for zt_cpu_last_error().
int64_t check_args(const ZtAdamArgs& a, int64_t t, int supported) {
  const char* fn = "zt_adam_step_multi";
  if (a.n < 0) return zt::set_error(fn, "args[%lld].n = %lld < 0", (long long)t, (long long)a.n), ZT_ERR_ARGS;
  if (a.n > 0 && (!a.master || !a.exp_avg || !a.exp_avg_sq || !a.grad))
    return zt::set_error(fn, "args[%lld] has a NULL buffer", (long long)t), ZT_ERR_ARGS;
  if (a.master_dtype != ZT_F32 && a.master_dtype != ZT_BF16)
    return zt::set_error(fn, "args[%lld].master_dtype = %d is not ZT_F32 or ZT_BF16", (long long)t, a.master_dtype),
           ZT_ERR_ARGS;
  for (int k = 0; k < 2; ++k) {
    int dt = k ? a.exp_avg_sq_dtype : a.exp_avg_dtype;
    const char* name = k ? "exp_avg_sq" : "exp_avg";
    if (dt != ZT_F32 && dt != ZT_BF16 && dt != ZT_Q8)
      return zt::set_error(fn, "args[%lld].%s_dtype = %d is not ZT_F32, ZT_BF16 or ZT_Q8", (long long)t, name, dt),
             ZT_ERR_ARGS;
    if (dt == ZT_Q8 && a.n > 0 && (!(k ? a.exp_avg_sq_absmax : a.exp_avg_absmax) || !a.qmaps))
      return zt::set_error(fn, "args[%lld]: 8-bit %s without its absmax or the quantization maps", (long long)t, name),
             ZT_ERR_ARGS;
  }
  return check_io(fn, a, t, supported);
}

// Runs kernels[t] over every buffer args[t] (one parallel region for all of them): what
// adam_step_multi and lion_step_multi share. Returns the non-finite gradients counted.
template <class Args, class K>
int64_t run_buffers(const Args* args, int64_t count, const std::vector<Coef>& coefs, const std::vector<K>& kernels) {
  std::vector<int64_t> starts;  // starts[t] = first global index of buffer t
  starts.reserve(count + 1);
  int64_t total = 0;
  for (int64_t t = 0; t < count; ++t) {
    starts.push_back(total);
    total += args[t].n;
  }
  starts.push_back(total);

  int threads = args[0].threads > 0 ? args[0].threads : zt::hardware_threads();
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, total / kMinPerThread));
  std::atomic<int64_t> nonfinite{0};
  // Where a slice boundary falls inside a buffer it is rounded up to a block of that
  // buffer (QB elements; both neighbours round the same boundary the same way), so an
  // 8-bit block is re-quantized by one thread, every element is computed by the same code
  // whatever the thread count (bitwise-stable results), and threads never share a line.
  auto run_slice = [&](int64_t begin, int64_t end) {
    auto local_bound = [&](int64_t global, int64_t t) {
      int64_t x = std::min(std::max(global, starts[t]), starts[t + 1]) - starts[t];
      return std::min<int64_t>(args[t].n, (x + QB - 1) / QB * QB);
    };
    int64_t local = 0;
    auto first = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (int64_t t = std::max<int64_t>(0, first); t < count && starts[t] <= end; ++t) {
      int64_t lo = local_bound(begin, t), hi = local_bound(end, t);
      if (lo < hi) local += kernels[t](args[t], coefs[t], lo, hi);
    }
    return local;
  };
  // [Note: Adam work chunks] The threads take kChunk-element chunks of the concatenated
  // range from a shared counter instead of one fixed slice each: on a machine shared with
  // other processes (or torch's own threads) a thread that loses its core for a while no
  // longer holds up the step with the rest of its slice; the others take its chunks.
  const int64_t chunks = (total + kChunk - 1) / kChunk;
  std::atomic<int64_t> next{0};
  zt::ThreadPool::instance().run(threads, [&](int, int) {
    int64_t local = 0;
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;)
      local += run_slice(c * kChunk, std::min(total, (c + 1) * kChunk));
    nonfinite += local;
  });
  return nonfinite.load();
}

// The checks, coefficients and kernels of `count` buffers, then run_buffers: what
// zt_adam_step_multi and zt_lion_step_multi do. `prepare(args, simd, coefs, qindexes)` appends the
// buffer's Coef (its 8-bit moments' indexes kept alive in `qindexes`) and returns its kernel.
template <class Args, class K, class Check, class Prepare>
int64_t step_multi(const char* fn, const Args* args, int64_t count, Check check, Prepare prepare) {
  if (count < 0) return zt::set_error(fn, "count = %lld < 0", (long long)count), ZT_ERR_ARGS;
  if (count == 0) return 0;
  const int supported = zt_cpu_simd_supported();
  for (int64_t t = 0; t < count; ++t) {
    int64_t rc = check(args[t], t, supported);
    if (rc < 0) return rc;
  }
  std::vector<Coef> coefs;
  std::vector<K> kernels;
  std::vector<std::shared_ptr<const QIndex>> qindexes;  // what the coefs point to, alive until the end
  coefs.reserve(count);
  kernels.reserve(count);
  for (int64_t t = 0; t < count; ++t)
    kernels.push_back(prepare(args[t], args[t].simd == ZT_SIMD_AUTO ? supported : args[t].simd, coefs, qindexes));
  return run_buffers(args, count, coefs, kernels);
}

int64_t adam_step_multi(const ZtAdamArgs* args, int64_t count) {
  return step_multi<ZtAdamArgs, Kernel>("zt_adam_step_multi", args, count, check_args,
                                        [](const ZtAdamArgs& a, int simd, std::vector<Coef>& coefs,
                                           std::vector<std::shared_ptr<const QIndex>>& qindexes) {
    coefs.push_back(make_coef(a));
    if (a.exp_avg_dtype == ZT_Q8) {
      qindexes.push_back(qindex_for(coefs.back().map_m, coefs.back().mid_m));
      coefs.back().qi_m = qindexes.back().get();
    }
    if (a.exp_avg_sq_dtype == ZT_Q8) {
      qindexes.push_back(qindex_for(coefs.back().map_v, coefs.back().mid_v));
      coefs.back().qi_v = qindexes.back().get();
    }
    return pick_kernel(a, simd);
  });
}

// 0, or ZT_ERR_ARGS / ZT_ERR_SIMD with the reason recorded for zt_cpu_last_error().
int64_t check_lion_args(const ZtLionArgs& a, int64_t t, int supported) {
  const char* fn = "zt_lion_step_multi";
  if (a.n < 0) return zt::set_error(fn, "args[%lld].n = %lld < 0", (long long)t, (long long)a.n), ZT_ERR_ARGS;
  if (a.n > 0 && (!a.master || !a.exp_avg || !a.grad))
    return zt::set_error(fn, "args[%lld] has a NULL buffer", (long long)t), ZT_ERR_ARGS;
  if (a.master_dtype != ZT_F32 && a.master_dtype != ZT_BF16)
    return zt::set_error(fn, "args[%lld].master_dtype = %d is not ZT_F32 or ZT_BF16", (long long)t, a.master_dtype),
           ZT_ERR_ARGS;
  if (a.exp_avg_dtype != ZT_F32 && a.exp_avg_dtype != ZT_BF16 && a.exp_avg_dtype != ZT_Q8)
    return zt::set_error(fn, "args[%lld].exp_avg_dtype = %d is not ZT_F32, ZT_BF16 or ZT_Q8", (long long)t,
                         a.exp_avg_dtype), ZT_ERR_ARGS;
  if (a.exp_avg_dtype == ZT_Q8 && a.n > 0 && (!a.exp_avg_absmax || !a.qmaps))
    return zt::set_error(fn, "args[%lld]: 8-bit exp_avg without its absmax or the quantization maps", (long long)t),
           ZT_ERR_ARGS;
  return check_io(fn, a, t, supported);
}

int64_t lion_step_multi(const ZtLionArgs* args, int64_t count) {
  return step_multi<ZtLionArgs, LionKernel>("zt_lion_step_multi", args, count, check_lion_args,
                                            [](const ZtLionArgs& a, int simd, std::vector<Coef>& coefs,
                                               std::vector<std::shared_ptr<const QIndex>>& qindexes) {
    coefs.push_back(make_lion_coef(a));
    if (a.exp_avg_dtype == ZT_Q8) {
      qindexes.push_back(qindex_for(coefs.back().map_m, coefs.back().mid_m));
      coefs.back().qi_m = qindexes.back().get();
    }
    return pick_lion_kernel(a, simd);
  });
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

// Lion over `count` independent buffers in one parallel region, as zt_adam_step_multi.
// Returns the number of non-finite scaled gradients seen, or ZT_ERR_ARGS, ZT_ERR_SIMD or
// ZT_ERR_EXCEPTION (message in zt_cpu_last_error()).
ZT_API int64_t zt_lion_step_multi(const ZtLionArgs* args, int64_t count) {
  return zt::guard<int64_t>("zt_lion_step_multi", ZT_ERR_EXCEPTION, [&] { return lion_step_multi(args, count); });
}

// Sum of squares of (grad * scale) in double, for global grad-norm clipping of
// host-resident gradients, stored in *out: float partial sums per block of kSumsqBlock
// folded into double, relative error ~1e-7. Non-finite values propagate (the sum becomes
// inf/NaN). simd: a ZtSimd level (ZT_SIMD_AUTO: the best this CPU runs). Returns 0,
// ZT_ERR_ARGS, ZT_ERR_SIMD or ZT_ERR_EXCEPTION (message in zt_cpu_last_error()).
ZT_API int32_t zt_grad_sumsq(const void* grad, int32_t dtype, int64_t n, float scale, int32_t threads, int32_t simd,
                             double* out) {
  return zt::guard<int32_t>("zt_grad_sumsq", ZT_ERR_EXCEPTION, [&]() -> int32_t {
    if (!out || (n > 0 && !grad) || dtype < ZT_F32 || dtype > ZT_F16)
      return zt::set_error("zt_grad_sumsq", "NULL buffer or dtype %d is not a ZtDtype", dtype), ZT_ERR_ARGS;
    const int supported = zt_cpu_simd_supported();
    simd = simd == ZT_SIMD_AUTO ? supported : simd;
    if (simd < ZT_SIMD_SCALAR || simd > supported)
      return zt::set_error("zt_grad_sumsq", "SIMD level %d is not supported by this CPU (best: %d)", simd, supported),
             ZT_ERR_SIMD;
    const SumsqKernel kernel = pick_sumsq_kernel(dtype, simd);
    *out = 0.0;
    if (n <= 0) return 0;
    threads = threads > 0 ? threads : zt::hardware_threads();
    threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, n / kMinPerThread));
    double partial[256] = {0};
    threads = std::min(threads, 256);
    zt::ThreadPool::instance().run(threads, [&](int tid, int nt) {
      int64_t per = (n + nt - 1) / nt;
      int64_t begin = std::min<int64_t>(n, per * tid), end = std::min<int64_t>(n, begin + per);
      partial[tid] = kernel(grad, begin, end, scale);
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
ZT_API int64_t zt_lion_args_size(void) noexcept { return (int64_t)sizeof(ZtLionArgs); }

// The calling thread's message for the last failure of an export of this library.
ZT_API const char* zt_cpu_last_error(void) noexcept { return zt::g_last_error; }
