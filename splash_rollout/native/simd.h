// Vector helpers shared by the native kernels (paged_mla.cpp, small_matmul.h, fused_rows.cpp,
// sample_rows.cpp, expanded_attention.cpp): the 16-lane float vector, bfloat16 storage, a register
// pin for loaded vectors, an L2 prefetch, sixteen horizontal sums at once, a 16-lane exp, element
// and 16-element loads, and rounding to bfloat16.
#pragma once
#include <cstdint>
#include <cstring>

namespace {

typedef float f16v __attribute__((vector_size(64)));  // 16 float lanes (one AVX-512 register)
typedef uint16_t bf16;

// Keeps a loaded vector in a register: without it GCC folds the load into every FMA that uses it,
// and a 4x4 tile then issues two loads per FMA instead of one per two (measured: 3x slower).
#if defined(__AVX512F__)  // a 64-byte vector is one register only there
template <typename V> inline void in_register(V& v) { asm("" : "+v"(v)); }
#else
template <typename V> inline void in_register(V& v) { (void)v; }
#endif

// Requests the cache line at p into L2 (prefetcht2), for a stream the kernel reads a little later.
// L2, not L1 (prefetcht0), because it measured faster, likely since an L1 prefetch holds one of the
// core's few L1 miss buffers until its line arrives and so stalls a loop that requests every line of
// several streams. Measured on the development machine (AMD EPYC, 2 threads): the paged attention's
// logit pass over a 256-request decode (keys from DRAM) 10.7-13.2 -> 7.4-9.3 ms per layer and over
// keys in L2 27 -> 17 us per request; a 4-row decode step, weight-streaming, 1.15x (bf16) / 1.23x (fp32).
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 1); }

// Sixteen horizontal sums at once: lane l of the result is the sum of v[l]'s lanes (a transposing
// add tree, 15 adds and 30 shuffles, instead of 16 lane-by-lane reductions).
inline f16v hsum16(const f16v* v) {
  f16v a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // [v(2i) 8 partial sums | v(2i+1) 8 partial sums]
    const f16v p = v[2 * i], q = v[2 * i + 1];
    a[i] = __builtin_shufflevector(p, q, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p, q, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // 4 partial sums each of v(4i) .. v(4i+3)
    const f16v p = a[2 * i], q = a[2 * i + 1];
    b[i] = __builtin_shufflevector(p, q, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(p, q, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // 2 partial sums each of v(8i) .. v(8i+7)
    const f16v p = b[2 * i], q = b[2 * i + 1];
    c[i] = __builtin_shufflevector(p, q, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(p, q, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// exp of 16 floats: 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts) and p
// the degree-6 Taylor polynomial (|r| <= ln 2 / 2: relative error ~1e-7, about one ulp). Below
// -87.3 (where expf underflows, and for the -inf of a masked key) the result is exactly 0.
inline f16v exp16(f16v x) {
  typedef f16v V;
  typedef int32_t I __attribute__((vector_size(64)));
  const V lo = V{} - 87.3f, hi = V{} + 88.7f;
  const V xc = x < lo ? lo : (x > hi ? hi : x);
  const V n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const V r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  V p = V{} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(V));
  const V y = p * scale;
  return x < lo ? V{} : y;
}

// One element of T (float or bfloat16) as a float.
inline float widen(float v) { return v; }
inline float widen(bf16 v) {
  const uint32_t bits = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A float as T: float as is, bfloat16 rounded to nearest even (a NaN stays a quiet NaN).
template <typename T> inline T narrow(float f);
template <> inline float narrow<float>(float f) { return f; }
template <> inline bf16 narrow<bf16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16)((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (bf16)(bits >> 16);
}

// 16 consecutive elements of T (float or bfloat16) as floats.
template <typename T> inline f16v load16(const T* p);
template <> inline f16v load16<float>(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <> inline f16v load16<bf16>(const bf16* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f16v f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

}  // namespace
